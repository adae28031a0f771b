"""Activations as FP8 rows: each row of x quantized to e4m3 with one float32 scale, x ~= data * scale.

The W8A8 prefill product of a per-channel or per-tensor FP8 weight quantizes its input this way
(kernels/quant_fp8_w8a8.py, quantize_fp8_rows with a group of the whole row: scale = amax / 448, 1 for
a row of zeros). A kernel that writes x can write it in this form instead (the fused add + RMSNorm,
kernels/rmsnorm.py), which saves the product its quantization launch and halves the bytes of x; the
bits are those quantize_fp8_rows gives on x rounded to its activation dtype.

round_to_e4m3 is the rounding every Triton producer of e4m3 values here shares: by hand, because the
Triton interpreter's float8 conversion loses the mantissa carry (on the GPU it is the same
round-to-nearest-even as the hardware conversion).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["Fp8Rows", "quantize_row", "round_to_e4m3"]

E4M3_MAX = tl.constexpr(448.0)
E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
E4M3_SUBNORMAL_ROUNDER = tl.constexpr(1.5 * 2.0**14)  # adding it rounds a float32 to a multiple of 2^-9


@dataclass(frozen=True)
class Fp8Rows:
    """data [T, K] float8_e4m3fn, contiguous; scales [T, 1] float32 (x[t] ~= data[t] * scales[t]);
    dtype: the activation dtype x had (a product's output takes it)."""

    data: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[T, K] of dtype: data * scales (exact in float32)."""
        return (self.data.float() * self.scales).to(dtype)


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
def quantize_row(row_f32):
    """One row (float32 [BLOCK], masked lanes 0) as FP8 rows: (the e4m3 values as float32, the scale):
    scale = amax / 448 (1 where the row is all zeros), values = row / scale rounded (module doc)."""
    amax = tl.max(tl.abs(row_f32), axis=0)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    return tl.clamp(round_to_e4m3(row_f32 / scale), -E4M3_MAX, E4M3_MAX), scale
