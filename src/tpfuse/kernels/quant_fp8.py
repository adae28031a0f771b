"""FP8 (e4m3) W8A16 linear layer: out = x @ (weight * scale).T (+ bias).

Scales are one float32 tensor [ceil(N / block_n), ceil(K / block_k)] for every FP8 format:
per-channel is block (1, K) ([N, 1]), per-tensor is expanded to per-channel at load, and
DeepSeek-V3 / Qwen3-FP8's 128x128 blocks are block (128, 128) (their weight_scale_inv, as stored).

fp8_linear: one row runs the GEMV kernel here (kernels/gemv.py's layout: BLOCK_N weight rows over the
whole of K per program, 16-byte loads, an fp32 accumulator reduced once), with the scale applied
once per row after the K loop (per-channel), on x (each value times its column's scale) where the
program's rows lie in one scale block (128x128 blocks given as such), or else as one [BLOCK_N] vector
per sub-tile (block scales given per row); two or more rows run kernels/quant_dot.py (the weight cast
to x's dtype on tl.dot, scales after the loop or per K step). The weight bytes streamed are half of
bf16's, which is what decode is bound by. The W8A8 form (x quantized too, FP8 tensor cores) is
kernels/quant_fp8_w8a8.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.gemv import rounded_linear_ref
from tpfuse.kernels.quant_dot import IntTile as Fp8Tile
from tpfuse.kernels.quant_dot import launch_tile, pow2_part, quant_dot

FP8_MAX = 448.0  # largest finite e4m3 value
FP8_DTYPE = torch.float8_e4m3fn
# Tiles start-up timing tries per row bucket (model/linear_choice.py); the first is the default.
# Bucket 1: the GEMV with 8-16 KB of weight per program step (instructions per weight in the sm_90
# K loop at 8 x 1024 / 16 x 512 / 32 x 512: per-channel 3.3 / 3.3 / 3.0; 128 x 128 blocks with the
# scales on x 3.5 / 3.4 / 3.1; block scales per row 5.7 / 5.0 / 4.5); 16-64 rows: tl.dot, the weight
# as the MMA's M side (swap, 64 weight rows), 32 weight rows a program (twice the programs on 4096
# rows), or split-K (as the integer tiles, model/linear_choice.py).
FP8_TILES = {
    1: (Fp8Tile(1, 8, 1024, 1, 4), Fp8Tile(1, 16, 512, 1, 4), Fp8Tile(1, 32, 512, 1, 4)),
    **{
        b: (Fp8Tile(b, 64, 128, 4, 4, swap=True), Fp8Tile(b, 32, 128, 4, 4),
            Fp8Tile(b, 64, 128, 4, 4, swap=True, split_k=2))
        for b in (16, 32)
    },
    64: (Fp8Tile(64, 64, 128, 4, 4, swap=True), Fp8Tile(64, 32, 128, 4, 4),
         Fp8Tile(64, 128, 128, 4, 8, swap=True, split_k=4)),
}  # fmt: skip


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [N, K] e4m3, scale [ceil(N/bn), ceil(K/bk)] -> the float32 weight [N, K] (exact)."""
    n, k = weight.shape
    s = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return weight.float() * s


def fp8_linear_ref(x, weight, scale, block, bias=None):
    """x [M, K] -> [M, N] of x.dtype: x.float() @ dequantize_fp8(...).T (+ bias), rounded once."""
    return rounded_linear_ref(x.float(), dequantize_fp8(weight, scale, block), bias, x.dtype)


@triton.jit
def fp8_codes(w_rows, ks, hidden, col_mask, EVEN: tl.constexpr):
    """The e4m3 codes of the rows at w_rows ([BLOCK_N, 1] pointers) at columns ks, read evict-first
    (each weight byte is read once a step; x, the residual and the KV cache should stay in L2)."""
    if EVEN:
        return tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
    return tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & (ks < hidden)[None, :], other=0.0,
                   eviction_policy="evict_first")  # fmt: skip


