"""Programmatic dependent launch (PDL): a kernel launched with it may start while the kernel before it
in the stream drains, so a decode step's chain of short kernels overlaps each one's launch and ramp
with the previous one's tail (CUDA graphs keep the edges).

The contract of a kernel that takes PDL (a `PDL: tl.constexpr` argument, and launched with
`**launch(device)`):
  - it calls `wait()` before it reads anything an earlier kernel of the step wrote and before it
    writes anything (an earlier kernel may still read it): only data no kernel writes (weights,
    scales) may be loaded before that point, which is where the overlap comes from;
  - every kernel launched with PDL calls `wait()`, unconditionally: a kernel that returned before its
    predecessor finished would release its own successor early;
  - it calls `launch_dependents()` at its start: the next kernel may then be scheduled once every
    program of this one has started.
Kernels launched without it (torch's, cuBLAS) keep plain stream order, so the chain stays correct
when only some kernels take part.

`enabled(device)` says whether launches on a device use it: found once per device by compiling and
running a two-kernel chain with it (never from an architecture list), off on CPUs and under the
interpreter, and off when TPFUSE_PDL=0.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tpfuse import knobs

__all__ = ["begin", "enabled", "launch", "launch_dependents", "wait"]

_ENABLED: dict[int, bool] = {}

try:  # Triton with grid dependency control (3.3 and later)
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait

    HAVE_GDC = tl.constexpr(True)
except ImportError:  # pragma: no cover - older Triton
    HAVE_GDC = tl.constexpr(False)


@triton.jit
def wait():
    """Blocks until every earlier kernel of the stream has finished and its writes are visible."""
    if HAVE_GDC:
        _gdc_wait()


@triton.jit
def launch_dependents():
    """Lets the stream's next kernel be scheduled once every program of this one has called this."""
    if HAVE_GDC:
        _gdc_launch_dependents()


@triton.jit
def begin(PDL: tl.constexpr):
    """A PDL kernel's start, after the loads of what no kernel writes: launch_dependents, then wait
    (nothing without PDL)."""
    if PDL:
        launch_dependents()
        wait()


@triton.jit
def _probe_kernel(x_ptr, out_ptr, N: tl.constexpr, PDL: tl.constexpr):
    begin(PDL)
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) + 1.0)


def _probe(device: torch.device) -> bool:
    """A chain of PDL launches inside a CUDA graph gives the plain chain's result."""
    try:
        with torch.cuda.device(device):
            x = torch.zeros(128, device=device)
            bufs = [torch.empty_like(x) for _ in range(2)]

            def chain():
                src = x
                for i in range(8):
                    _probe_kernel[(1,)](src, bufs[i % 2], N=128, PDL=True, launch_pdl=True)
                    src = bufs[i % 2]
                return src

            chain()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain()
            out.zero_()
            graph.replay()
            torch.cuda.synchronize(device)
            return bool(torch.all(out == 8.0).item())
    except Exception:  # noqa: BLE001 - any failure means: launch without it
        return False


def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL (probed once per device; see the module doc)."""
    if device.type != "cuda" or not HAVE_GDC or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if not knobs.current.pdl:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ENABLED:
        _ENABLED[index] = _probe(torch.device("cuda", index))
    return _ENABLED[index]


def launch(device: torch.device) -> dict:
    """Keyword arguments for a PDL kernel's launch: its PDL constexpr and Triton's launch_pdl."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on} if on else {"PDL": False}
