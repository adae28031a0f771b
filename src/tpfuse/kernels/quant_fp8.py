"""FP8 (e4m3) W8A16 linear layer: out = x @ (weight * scale).T (+ bias).

Scales are one float32 tensor [ceil(N / block_n), ceil(K / block_k)] for every FP8 format:
per-channel is block (1, K) ([N, 1]), per-tensor is expanded to per-channel at load, and
DeepSeek-V3 / Qwen3-FP8's 128x128 blocks are block (128, 128) (their weight_scale_inv, as stored).

fp8_linear (every size): each program dequantizes a [BLOCK_N, BLOCK_K] weight tile in registers and
multiplies it with one row of x in fp32 (block_m 1, the GEMV form) or, rounded to x's dtype, on the
tensor cores with a BLOCK_M-row tile of x. The weight bytes streamed are half of bf16's, which is what
decode is bound by. The W8A8 form (x quantized too, FP8 tensor cores) is kernels/quant_fp8_w8a8.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.quant_int import IntTile as Fp8Tile
from tpfuse.kernels.quant_int import launch_block_k, launch_tile

FP8_MAX = 448.0  # largest finite e4m3 value
FP8_DTYPE = torch.float8_e4m3fn


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] e4m3, scale [ceil(N/bn), ceil(K/bk)] -> the float32 weight [N, K] (exact)."""
    n, k = weight.shape
    s = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return weight.float() * s


def fp8_linear_ref(x, weight, scale, block, bias=None):
    """x [M, K] -> [M, N] of x.dtype: x.float() @ dequantize_fp8(...).T (+ bias), rounded once."""
    out = x.float() @ dequantize_fp8(weight, scale, block).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    num_cols,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    HIDDEN: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < num_cols
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + (cols // SCALE_N)[:, None] * stride_sn
    if BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < HIDDEN
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first").to(
            tl.float32
        )
        w = w * tl.load(s_rows + (ks // SCALE_K)[None, :], mask=w_mask, other=0.0)
        if BLOCK_M == 1:
            xv = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            acc2 += w * xv[None, :]
        else:
            xt = tl.load(
                x_ptr + rows[:, None] * stride_xm + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            if IEEE:
                acc = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc)
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def check_fp8_weights(weight, scale, block, hidden: int) -> None:
    """Raises ValueError naming the tensor whose shape or dtype does not fit the layout above."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or weight.shape[1] != hidden or weight.stride(1) != 1:
        raise ValueError(
            f"fp8 weight must be [N, {hidden}] float8_e4m3fn contiguous; "
            f"got {tuple(weight.shape)} {weight.dtype}"
        )
    expected = (-(-weight.shape[0] // block[0]), -(-hidden // block[1]))
    if tuple(scale.shape) != expected or scale.dtype != torch.float32:
        raise ValueError(
            f"fp8 scale for a {tuple(weight.shape)} weight in blocks {block} must be {list(expected)} "
            f"float32; got {list(scale.shape)} {scale.dtype}"
        )


def fp8_linear_triton(x, weight, scale, block, bias=None, *, tile: Fp8Tile | None = None):
    """Triton fp8_linear_ref (W8A16). x: [M, K] bf16/fp16/fp32 contiguous along K. Returns new [M, N]."""
    num_rows, hidden = x.shape
    check_fp8_weights(weight, scale, block, hidden)
    num_cols = weight.shape[0]
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return out
    tile = launch_tile(tile, num_rows)
    scale = scale.contiguous()
    grid = (triton.cdiv(num_cols, tile.block_n), triton.cdiv(num_rows, tile.block_m))
    _fp8_linear_kernel[grid](
        x,
        weight,
        scale,
        bias if bias is not None else x,
        out,
        num_rows,
        num_cols,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        HIDDEN=hidden,
        SCALE_N=block[0],
        SCALE_K=block[1],
        HAS_BIAS=bias is not None,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=launch_block_k(tile, hidden),
        IEEE=x.dtype == torch.float32,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out
