"""The tensor-core form of the weight-only kernels (2 or more rows): a dequantized weight tile times a
tile of x on tl.dot, for integer group codes (kernels/quant_int.py) and FP8 e4m3 (kernels/quant_fp8.py).

Each program dequantizes a [BLOCK_N, BLOCK_K] weight tile in registers, exactly: FP8 is cast to x's
dtype, integer codes become the small integers q - 2^(bits-1) (or q with offsets) through the float
bit pattern 1 + q / 2^bits, so no int-to-float conversion runs; each packed word is loaded once (a
[BLOCK_N, BLOCK_K / values per word] tile) and spread to its lanes in registers. Scales are applied
where they are constant (SCALE_MODE):
  ROW   one scale per output column (per-channel FP8, one group over K): once after the K loop;
  STEP  constant over each K step (the step divides the scale block: FP8 128-column blocks, integer
        groups of 32 / 128): the step's product is scaled (and offset by o * sum(x)) as it is added;
  ELEMENT any other layout: each weight element is scaled before the product (rounded to x's dtype).
The grid is (row blocks, column blocks, K splits) with rows fastest, so at prefill sizes consecutive
programs share a weight tile (read once from memory) while x stays in L2; at decode sizes there is
one row block and each weight byte is read once. SWAP computes the transposed product (weight tile
as the MMA's M side), which suits 16-64 rows. SPLIT_K > 1 divides K among programs for weights with
few rows (4096-row o_proj / down: 64 programs of 64 rows leave half the SMs idle): each stores its
fp32 partial and the last to arrive (an arrival counter per output tile, reset by it: graph-safe)
sums them in split order, so results do not depend on arrival order (kernels/skinny_linear.py's
scheme, and its buffers). Which tile runs each shape is timed at start-up
(model/linear_choice.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.decode_merge import arrival_counters
from tpfuse.kernels.fp8_rows import e4m3_ready
from tpfuse.kernels.skinny_linear import Tile, partials_buffer

ROW, STEP, ELEMENT = 0, 1, 2
# x_fp8 of quant_dot (W8A8, e4m3 weights): x as given (W8A16); each K step of each row quantized to
# e4m3 in the kernel; or x given quantized (e4m3) with a float32 scale per row and K step
X_AS_IS, X_QUANTIZE_HERE, X_QUANTIZED = 0, 1, 2


@dataclass(frozen=True)
class IntTile(Tile):
    """skinny_linear.Tile for the weight-only kernels, with their defaults; block_m 1 is the GEMV form
    (no tl.dot); split_k applies to the tensor-core form and the f16x2 GEMV only."""

    block_n: int = 64
    block_k: int = 128
    num_stages: int = 3

    def label(self) -> str:
        return ("gemv " if self.block_m == 1 else "") + super().label()


def default_tile(rows: int) -> IntTile:
    if rows == 1:
        return IntTile(1, 8, 1024, 1, 4)
    if rows <= 64:
        return IntTile(max(16, triton.next_power_of_2(rows)), 64, 128, 3, 4, swap=True)
    # prefill: the in-register dequantization, not the MMA, bounds the integer tile (sm_90: about 500
    # instructions a thread per K step at 128 x 128 x 64, the same as 64 x 128 x 64 for twice the MMA)
    return IntTile(128, 128, 64, 3, 8)


def launch_tile(tile: IntTile | None, rows: int) -> IntTile:
    """tile, or default_tile(rows) when None. Raises ValueError for a GEMV tile given several rows."""
    tile = tile or default_tile(rows)
    if tile.block_m == 1 and rows != 1:
        raise ValueError(f"the GEMV tile takes one row; got {rows}")
    return tile


def pow2_part(n: int) -> int:
    """The largest power of two dividing n (n >= 1)."""
    return n & -n


def scale_plan(block_k: int, scale_k: int, hidden: int, has_offset: bool) -> tuple[int, int]:
    """(K step, SCALE_MODE) for a tile's block_k against scale_k columns per scale: the step is
    capped at the scale block's power-of-two part so each step lies inside one block."""
    block_k = max(16, min(block_k, triton.next_power_of_2(hidden)))
    if scale_k >= hidden and not has_offset:
        return block_k, ROW
    step = min(block_k, pow2_part(scale_k)) if scale_k < hidden else block_k
    if scale_k >= hidden or step >= 16:
        return step, STEP
    return block_k, ELEMENT


