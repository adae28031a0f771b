"""Which projections run through tpfuse's Triton GEMV at one row, measured per weight shape at start-up.

Batch-1 decode streams every weight once per token, and how close a kernel comes to the memory
bandwidth depends on the weight's shape and on the GPU, so the choice is measured, never assumed:
for each distinct weight (shape, dtype, bias or not) among a model's projections, F.linear (cuBLAS)
and the GEMV (kernels/gemv.py) are timed at one row by CUDA-graph replay over the model's own
weights of that shape (distinct tensors, so as L2-cold as in decode), and the GEMV is taken where it
needs at most MARGIN of cuBLAS's time. layers._linear then sends one-row inputs of a chosen weight
to it; every other input stays on F.linear.

The choice is process-wide, keyed by (shape, dtype, device, bias): engines and ranks sharing a GPU
share it, and a shape is timed once. TPFUSE_GEMV overrides it: auto (default, measured), triton
(every eligible weight, untimed: tests), cublas (none).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpfuse.gpu_timing import graph_us
from tpfuse.kernels import gemv_op

log = logging.getLogger("tpfuse")

MARGIN = 0.97  # the GEMV must need at most 97 % of cuBLAS's time: measurement noise never flips a tie
MODES = ("auto", "triton", "cublas")
Key = tuple[tuple[int, ...], torch.dtype, torch.device, bool]


@dataclass(frozen=True)
class Choice:
    """One weight shape's decision; the times are None when TPFUSE_GEMV forced it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    gemv: bool
    cublas_us: float | None = None
    gemv_us: float | None = None

    def describe(self) -> str:
        n, k = self.shape
        route = "Triton GEMV" if self.gemv else "cuBLAS"
        if self.cublas_us is None:
            return f"{n}x{k}: {route} (TPFUSE_GEMV)"
        return f"{n}x{k}: {route} ({self.gemv_us:.1f} us vs cuBLAS {self.cublas_us:.1f} us)"


_DECIDED: dict[Key, Choice] = {}
_CHOSEN: set[Key] = set()  # the keys whose Choice.gemv is True: the hot-path lookup


def _key(weight: torch.Tensor, bias: torch.Tensor | None) -> Key:
    return (tuple(weight.shape), weight.dtype, weight.device, bias is not None)


def uses_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether x @ weight.T (+ bias) goes to the GEMV: one contiguous row and a chosen weight."""
    return (
        bool(_CHOSEN)
        and x.dim() == 2
        and x.shape[0] == 1
        and x.is_contiguous()
        and _key(weight, bias) in _CHOSEN
    )


def _eligible(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.dtype in (torch.bfloat16, torch.float16) and weight.stride(1) == 1


def mode() -> str:
    value = os.environ.get("TPFUSE_GEMV", "auto")
    if value not in MODES:
        raise ValueError(f"TPFUSE_GEMV={value!r} is not one of {', '.join(MODES)}; unset it for auto")
    return value


def _time_us(weights: list[tuple[torch.Tensor, torch.Tensor | None]], use_gemv: bool) -> float:
    x = torch.randn(1, weights[0][0].shape[1], device=weights[0][0].device).to(weights[0][0].dtype)
    if use_gemv:
        calls = [lambda w=w, b=b: gemv_op(x, w, b) for w, b in weights]
    else:
        calls = [lambda w=w, b=b: F.linear(x, w, b) for w, b in weights]
    big = weights[0][0].numel() * weights[0][0].element_size() > (64 << 20)
    return graph_us(calls, min_launches=8 if big else 32, replays=5, samples=3)


@torch.inference_mode()
def choose(projections: Iterable[tuple[torch.Tensor, torch.Tensor | None]], time_us=None) -> list[Choice]:
    """Decides every new (weight, bias) shape among projections (layers.projections(model)) and
    returns this call's decisions; shapes decided before (another engine, another rank) are kept.
    Runs on the GPU before any model CUDA graph is captured (it captures its own). time_us(weights,
    use_gemv) -> us per call replaces the measurement (tests); without it, auto decides nothing on
    CPU (F.linear throughout)."""
    how = mode()
    groups: dict[Key, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    for weight, bias in projections:
        key = _key(weight, bias)
        if key not in _DECIDED and _eligible(weight):
            groups.setdefault(key, []).append((weight, bias))
    decided = []
    for key, weights in groups.items():
        if how == "auto":
            if time_us is None and not weights[0][0].is_cuda:
                continue
            timer = time_us or _time_us
            cublas_us, gemv_us = timer(weights, use_gemv=False), timer(weights, use_gemv=True)
            choice = Choice(key[0], key[1], gemv_us <= MARGIN * cublas_us, cublas_us, gemv_us)
        else:
            choice = Choice(key[0], key[1], how == "triton")
        _DECIDED[key] = choice
        if choice.gemv:
            _CHOSEN.add(key)
        decided.append(choice)
    if decided:
        log.info("one-row projections: %s", "; ".join(c.describe() for c in decided))
    return decided


def decisions() -> list[Choice]:
    """Every decision made in this process so far."""
    return list(_DECIDED.values())


def reset() -> None:
    """Forgets every decision (tests)."""
    _DECIDED.clear()
    _CHOSEN.clear()
