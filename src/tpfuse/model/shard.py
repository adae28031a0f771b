"""ShardSlot: which range of a checkpoint tensor one rank holds, and where in a parameter it goes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

FLOAT_STORED = ("F32", "BF16", "F16")  # safetensors dtypes converted to the parameter's dtype on copy


def empty_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised frozen parameter (no grad) for the loader to fill through its ShardSlots."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


@dataclass(frozen=True)
class ShardSlot:
    """Range [start, start + length) along dim of a checkpoint tensor of shape full_shape, copied
    into param at [dst_start, dst_start + length) along the same dim. index: the entry of param's
    leading dim the tensor fills (stacked experts: param[index] has the tensor's rank), else None.

    stored_dtypes: the safetensors dtypes the tensor may have (quantized codes: exactly theirs).
    broadcast: the tensor is one value (shape [] or [1]) filling the whole destination (per-tensor scales).
    dummy: fills the destination for --load-format dummy (dest, generator) instead of normal(0, 0.02).
    """

    param: nn.Parameter
    full_shape: tuple[int, ...]
    dim: int
    start: int
    length: int
    dst_start: int = 0
    zero_rows: int = 0  # rows of param past this range that are zero padding, never read from disk
    index: int | None = None
    stored_dtypes: tuple[str, ...] = FLOAT_STORED
    broadcast: bool = False
    dummy: Callable[[torch.Tensor, torch.Generator], None] | None = None

    def source_index(self) -> tuple[slice, ...]:
        return (slice(None),) * self.dim + (slice(self.start, self.start + self.length),)

    def destination(self) -> torch.Tensor:
        target = self.param.data if self.index is None else self.param.data[self.index]
        return target.narrow(self.dim, self.dst_start, self.length)

    def accepts_shape(self, shape: tuple[int, ...]) -> bool:
        if self.broadcast:
            return shape in ((), (1,))
        return shape == self.full_shape
