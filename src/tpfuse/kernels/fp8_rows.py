"""Activations as FP8 rows: each row of x quantized to e4m3, one float32 scale per `group` columns
(the whole row, or 128), x ~= data * scale.

The W8A8 prefill product of an FP8 weight quantizes its input this way (kernels/quant_fp8_w8a8.py,
quantize_fp8_rows: scale = amax / 448 of each row's group, 1 for a group of zeros; the group is the
whole row for per-channel and per-tensor weights, the K block for block weights). A kernel that writes
x can write it in this form instead (the fused add + RMSNorm, kernels/rmsnorm.py, and the fused
all-reduce's epilogue, comm/allreduce.py), which saves the product its quantization launch and halves
the bytes of x; the bits are those quantize_fp8_rows gives on x rounded to its activation dtype.

round_to_e4m3 rounds float32 to e4m3 by hand: the GPU's conversion rounds to nearest even, and the
Triton interpreter's mis-rounds where rounding carries into the next binade (124.7 -> 64). e4m3_ready
is what every e4m3 producer calls before its conversion: the value itself on a GPU (no instruction
added to hot loops), round_to_e4m3 of it under the interpreter, so the CPU tests see the GPU's codes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK_GROUP", "Fp8Rows", "e4m3_ready", "quantize_groups", "round_to_e4m3", "store_scales_of_row"]

# The one group besides a whole row that every writer takes: the K block of the FP8 block formats
# (DeepSeek-V3, Qwen3-FP8).
BLOCK_GROUP = 128
E4M3_MAX = tl.constexpr(448.0)
E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
E4M3_SUBNORMAL_ROUNDER = tl.constexpr(1.5 * 2.0**14)  # adding it rounds a float32 to a multiple of 2^-9
# Read when @triton.jit reads it, at import: whether the kernels below run under the interpreter.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@dataclass(frozen=True)
class Fp8Rows:
    """data [T, K] float8_e4m3fn, contiguous; scales [T, ceil(K / group)] float32, contiguous (x[t, k] ~=
    data[t, k] * scales[t, k // group]); dtype: the activation dtype x had (a product's output takes
    it); group: columns per scale, K for one a row."""

    data: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[T, K] of dtype: data * scales (exact in float32)."""
        scales = self.scales.repeat_interleave(self.group, 1)[:, : self.data.shape[1]]
        return (self.data.float() * scales).to(dtype)


@triton.jit
def round_to_e4m3(y):
    """Round float32 to the nearest-even float8_e4m3fn value (still float32), so the final conversion is
    exact (module doc). Finite values only; saturation is the caller's."""
    bits = y.to(tl.uint32, bitcast=True)
    keep3 = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    magnitude = (tl.abs(y) + E4M3_SUBNORMAL_ROUNDER) - E4M3_SUBNORMAL_ROUNDER  # a multiple of 2^-9
    subnormal = (magnitude.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(y) < E4M3_MIN_NORMAL, subnormal, keep3)  # y's sign kept, -0 included


@triton.jit
def e4m3_ready(y):
    """float32 y about to be converted to float8_e4m3fn (module doc): y on a GPU, round_to_e4m3(y) under
    the interpreter."""
    if INTERPRETED:
        return round_to_e4m3(y)
    return y


@triton.jit
def quantize_groups(row_f32, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """One row (float32 [BLOCK], masked lanes 0; GROUP a power of two dividing BLOCK) as FP8 rows: (the
    values / scale, e4m3_ready and saturated at 448, as float32 [BLOCK], to convert; the scales
    [BLOCK // GROUP]), each GROUP columns' scale amax / 448 (1 where they are all zeros)."""
    groups = tl.reshape(row_f32, [BLOCK // GROUP, GROUP])
    amax = tl.max(tl.abs(groups), axis=1)
    scales = tl.where(amax > 0, amax / 448.0, 1.0)
    values = tl.clamp(e4m3_ready(groups / scales[:, None]), -E4M3_MAX, E4M3_MAX)
    return tl.reshape(values, [BLOCK]), scales


@triton.jit
def store_scales_of_row(y_f32, scales_ptr, row, hidden, GROUP: tl.constexpr):
    """One normed row (float32 [BLOCK], masked lanes 0, rounded as its activation dtype) as FP8 rows of
    GROUP columns a scale (GROUP = BLOCK: one a row): stores its ceil(hidden / GROUP) scales at
    scales_ptr + row * that many and returns the values (float32) for the caller's store."""
    BLOCK: tl.constexpr = y_f32.shape[0]
    values, scales = quantize_groups(y_f32, BLOCK, GROUP)
    num_scales = tl.cdiv(hidden, GROUP)
    g = tl.arange(0, BLOCK // GROUP)
    tl.store(scales_ptr + row * num_scales + g, scales, mask=g < num_scales)
    return values
