"""INT4 weight-only product of one row on the tensor cores, codes dequantized two per 32-bit op.

Contract and weight layout of kernels/quant_int.py (which checks the inputs and launches this for a
MagicTile): packed [N, ceil(K / 8)] int32, word j holds k = 8j .. 8j + 7, value i in bits
[4i, 4i + 4); scales [N, ceil(K / group)] any float; offsets None (w = (q - 8) s) or float32 of the
same shape (w = q s + o); x [1, K] bf16 or fp16; out [1, N] of x's dtype.

For a word w, (w >> 4i) & 0x000F000F | MAGIC holds two 16-bit floats equal to B + q, exactly, for
values i and i + 4 (bf16: MAGIC 0x43004300, B = 128; fp16: 0x64006400, B = 1024): a shift and a LOP3
per two weights, no subtraction, no conversion. The [BLOCK_N, BLOCK_K] tile of B + q, its columns in
the order k = 8j + i + 4h (x permuted in registers to match), is the MMA's A operand; x in 16
columns is B (each column x, or, where a step holds up to 16 whole groups, column g group g's part
of x and zeros). Per weight row n and scale group g
    sum_k x[k] w[n, k] = sum_g s[n, g] D[n, g] - c[n, g] X[g],   c = B s - o (symmetric: (B + 8) s)
with D = sum_k x[k] (B + q[n, k]) over the group's part of a step off the MMA (fp32) and X the
same part's sum of x. The K loop accumulates s D; a short second loop subtracts c X, SUM_STEPS
groups at a time. split_k > 1 divides K among programs: each stores an fp32 partial and the last
to arrive (an arrival counter per column block, left at 0) sums them in split order. No host sync:
CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.decode_merge import arrival_counters
from tpfuse.kernels.quant_dot import IntTile
from tpfuse.kernels.skinny_linear import partials_buffer, store_row_split_k

__all__ = ["MagicTile", "fits", "magic_block_k", "magic_int4_gemv"]

NIBBLES = 0x000F000F  # values i and i + 4 of a word, shifted down by 4i


@dataclass(frozen=True)
class MagicTile(IntTile):
    """A launch configuration of the kernel here (block_m 1: one row)."""

    def label(self) -> str:
        split = f" split{self.split_k}" if self.split_k > 1 else ""
        return f"magic n{self.block_n} k{self.block_k} s{self.num_stages} w{self.num_warps}{split}"


@triton.jit
def _magic_pair(words, SHIFT: tl.constexpr, nibbles, MAGIC: tl.constexpr):
    """Values SHIFT / 4 and SHIFT / 4 + 4 of each word as two 16-bit floats B + q in one int32
    (nibbles: 0x000F000F, a kernel argument so it stays in a register)."""
    if SHIFT == 0:
        return (words & nibbles) | MAGIC
    return ((words >> SHIFT) & nibbles) | MAGIC


@triton.jit
def _in_pair_order(x, WORDS: tl.constexpr):
    """[BLOCK_K] in k order -> the tile's column order (column 8j + 2i + h holds k = 8j + i + 4h)."""
    return tl.reshape(tl.permute(tl.reshape(x, [WORDS, 2, 4]), (0, 2, 1)), [WORDS * 8])


