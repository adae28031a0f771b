"""Group-quantized integer linear layer (W4A16, W8A16): out = x @ dequant(packed, scales).T (+ bias).

Weight layout (the kernels' own, which every integer format is converted to at load):
  packed:  [N, ceil(K / (32 / bits))] int32. Word j of row n holds k = j*V .. j*V + V - 1
           (V = 32 / bits values), value i in bits [i*bits, (i+1)*bits), unsigned. This is
           compressed-tensors' pack-quantized order; GPTQ, GGUF Q4_0/Q4_1/Q8_0 are repacked to it.
  scales:  [N, ceil(K / group_size)], any float dtype (the checkpoint's, so nothing is rounded).
  offsets: None (symmetric: w = (q - 2^(bits-1)) * s) or [N, ceil(K / group_size)] float32
           (w = q * s + offset: GPTQ zero points as -z * s, Q4_1's minimum).

One kernel covers decode and prefill: each program dequantizes a [BLOCK_N, BLOCK_K] weight tile in
registers (the packed words are read once from memory; the per-value gathers hit L1) and either
multiplies it into a 2-D fp32 accumulator against one row of x (the GEMV form: one row, no tensor
cores needed) or, rounded to x's dtype, into tl.dot with a BLOCK_M-row tile of x (tensor cores).
The grid is (column blocks, row blocks), so small row counts stream each weight once and large
ones tile the product. Which tile runs each shape is measured at start-up (model/linear_choice.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SUPPORTED_BITS = (4, 8)


@dataclass(frozen=True)
class IntTile:
    """Launch configuration; block_m 1 is the GEMV form (no tl.dot)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_stages: int = 3
    num_warps: int = 4

    def label(self) -> str:
        form = "gemv " if self.block_m == 1 else ""
        return f"{form}m{self.block_m} n{self.block_n} k{self.block_k} s{self.num_stages} w{self.num_warps}"


def default_tile(rows: int) -> IntTile:
    if rows == 1:
        return IntTile(1, 4, 512, 2, 4)
    if rows <= 64:
        return IntTile(max(16, triton.next_power_of_2(rows)), 64, 128, 3, 4)
    return IntTile(64, 128, 64, 3, 8)


def launch_tile(tile: IntTile | None, rows: int) -> IntTile:
    """tile, or default_tile(rows) when None. Raises ValueError for a GEMV tile given several rows."""
    tile = tile or default_tile(rows)
    if tile.block_m == 1 and rows != 1:
        raise ValueError(f"the GEMV tile takes one row; got {rows}")
    return tile


def launch_block_k(tile: IntTile, hidden: int) -> int:
    """The K step a weight-only kernel runs: tile.block_k, capped at next_power_of_2(K), at least 16."""
    return max(16, min(tile.block_k, triton.next_power_of_2(hidden)))


def values_per_word(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"integer weights of {bits} bits are not supported; supported: {SUPPORTED_BITS}")
    return 32 // bits


def pack_int(values: torch.Tensor, bits: int) -> torch.Tensor:
    """values: [N, K] integers in [0, 2^bits) -> packed [N, ceil(K / V)] int32 (layout above)."""
    per_word = values_per_word(bits)
    rows, cols = values.shape
    words = -(-cols // per_word)
    padded = torch.zeros(rows, words * per_word, dtype=torch.int32, device=values.device)
    padded[:, :cols] = values
    padded = padded.view(rows, words, per_word)
    packed = padded[..., 0].clone()
    for i in range(1, per_word):  # int32 shifts wrap into the sign bit, as the layout wants
        packed |= padded[..., i] << (bits * i)
    return packed


def unpack_int(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """packed [N, W] int32 -> [N, cols] int32 unsigned values (inverse of pack_int)."""
    per_word = values_per_word(bits)
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int32) * bits
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], -1)[:, :cols]


def dequantize_int(
    packed: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
    group_size: int,
    cols: int,
) -> torch.Tensor:
    """The float32 weight [N, cols] the packed layout stands for (exact for symmetric weights and for
    offsets that are integer multiples of their scale, as GPTQ zero points are)."""
    q = unpack_int(packed, bits, cols).to(torch.float32)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :cols]
    if offsets is None:
        return (q - 2 ** (bits - 1)) * s
    return q * s + offsets.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :cols]