@triton.jit
def code_as_float(words, shift, BITS: tl.constexpr):
    """1 + q / 2^BITS (float32, exact) for the BITS-bit unsigned value q at bit `shift` of each
    int32 word (shift: a tensor broadcastable to words, or a constant)."""
    MANT: tl.constexpr = 23 - BITS
    bits = ((words >> shift) & ((1 << BITS) - 1)) << MANT
    return (bits | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def spread_words(words, PER_WORD: tl.constexpr):
    """[R, W] int32 -> [R, W * PER_WORD] (PER_WORD 4 or 8), column i * PER_WORD + j holding word i:
    each word repeated in the registers of the thread that loaded it (no shared-memory exchange)."""
    words = tl.interleave(words, words)
    words = tl.interleave(words, words)
    if PER_WORD == 8:
        words = tl.interleave(words, words)
    return words


@triton.jit
def _quant_dot_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
    bias_ptr,
    out_ptr,
    partials_ptr,
    counter_ptr,
    num_rows,
    num_cols,
    hidden,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    xs_ptr,  # X_FP8 == X_QUANTIZED: x's float32 scales, [M, K steps] ([M, 1] with ROW weight scales)
    stride_xsm,
    BITS: tl.constexpr,  # 0: FP8 e4m3 weights; 4 / 8: packed integer codes
    SCALE_N: tl.constexpr,  # weight rows per scale row
    SCALE_K: tl.constexpr,  # weight columns per scale
    SCALE_MODE: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # BLOCK_K divides hidden (and k_per_split): K unmasked
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 x (16-bit inputs ignore it)
    X_FP8: tl.constexpr = 0,  # X_AS_IS, X_QUANTIZE_HERE or X_QUANTIZED (W8A8: BITS 0, SCALE_MODE 0 / 1)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < num_cols
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    s_cols = s_ptr + (cols // SCALE_N).to(tl.int64) * stride_sn
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    lanes = tl.arange(0, BLOCK_K)
    # W8A8: x's scales per K step (quantized here, or given with STEP weight scales), else one per row
    X_STEP: tl.constexpr = X_FP8 == 1 or (X_FP8 == 2 and SCALE_MODE == 1)
    # STEP scales whose weight blocks cover the tile's rows (FP8 128 x 128 blocks, BLOCK_N <= 128): one
    # scale a step, folded into the rows' x scales, instead of a column gather and a multiply an element
    TILE_SCALE: tl.constexpr = SCALE_MODE == 1 and not HAS_OFFSET and SCALE_N % BLOCK_N == 0
    tile_scales = s_ptr + (tl.program_id(1) * BLOCK_N // SCALE_N).to(tl.int64) * stride_sn
    if BITS > 0:
        PER_WORD: tl.constexpr = 32 // BITS
        WORDS: tl.constexpr = BLOCK_K // PER_WORD
        num_words = (hidden + PER_WORD - 1) // PER_WORD
        shift = (lanes % PER_WORD) * BITS
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = tl.program_id(2) * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, hidden), BLOCK_K):
        ks = k0 + lanes
        if EVEN_K:
            x_mask = row_mask[:, None]
            w_mask = col_mask[:, None]
        else:
            x_mask = row_mask[:, None] & (ks < hidden)[None, :]
            w_mask = col_mask[:, None] & (ks < hidden)[None, :]
        xt = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
        if X_FP8 == 2 and X_STEP:
            x_scale = tl.load(xs_ptr + rows * stride_xsm + k0 // BLOCK_K, mask=row_mask, other=1.0)
        elif X_FP8 == 1:  # per row and step: scale amax / 448 (1 where all zero); the cast saturates at 448
            xf = xt.to(tl.float32)
            x_scale = tl.max(tl.abs(xf), axis=1) / 448.0
            x_scale = tl.where(x_scale > 0, x_scale, 1.0)
            xt = e4m3_ready(xf * (1.0 / x_scale)[:, None]).to(tl.float8e4nv)
        if BITS == 0:
            raw = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
            if X_FP8 > 0:
                w = raw  # e4m3 x e4m3 on the tensor cores
            elif SCALE_MODE == 2:
                w = raw.to(tl.float32)
            else:
                w = raw.to(xt.dtype)
        else:
            # each word once ([BLOCK_N, WORDS], contiguous), its codes split in registers: a tile of
            # per-lane word pointers would copy every word PER_WORD times through shared memory
            wk = k0 // PER_WORD + tl.arange(0, WORDS)
            word_mask = col_mask[:, None]
            if not EVEN_K:
                word_mask = word_mask & (wk < num_words)[None, :]
            words = tl.load(w_rows + wk[None, :], mask=word_mask, other=0, eviction_policy="evict_first")
            f = code_as_float(spread_words(words, PER_WORD), shift[None, :], BITS)
            if HAS_OFFSET:
                w = (f - 1.0) * (1 << BITS)  # q
            else:
                w = f * (1 << BITS) - ((1 << BITS) + (1 << (BITS - 1)))  # q - 2^(BITS-1)
            if SCALE_MODE != 2:
                w = w.to(xt.dtype)
        if SCALE_MODE == 2:
            groups = (ks // SCALE_K)[None, :]
            s = tl.load(s_cols[:, None] + groups, mask=w_mask, other=0.0).to(tl.float32)
            if HAS_OFFSET:
                o = tl.load(o_ptr + (cols.to(tl.int64) * stride_sn)[:, None] + groups, mask=w_mask, other=0.0)
                w = (w * s + o).to(xt.dtype)
            else:
                w = (w * s).to(xt.dtype)
        if SCALE_MODE == 1 or X_STEP:  # the step's product scaled as it is added
            if SWAP:
                part = tl.dot(w, tl.trans(xt), input_precision=DOT_PRECISION)
            else:
                part = tl.dot(xt, tl.trans(w), input_precision=DOT_PRECISION)
            if TILE_SCALE:
                step_scale = tl.load(tile_scales + k0 // SCALE_K).to(tl.float32)
                if X_STEP:
                    if SWAP:
                        part = part * (x_scale * step_scale)[None, :]
                    else:
                        part = part * (x_scale * step_scale)[:, None]
                else:
                    part = part * step_scale
            elif X_STEP:  # each row's step scale
                if SWAP:
                    part = part * x_scale[None, :]
                else:
                    part = part * x_scale[:, None]
            if SCALE_MODE == 1 and not TILE_SCALE:
                s = tl.load(s_cols + k0 // SCALE_K, mask=col_mask, other=0.0).to(tl.float32)
                if HAS_OFFSET:
                    o_cols = o_ptr + cols.to(tl.int64) * stride_sn
                    o = tl.load(o_cols + k0 // SCALE_K, mask=col_mask, other=0.0)
                    xsum = tl.sum(xt.to(tl.float32), axis=1)
                    if SWAP:
                        part = part * s[:, None] + o[:, None] * xsum[None, :]
                    else:
                        part = part * s[None, :] + xsum[:, None] * o[None, :]
                elif SWAP:
                    part = part * s[:, None]
                else:
                    part = part * s[None, :]
            acc += part
        elif SWAP:  # accumulated in place
            acc = tl.dot(w, tl.trans(xt), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(xt, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if SWAP:
        acc = tl.trans(acc)
    out_mask = row_mask[:, None] & col_mask[None, :]
    last = True
    if SPLIT_K > 1:
        tile = rows[:, None] * num_cols + cols[None, :]
        tl.store(partials_ptr + tl.program_id(2) * num_rows * num_cols + tile, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial stores before the release below
        counter = counter_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT_K - 1
        if last:
            tl.debug_barrier()
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                acc += tl.load(partials_ptr + split * num_rows * num_cols + tile, mask=out_mask, other=0.0,
                               cache_modifier=".cg")  # fmt: skip
            tl.atomic_xchg(counter, 0)
    if last:
        if SCALE_MODE == 0:
            acc *= tl.load(s_cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if X_FP8 == 2 and not X_STEP:
            acc *= tl.load(xs_ptr + rows * stride_xsm, mask=row_mask, other=0.0)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def quant_dot(
    x, weight, scales, offsets, bias, *, bits: int, scale_n: int, scale_k: int, tile: IntTile,
    x_fp8: int = X_AS_IS, x_scales=None, out_dtype=None,
):  # fmt: skip
    """out [M, N] of out_dtype (default x.dtype) = x @ dequant(weight).T (+ bias) on tl.dot. weight:
    [N, K] e4m3 (bits 0) or [N, ceil(K / (32 / bits))] int32 codes; scales [ceil(N / scale_n),
    ceil(K / scale_k)] (and offsets of the same shape, integer codes only). x_fp8 (e4m3 weights, ROW
    or STEP scales; kernels/quant_fp8_w8a8.py's decode form): X_QUANTIZE_HERE quantizes each K step
    of each row of x to e4m3 in the kernel; X_QUANTIZED takes x as e4m3 and x_scales float32, one per
    row and K step of scale_plan's size ([M, K steps]), or one per row ([M, 1]) where the weight
    scales are per row (ROW). Shapes are checked by the callers."""
    num_rows, hidden = x.shape
    num_cols = weight.shape[0]
    out = torch.empty((num_rows, num_cols), dtype=out_dtype or x.dtype, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return out
    block_k, mode = scale_plan(tile.block_k, scale_k, hidden, offsets is not None)
    split_k = max(1, min(tile.split_k, triton.cdiv(hidden, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(hidden, split_k), block_k) * block_k
    split_k = triton.cdiv(hidden, k_per_split)  # no empty split
    grid = (triton.cdiv(num_rows, tile.block_m), triton.cdiv(num_cols, tile.block_n), split_k)
    partials = counters = out
    if split_k > 1:
        partials = partials_buffer(x.device, split_k * num_rows * num_cols)
        counters = arrival_counters(x.device, grid[0] * grid[1])
    _quant_dot_kernel[grid](
        x, weight, scales, offsets if offsets is not None else scales, bias if bias is not None else x, out,
        partials, counters, num_rows, num_cols, hidden, k_per_split,
        x.stride(0), weight.stride(0), scales.stride(0), out.stride(0),
        x_scales if x_scales is not None else scales, x_scales.stride(0) if x_scales is not None else 0,
        BITS=bits, SCALE_N=scale_n, SCALE_K=scale_k, SCALE_MODE=mode, HAS_OFFSET=offsets is not None,
        HAS_BIAS=bias is not None, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        SWAP=tile.swap, SPLIT_K=split_k, EVEN_K=hidden % block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", X_FP8=x_fp8,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return out
