"""Which projections run through tpfuse's Triton GEMV at 1-4 rows, measured per weight shape at start-up.

Batch-1 decode (one row) and a batch-1 speculative verify (k + 1 rows) stream every weight once per
step, and how close a kernel comes to the memory bandwidth depends on the weight's shape, the rows
and the GPU, so the choice is measured, never assumed: for each distinct weight (shape, dtype, bias
or not) among a model's projections and each row bucket (1, 2, 4: the GEMV's tile sizes; 3 rows use
the 4-row tile), F.linear (cuBLAS) and the GEMV (kernels/gemv.py) are timed at the bucket's row count
by CUDA-graph replay over the model's own weights of that shape (distinct tensors, so as L2-cold as
in decode), and the GEMV is taken where it needs at most MARGIN of cuBLAS's time. layers._linear
then sends inputs of a chosen (weight, bucket) to it; every other input stays on F.linear.

The choice is process-wide, keyed by (shape, dtype, device, bias, rows): engines and ranks sharing a
GPU share it, and a shape is timed once. TPFUSE_GEMV overrides it: auto (default, measured), triton
(every eligible weight, untimed: tests), cublas (none).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpfuse.kernels import gemv_op
from tpfuse.kernels.gemv import MAX_ROWS

log = logging.getLogger("tpfuse")

MARGIN = 0.97  # the GEMV must need at most 97 % of cuBLAS's time: measurement noise never flips a tie
MODES = ("auto", "triton", "cublas")
ROW_BUCKETS = (1, 2, 4)  # the GEMV's row tiles (kernels/gemv.tile_for_rows); MAX_ROWS is the last
Key = tuple[tuple[int, ...], torch.dtype, torch.device, bool, int]  # shape, dtype, device, bias, rows


@dataclass(frozen=True)
class Choice:
    """One weight shape's decision; the times are None when TPFUSE_GEMV forced it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: int
    gemv: bool
    cublas_us: float | None = None
    gemv_us: float | None = None

    def describe(self) -> str:
        n, k = self.shape
        where = f"{n}x{k} at {self.rows} row{'s' if self.rows > 1 else ''}"
        route = "Triton GEMV" if self.gemv else "cuBLAS"
        if self.cublas_us is None:
            return f"{where}: {route} (TPFUSE_GEMV)"
        return f"{where}: {route} ({self.gemv_us:.1f} us vs cuBLAS {self.cublas_us:.1f} us)"


_DECIDED: dict[Key, Choice] = {}
_CHOSEN: set[Key] = set()  # the keys whose Choice.gemv is True: the hot-path lookup


def _key(weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> Key:
    return (tuple(weight.shape), weight.dtype, weight.device, bias is not None, rows)


def _bucket(rows: int) -> int:
    return 1 if rows <= 1 else 2 if rows == 2 else 4


def uses_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether x @ weight.T (+ bias) goes to the GEMV: 1-4 rows contiguous along K, and a weight
    chosen at that row bucket."""
    return (
        bool(_CHOSEN)
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and _key(weight, bias, _bucket(x.shape[0])) in _CHOSEN
    )


def _eligible(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.dtype in (torch.bfloat16, torch.float16) and weight.stride(1) == 1


def mode() -> str:
    value = os.environ.get("TPFUSE_GEMV", "auto")
    if value not in MODES:
        raise ValueError(f"TPFUSE_GEMV={value!r} is not one of {', '.join(MODES)}; unset it for auto")
    return value


def _time_us(weights: list[tuple[torch.Tensor, torch.Tensor | None]], use_gemv: bool, rows: int) -> float:
    from tpfuse.bench.gpu_timing import graph_us

    first = weights[0][0]
    x = torch.randn(rows, first.shape[1], device=first.device).to(first.dtype)
    if use_gemv:
        calls = [lambda w=w, b=b: gemv_op(x, w, b) for w, b in weights]
    else:
        calls = [lambda w=w, b=b: F.linear(x, w, b) for w, b in weights]
    big = first.numel() * first.element_size() > (64 << 20)
    return graph_us(calls, min_launches=8 if big else 32, replays=5, samples=3)


@torch.inference_mode()
def choose(projections: Iterable[tuple[torch.Tensor, torch.Tensor | None]], time_us=None) -> list[Choice]:
    """Decides every new (weight, bias) shape among projections (layers.projections(model)) and
    returns this call's decisions; shapes decided before (another engine, another rank) are kept.
    Runs on the GPU before any model CUDA graph is captured (it captures its own). time_us(weights,
    use_gemv, rows) -> us per call replaces the measurement (tests); without it, auto decides nothing
    on CPU (F.linear throughout)."""
    how = mode()
    groups: dict[Key, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    for weight, bias in projections:
        for rows in ROW_BUCKETS:
            key = _key(weight, bias, rows)
            if key not in _DECIDED and _eligible(weight):
                groups.setdefault(key, []).append((weight, bias))
    decided = []
    for key, weights in groups.items():
        shape, dtype, rows = key[0], key[1], key[4]
        if how == "auto":
            if time_us is None and not weights[0][0].is_cuda:
                continue
            timer = time_us or _time_us
            cublas_us, gemv_us = timer(weights, False, rows), timer(weights, True, rows)
            choice = Choice(shape, dtype, rows, gemv_us <= MARGIN * cublas_us, cublas_us, gemv_us)
        else:
            choice = Choice(shape, dtype, rows, how == "triton")
        _DECIDED[key] = choice
        if choice.gemv:
            _CHOSEN.add(key)
        decided.append(choice)
    if decided:
        log.info("small-batch projections: %s", "; ".join(c.describe() for c in decided))
    return decided


def decisions() -> list[Choice]:
    """Every decision made in this process so far."""
    return list(_DECIDED.values())


def reset() -> None:
    """Forgets every decision (tests)."""
    _DECIDED.clear()
    _CHOSEN.clear()