def int_linear_ref(x, packed, scales, offsets, bits, group_size, bias=None):
    """x: [M, K] float -> [M, N] of x.dtype: x.float() @ dequantize_int(...).T (+ bias), rounded once."""
    weight = dequantize_int(packed, scales, offsets, bits, group_size, x.shape[1])
    out = x.float() @ weight.T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


@triton.jit
def _int_linear_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    num_cols,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    HIDDEN: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    PER_WORD: tl.constexpr = 32 // BITS
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < num_cols
    q_rows = q_ptr + cols.to(tl.int64)[:, None] * stride_qn
    s_rows = s_ptr + cols.to(tl.int64)[:, None] * stride_sn
    if BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < HIDDEN
        w_mask = col_mask[:, None] & k_mask[None, :]
        words = tl.load(
            q_rows + (ks // PER_WORD)[None, :], mask=w_mask, other=0, eviction_policy="evict_first"
        )
        q = (words >> ((ks % PER_WORD) * BITS)[None, :]) & ((1 << BITS) - 1)
        groups = (ks // GROUP)[None, :]
        s = tl.load(s_rows + groups, mask=w_mask, other=0.0).to(tl.float32)
        if HAS_OFFSET:
            o_rows = o_ptr + cols.to(tl.int64)[:, None] * stride_sn
            w = q.to(tl.float32) * s + tl.load(o_rows + groups, mask=w_mask, other=0.0)
        else:
            w = (q - (1 << (BITS - 1))).to(tl.float32) * s
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


def check_int_weights(packed, scales, offsets, bits: int, group_size: int, hidden: int) -> None:
    """Raises ValueError naming the tensor whose shape or dtype does not fit the layout above."""
    per_word = values_per_word(bits)
    num_cols = packed.shape[0]
    groups = -(-hidden // group_size)
    if (
        packed.dtype != torch.int32
        or packed.shape != (num_cols, -(-hidden // per_word))
        or packed.stride(1) != 1
    ):
        raise ValueError(
            f"packed weights must be [{num_cols}, {-(-hidden // per_word)}] int32 contiguous for K={hidden} "
            f"at {bits} bits; got {tuple(packed.shape)} {packed.dtype}"
        )
    if scales.shape != (num_cols, groups) or not scales.dtype.is_floating_point:
        raise ValueError(
            f"scales must be [{num_cols}, {groups}] float for K={hidden}, group {group_size}; "
            f"got {tuple(scales.shape)} {scales.dtype}"
        )
    if offsets is not None and (offsets.shape != scales.shape or offsets.dtype != torch.float32):
        raise ValueError(f"offsets must be [{num_cols}, {groups}] float32; got {tuple(offsets.shape)}")


def int_linear_triton(
    x, packed, scales, offsets, bits, group_size, bias=None, *, tile: IntTile | None = None
):
    """Triton int_linear_ref. x: [M, K] bf16/fp16/fp32, contiguous along K; bias [N] or None.
    Returns a new [M, N] of x.dtype. Raises ValueError for shapes that do not fit the layout."""
    num_rows, hidden = x.shape
    check_int_weights(packed, scales, offsets, bits, group_size, hidden)
    if x.stride(1) != 1:
        raise ValueError("int_linear needs x contiguous along K: call .contiguous() first")
    num_cols = packed.shape[0]
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return out
    tile = launch_tile(tile, num_rows)
    scales = scales.contiguous()
    offsets = offsets.contiguous() if offsets is not None else None
    grid = (triton.cdiv(num_cols, tile.block_n), triton.cdiv(num_rows, tile.block_m))
    _int_linear_kernel[grid](
        x,
        packed,
        scales,
        offsets if offsets is not None else scales,
        bias if bias is not None else x,
        out,
        num_rows,
        num_cols,
        x.stride(0),
        packed.stride(0),
        scales.stride(0),
        out.stride(0),
        HIDDEN=hidden,
        BITS=bits,
        GROUP=group_size,
        HAS_OFFSET=offsets is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=launch_block_k(tile, hidden),
        IEEE=x.dtype == torch.float32,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out