@triton.jit
def _step_words(q_rows, k0, k_end, col_mask, WORDS: tl.constexpr, EVEN: tl.constexpr, AHEAD: tl.constexpr):
    """[BLOCK_N, WORDS] packed words of the K step at k0 (k_end <= K: the split's end). AHEAD (the
    prefetch, which runs one step past k_end): EVEN reloads the last step there instead (no masks),
    else zeros."""
    if EVEN:
        if AHEAD:  # EVEN: k0 and k_end are multiples of the step
            k0 = tl.multiple_of(tl.minimum(k0, k_end - WORDS * 8), WORDS * 8)
        return tl.load(q_rows + (k0 // 8 + tl.arange(0, WORDS))[None, :], eviction_policy="evict_first")
    mask = col_mask[:, None] & (k0 + tl.arange(0, WORDS) * 8 < k_end)[None, :]
    return tl.load(q_rows + (k0 // 8 + tl.arange(0, WORDS))[None, :], mask=mask, other=0,
                   eviction_policy="evict_first")  # fmt: skip


@triton.jit
def _magic_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    bias_ptr,
    out_ptr,
    partials_ptr,
    counter_ptr,
    num_cols,
    hidden,
    k_per_split,
    nibbles,
    stride_qn,
    stride_sn,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUM_STEPS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr,  # load a step ahead into registers (tiles of one pipeline stage)
    EVEN: tl.constexpr,  # BLOCK_N divides num_cols and BLOCK_K divides hidden: no masks
):
    """One row: BLOCK_N weight rows x k_per_split columns of K per program (program_id(1): the
    split). The K loop runs the MMA of B + q against x and scales it per group; a second loop
    subtracts sum_g c[n, g] X[g], SUM_STEPS groups (or steps) at a time. Splits store fp32
    partials; the last to arrive sums them in split order and resets its counter to 0."""
    WORDS: tl.constexpr = BLOCK_K // 8
    # groups per K step (GROUP a power of two below BLOCK_K): x's column g holds group g's part of
    # the step (zero elsewhere), so the MMA's column g is that group's D; else x in every column
    STEP_GROUPS: tl.constexpr = BLOCK_K // GROUP if GROUP < BLOCK_K else 1
    UNIT: tl.constexpr = BLOCK_K // STEP_GROUPS  # the K columns of one scale in a step
    PAD: tl.constexpr = 16  # x padded to the MMA's 16 columns
    if x_ptr.dtype.element_ty == tl.float16:
        MAGIC: tl.constexpr = 0x64006400
        BASE: tl.constexpr = 1024.0
    else:
        MAGIC: tl.constexpr = 0x43004300
        BASE: tl.constexpr = 128.0
    half: tl.constexpr = x_ptr.dtype.element_ty
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < num_cols
    q_rows = q_ptr + cols.to(tl.int64)[:, None] * stride_qn
    s_rows = s_ptr + cols.to(tl.int64) * stride_sn
    o_rows = o_ptr + cols.to(tl.int64) * stride_sn
    kk = tl.arange(0, BLOCK_K)
    pad = tl.arange(0, PAD)
    first = pad[None, :] == 0
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, hidden)
    acc = tl.zeros([BLOCK_N, PAD], dtype=tl.float32)
    if PREFETCH:
        ahead = _step_words(q_rows, k_start, k_end, col_mask, WORDS, EVEN, True)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PREFETCH:  # the next step's words in flight in registers while this step computes
            words = ahead
            ahead = _step_words(q_rows, k0 + BLOCK_K, k_end, col_mask, WORDS, EVEN, True)
        else:
            words = _step_words(q_rows, k0, k_end, col_mask, WORDS, EVEN, False)
        if EVEN:
            x = tl.load(x_ptr + k0 + kk)
        else:
            x = tl.load(x_ptr + k0 + kk, mask=k0 + kk < hidden, other=0.0)
        lo_pairs = tl.join(_magic_pair(words, 0, nibbles, MAGIC), _magic_pair(words, 8, nibbles, MAGIC))
        hi_pairs = tl.join(_magic_pair(words, 4, nibbles, MAGIC), _magic_pair(words, 12, nibbles, MAGIC))
        pairs = tl.reshape(tl.join(lo_pairs, hi_pairs), [BLOCK_N, BLOCK_K // 2])  # values i, i + 4
        low = pairs.to(tl.int16).to(half, bitcast=True)
        high = (pairs >> 16).to(tl.int16).to(half, bitcast=True)
        w = tl.reshape(tl.join(low, high), [BLOCK_N, BLOCK_K])
        x = _in_pair_order(x, WORDS)
        if STEP_GROUPS == 1:
            xt = tl.broadcast_to(x[:, None], [BLOCK_K, PAD])
            if EVEN:
                s = tl.load(s_rows + k0 // GROUP).to(tl.float32)
            else:
                s = tl.load(s_rows + k0 // GROUP, mask=col_mask, other=0.0).to(tl.float32)
            acc += s[:, None] * tl.dot(w, xt)
        else:  # column p of the tile is in group p // GROUP of the step (the order permutes words only)
            xt = tl.where((kk // GROUP)[:, None] == pad[None, :], x[:, None], tl.zeros([BLOCK_K, PAD], half))
            g_mask = col_mask[:, None] & ((pad < STEP_GROUPS) & (k0 + pad * GROUP < hidden))[None, :]
            s = tl.load(s_rows[:, None] + (k0 // GROUP + pad)[None, :], mask=g_mask, other=0.0)
            acc += s.to(tl.float32) * tl.dot(w, xt)
    if STEP_GROUPS == 1:
        out = tl.sum(tl.where(first, acc, 0.0), axis=1)
    else:
        out = tl.sum(acc, axis=1)
    steps = tl.arange(0, SUM_STEPS)
    units = tl.arange(0, UNIT)
    for j0 in range(k_start, k_end, SUM_STEPS * UNIT):
        step_k = j0 + steps * UNIT
        ks = step_k[:, None] + units[None, :]
        x_sum = tl.sum(tl.load(x_ptr + ks, mask=(ks < hidden) & (step_k < k_end)[:, None], other=0.0)
                       .to(tl.float32), axis=1)  # fmt: skip
        groups = step_k // GROUP
        g_mask = col_mask[:, None] & (step_k < k_end)[None, :]
        s = tl.load(s_rows[:, None] + groups[None, :], mask=g_mask, other=0.0).to(tl.float32)
        if HAS_OFFSET:
            c = BASE * s - tl.load(o_rows[:, None] + groups[None, :], mask=g_mask, other=0.0)
        else:
            c = (BASE + 8.0) * s
        out -= tl.sum(c * x_sum[None, :], axis=1)
    store_row_split_k(out, partials_ptr, counter_ptr, cols, col_mask, num_cols, bias_ptr, out_ptr, HAS_BIAS,
                      SPLIT_K)  # fmt: skip


def magic_block_k(block_k: int, hidden: int, group_size: int) -> int | None:
    """The K step for block_k: capped at next_power_of_2(K); a group that is a power of two below it
    stays whole in a step (at most 16 groups: the MMA's columns), any other group caps the step at
    its power-of-two part so that a step lies in one group. None where the step is below 16 (the
    MMA's K)."""
    step = min(block_k, triton.next_power_of_2(hidden))
    power_of_two = group_size & (group_size - 1) == 0
    if group_size < min(hidden, step) and (not power_of_two or step // group_size > 16):
        step = group_size & -group_size
    return step if step >= 16 else None


SUM_STEPS = 8  # groups (or K steps) whose x sums the correction loop takes at once


def fits(x: torch.Tensor, bits: int, group_size: int) -> bool:
    """Whether the kernel here runs this product: 4-bit codes, one bf16/fp16 row, groups the K step
    can lie in."""
    return (
        bits == 4
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.shape[0] == 1
        and magic_block_k(1 << 30, x.shape[1], group_size) is not None
    )


def magic_int4_gemv(x, packed, scales, offsets, group_size, bias=None, *, tile: MagicTile):
    """The product of kernels/quant_int.int_linear_triton for a shape that fits (above), inputs checked
    there. Returns a new [1, N] of x.dtype."""
    hidden = x.shape[1]
    num_cols = packed.shape[0]
    out = torch.empty((1, num_cols), dtype=x.dtype, device=x.device)
    if num_cols == 0:
        return out
    block_k = magic_block_k(tile.block_k, hidden, group_size)
    split_k = max(1, min(tile.split_k, triton.cdiv(hidden, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(hidden, split_k), block_k) * block_k
    split_k = triton.cdiv(hidden, k_per_split)  # no empty split
    grid = (triton.cdiv(num_cols, tile.block_n), split_k)
    partials = counters = out
    if split_k > 1:
        partials = partials_buffer(x.device, split_k * num_cols)
        counters = arrival_counters(x.device, grid[0])
    _magic_kernel[grid](
        x, packed, scales, offsets if offsets is not None else scales, bias if bias is not None else x, out,
        partials, counters, num_cols, hidden, k_per_split, NIBBLES, packed.stride(0), scales.stride(0),
        GROUP=group_size, HAS_OFFSET=offsets is not None, HAS_BIAS=bias is not None,
        BLOCK_N=tile.block_n, BLOCK_K=block_k, SUM_STEPS=SUM_STEPS, SPLIT_K=split_k,
        PREFETCH=tile.num_stages == 1,
        EVEN=num_cols % tile.block_n == 0 and hidden % block_k == 0,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return out
