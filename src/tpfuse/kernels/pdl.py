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

`supported(device)`: whether the device runs it, found once per device by compiling and running a
chain of PDL kernels in a CUDA graph (never from an architecture list); off on CPUs, under the
interpreter and with TPFUSE_PDL=0. `enabled(device)`: whether launches use it now: supported and
turned on by `choose`. Launches are plain until then: the engine measures its decode graph both ways
at start-up (engine/launch_choice.py; on the H200 PDL paid for a MoE model and slowed a dense one's
large GEMVs), benchmarks choose it with a flag.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tpfuse import knobs

__all__ = ["begin", "choose", "enabled", "launch", "launch_dependents", "supported", "wait"]

_SUPPORTED: dict[int, bool] = {}  # probe results by device index
_CHOSEN: dict[int, bool] = {}  # choose(): on / off by device index
_LAUNCH: dict[int, dict] = {}  # launch()'s keyword arguments by device index
_ON, _OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}

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


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def supported(device: torch.device) -> bool:
    """Whether this device runs PDL launches correctly (probed once per device; module doc)."""
    if device.type != "cuda" or not HAVE_GDC or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if not knobs.current.pdl:
        return False
    index = _index(device)
    if index not in _SUPPORTED:
        _SUPPORTED[index] = _probe(torch.device("cuda", index))
    return _SUPPORTED[index]


def choose(device: torch.device, on: bool) -> None:
    """Turns PDL launches on (where supported) or off (the default) for this device from now on."""
    _CHOSEN[_index(device)] = on
    _LAUNCH.pop(_index(device), None)


def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL now (supported, and turned on by choose)."""
    return device.type == "cuda" and _CHOSEN.get(_index(device), False) and supported(device)


def launch(device: torch.device) -> dict:
    """Keyword arguments for a PDL kernel's launch: its PDL constexpr and Triton's launch_pdl (decided
    once per device until the next choose)."""
    if device.type != "cuda":
        return _OFF
    kwargs = _LAUNCH.get(device.index)
    if kwargs is None:
        kwargs = _LAUNCH[_index(device)] = _ON if enabled(device) else _OFF
    return kwargs