@triton.jit
def fp8_rows_times_x(
    w_rows,
    s_rows,
    x_ptr,
    k0,
    hidden,
    col_mask,
    SCALE_K: tl.constexpr,
    PER_ROW: tl.constexpr,
    SUB_K: tl.constexpr,
    SUBS: tl.constexpr,
    EVEN: tl.constexpr,
    first=None,
    X_SCALE: tl.constexpr = False,
):
    """[BLOCK_N, SUB_K] float32 partial products of the rows at w_rows ([BLOCK_N, 1] pointers; their
    scales at s_rows, [BLOCK_N] pointers) with x over k0 .. k0 + SUBS * SUB_K: SUBS sub-tiles, each
    inside one scale block, so a scale is one [BLOCK_N] vector per sub-tile (PER_ROW: no scale here,
    the caller applies the row's scale after the K loop; X_SCALE: every row shares its scales, s_rows
    is one pointer, to their scale row, and each x value takes its column's scale, not the tile). first:
    sub-tile 0's codes when the caller loaded them already (fp8_codes), else None."""
    lanes = tl.arange(0, SUB_K)
    for j in tl.static_range(SUBS):
        ks = k0 + j * SUB_K + lanes
        if j == 0 and first is not None:
            w = first.to(tl.float32)
        else:
            w = fp8_codes(w_rows, ks, hidden, col_mask, EVEN).to(tl.float32)
        if EVEN:
            xv = tl.load(x_ptr + ks).to(tl.float32)
        else:
            xv = tl.load(x_ptr + ks, mask=ks < hidden, other=0.0).to(tl.float32)
        if X_SCALE:  # each x value times its column's scale (a gather of the few scales of the step)
            if EVEN:
                xv = xv * tl.load(s_rows + ks // SCALE_K)
            else:
                xv = xv * tl.load(s_rows + ks // SCALE_K, mask=ks < hidden, other=0.0)
        elif not PER_ROW:
            kb = (k0 + j * SUB_K) // SCALE_K
            if EVEN:
                w = w * tl.load(s_rows + kb)[:, None]
            else:
                inside = (tl.zeros_like(col_mask.to(tl.int32)) + k0 + j * SUB_K) < hidden
                w = w * tl.load(s_rows + kb, mask=col_mask & inside, other=0.0)[:, None]
        if j == 0:
            part = w * xv[None, :]
        else:
            part += w * xv[None, :]
    return part


@triton.jit
def fp8_rows_dot_x(
    w_rows, s_rows, x_ptr, hidden, col_mask,
    SCALE_K: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_N: tl.constexpr, SUB_K: tl.constexpr,
    SUBS: tl.constexpr, EVEN: tl.constexpr, first=None, X_SCALE: tl.constexpr = False,
):  # fmt: skip
    """[BLOCK_N] float32: the rows at w_rows (as fp8_rows_times_x) dotted with x over all of K: one
    [BLOCK_N, SUB_K] accumulator reduced once after the loop, then scaled by the row's scale (PER_ROW).
    first: the codes of the first step's first sub-tile, loaded by the caller (fp8_codes at columns
    0 .. SUB_K - 1), or None; with them K must be at least 1. X_SCALE: as fp8_rows_times_x."""
    STEP: tl.constexpr = SUB_K * SUBS
    if first is not None:
        acc = fp8_rows_times_x(
            w_rows, s_rows, x_ptr, 0, hidden, col_mask, SCALE_K, PER_ROW, SUB_K, SUBS, EVEN, first, X_SCALE
        )
        start = STEP
    else:
        acc = tl.zeros([BLOCK_N, SUB_K], dtype=tl.float32)
        start = 0
    for k0 in range(start, hidden, STEP):
        acc += fp8_rows_times_x(
            w_rows, s_rows, x_ptr, k0, hidden, col_mask, SCALE_K, PER_ROW, SUB_K, SUBS, EVEN, None, X_SCALE
        )
    out = tl.sum(acc, axis=1)
    if PER_ROW:
        out *= tl.load(s_rows, mask=col_mask, other=0.0)
    return out


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    num_cols,
    hidden,
    stride_wn,
    stride_sn,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB_K: tl.constexpr,
    SUBS: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_N divides num_cols and SUBS * SUB_K divides hidden: no masks
    X_SCALE: tl.constexpr,  # scale blocks hold the program's rows whole (SCALE_N % BLOCK_N == 0)
    PDL: tl.constexpr,  # kernels/pdl.py
):
    """One row: BLOCK_N weight rows x the whole of K per program (the layout of kernels/gemv.py),
    a [BLOCK_N, SUB_K] fp32 accumulator reduced once after the loop. Scale blocks that hold the
    program's rows whole (X_SCALE: 128 x 128 blocks given as such, BLOCK_N dividing 128): the
    program's scales multiply x's values, one sub-tile a step, and the tile is used as read.
    Per-channel or X_SCALE: the first step's codes are loaded before the PDL wait (weights: no kernel
    writes them), as kernels/gemv.py does, so they stream while the previous kernel drains. K >= 1."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < num_cols
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    if X_SCALE:
        s_rows = s_ptr + (tl.program_id(0) * BLOCK_N // SCALE_N).to(tl.int64) * stride_sn
    else:
        s_rows = s_ptr + (cols // SCALE_N).to(tl.int64) * stride_sn
    if PER_ROW or X_SCALE:
        first = fp8_codes(w_rows, tl.arange(0, SUB_K), hidden, col_mask, EVEN)
        pdl.begin(PDL)
        out = fp8_rows_dot_x(
            w_rows, s_rows, x_ptr, hidden, col_mask, SCALE_K, PER_ROW, BLOCK_N, SUB_K, SUBS, EVEN, first,
            X_SCALE,
        )  # fmt: skip
    else:  # per-row block scales: the peeled first step measured slower (docs/PERF.md, 2026-12-07 06:10)
        pdl.begin(PDL)
        out = fp8_rows_dot_x(
            w_rows, s_rows, x_ptr, hidden, col_mask, SCALE_K, PER_ROW, BLOCK_N, SUB_K, SUBS, EVEN
        )
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_mask)


def gemv_steps(block_k: int, scale_k: int, hidden: int, x_scale: bool = False) -> tuple[bool, int, int]:
    """(per_row, SUB_K, SUBS) of the FP8 GEMV for a tile's block_k: one sub-tile a step with
    per-channel scales or scales on x (x_scale), else sub-tiles of the scale block's power-of-two part
    (at most block_k, capped at next_power_of_2(K))."""
    block_k = max(16, min(block_k, triton.next_power_of_2(hidden)))
    if scale_k >= hidden or x_scale:
        return scale_k >= hidden, block_k, 1
    sub = min(block_k, pow2_part(scale_k))
    return False, sub, block_k // sub


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
    """Triton fp8_linear_ref (W8A16). x: [M, K] bf16/fp16/fp32 contiguous along K. One row runs the
    GEMV kernel above, more rows kernels/quant_dot.py. Returns a new [M, N]."""
    num_rows, hidden = x.shape
    check_fp8_weights(weight, scale, block, hidden)
    if x.stride(1) != 1:
        raise ValueError("fp8_linear needs x contiguous along K: call .contiguous() first")
    num_cols = weight.shape[0]
    tile = launch_tile(tile, num_rows)
    scale = scale.contiguous()
    if tile.block_m > 1:
        return quant_dot(x, weight, scale, None, bias, bits=0, scale_n=block[0], scale_k=block[1], tile=tile)
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    if num_cols == 0:
        return out
    if hidden == 0:  # the kernel reads a first step before its loop
        return out.zero_() if bias is None else out.copy_(bias.expand(num_rows, -1))
    x_scale = block[1] < hidden and block[0] % tile.block_n == 0
    per_row, sub_k, subs = gemv_steps(tile.block_k, block[1], hidden, x_scale)
    _fp8_gemv_kernel[(triton.cdiv(num_cols, tile.block_n),)](
        x, weight, scale, bias if bias is not None else x, out, num_cols, hidden, weight.stride(0),
        scale.stride(0), SCALE_N=block[0], SCALE_K=block[1], PER_ROW=per_row, HAS_BIAS=bias is not None,
        BLOCK_N=tile.block_n, SUB_K=sub_k, SUBS=subs,
        EVEN=num_cols % tile.block_n == 0 and hidden % (sub_k * subs) == 0, X_SCALE=x_scale,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
        **pdl.launch(x.device),
    )  # fmt: skip
    return out
