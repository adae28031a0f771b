"""Programmatic dependent launch (PDL) for the small kernels between the GEMMs of a decode step.

A kernel launched with `launch_pdl=True` may be scheduled before the kernel ahead of it in the stream
has finished; it must execute `griddepcontrol.wait` (`gdc_wait`) before it reads or writes anything
that kernel touches. The small kernels here (norms, rope + KV store, activation, decode attention)
call `wait_for_predecessor` as their first statement, so nothing moves across the dependency: what
is gained is the launch and scheduling latency of each small kernel, hidden under the tail of the
kernel before it. Inside a CUDA graph the launch attribute becomes a programmatic edge.

Whether this GPU, driver and Triton can do it is probed, never read off an architecture list: a
tiny kernel is launched with PDL, eagerly and inside a captured CUDA graph, and must give the right
answer. `TPFUSE_PDL=0` turns PDL off; `pdl_status(device)` says whether it is on and why not.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4 exposes grid dependency control; older versions simply run without PDL.
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # pragma: no cover - depends on the installed Triton
    _gdc_wait = None


@triton.jit
def wait_for_predecessor(USE_PDL: tl.constexpr):
    """First statement of a kernel launched with launch_options(): waits until the kernel before it
    in the stream has finished and its writes are visible. A no-op when USE_PDL is False."""
    if USE_PDL:
        _gdc_wait()


@triton.jit
def _probe_kernel(x_ptr, y_ptr, USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    offs = tl.arange(0, 128)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1.0)


def _probe(device: torch.device) -> str | None:
    """None when PDL launches work on device (eagerly and in a CUDA graph), else the reason they do not."""
    if device.type != "cuda":
        return "not a CUDA device"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "Triton runs in the interpreter (TRITON_INTERPRET=1)"
    if _gdc_wait is None:
        return f"Triton {triton.__version__} has no grid dependency control (gdc_wait)"
    try:
        with torch.cuda.device(device):
            x = torch.arange(128, dtype=torch.float32, device=device)
            y = torch.empty_like(x)
            z = torch.empty_like(x)
            _probe_kernel[(1,)](x, y, USE_PDL=True, launch_pdl=True)
            _probe_kernel[(1,)](y, z, USE_PDL=True, launch_pdl=True)
            torch.cuda.synchronize(device)
            eager_ok = torch.equal(z, x + 2.0)
            z.fill_(-1.0)
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=stream):
                    _probe_kernel[(1,)](x, y, USE_PDL=True, launch_pdl=True)
                    _probe_kernel[(1,)](y, z, USE_PDL=True, launch_pdl=True)
            graph.replay()
            torch.cuda.synchronize(device)
            graph_ok = torch.equal(z, x + 2.0)
    except Exception as exc:  # the reason is the point: doctor and the logs print it
        return f"a PDL launch failed: {type(exc).__name__}: {exc}".strip()
    if not (eager_ok and graph_ok):
        return f"a PDL launch gave a wrong result (eager ok: {eager_ok}, graph ok: {graph_ok})"
    return None


_PROBED: dict[torch.device, str | None] = {}  # device -> None (PDL works) or why it does not


def pdl_status(device: torch.device) -> tuple[bool, str]:
    """(on, why): whether the small kernels on device launch with PDL, and the reason if not."""
    if os.environ.get("TPFUSE_PDL", "1") == "0":
        return False, "turned off by TPFUSE_PDL=0"
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _PROBED:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Probing launches kernels: never inside someone's capture (warm-ups before capture probe).
            return False, "not probed before CUDA-graph capture"
        _PROBED[device] = _probe(device)
    reason = _PROBED[device]
    return reason is None, reason or "on: PDL launches probed and correct"


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a small kernel's launch: USE_PDL (always) and launch_pdl (when on)."""
    on, _ = pdl_status(device)
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}
