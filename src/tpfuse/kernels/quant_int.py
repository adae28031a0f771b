"""Group-quantized integer linear layer (W4A16, W8A16): out = x @ dequant(packed, scales).T (+ bias).

Weight layout (the kernels' own, which every integer format is converted to at load):
  packed:  [N, ceil(K / (32 / bits))] int32. Word j of row n holds k = j*V .. j*V + V - 1
           (V = 32 / bits values), value i in bits [i*bits, (i+1)*bits), unsigned. This is
           compressed-tensors' pack-quantized order; GPTQ, GGUF Q4_0/Q4_1/Q8_0 are repacked to it.
  scales:  [N, ceil(K / group_size)], any float dtype (the checkpoint's, so nothing is rounded).
  offsets: None (symmetric: w = (q - 2^(bits-1)) * s) or [N, ceil(K / group_size)] float32
           (w = q * s + offset: GPTQ zero points as -z * s, Q4_1's minimum).

One row (decode) runs the GEMV kernel here (a GemvTile: a form of kernels/quant_int_gemv.py), laid
out for bandwidth as kernels/gemv.py is: each program takes BLOCK_N weight rows over the whole of K,
loads BLOCK_K / V contiguous words per row per step, and for each of the V values of a word
multiplies the value's float pattern 1 + q / 2^bits (two integer ops, no int-to-float conversion) by
the x entries it meets; the scale multiplies once per word (once per step when the group spans it),
and the [BLOCK_N, words] accumulator is reduced once.
Two or more rows run kernels/quant_dot.py (the dequantized tile on tl.dot); kernels/quant_int_magic.py
is the one-row tensor-core alternative (a MagicTile), kernels/quant_int_half2.py the one-row f16x2
one (a Half2Tile, which also takes x made beforehand as its operands, a Half2X). Which tile runs
each shape is measured at start-up (model/linear_choice.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl, quant_int_gemv, quant_int_half2, quant_int_magic
from tpfuse.kernels.gemv import rounded_linear_ref
from tpfuse.kernels.quant_dot import IntTile, code_as_float, launch_tile, quant_dot
from tpfuse.kernels.quant_int_gemv import GemvTile, x_pairs
from tpfuse.kernels.quant_int_half2 import Half2Tile, Half2X
from tpfuse.kernels.quant_int_magic import MagicTile

__all__ = [
    "GemvTile", "Half2Tile", "IntTile", "MagicTile", "dequantize_int", "int_linear_ref", "int_linear_triton",
    "pack_int", "unpack_int",
]  # fmt: skip

SUPPORTED_BITS = (4, 8)
HALF2X_DEFAULT = Half2Tile(1, 4, 2048, 1, 1)  # the f16x2 GEMV on Half2X where no tile was chosen


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
    """x: [M, K] float (or a Half2X: the values it stands for) -> [M, N] of x.dtype: x.float() @
    dequantize_int(...).T (+ bias), rounded once."""
    x_f32 = x.values() if isinstance(x, Half2X) else x.float()
    weight = dequantize_int(packed, scales, offsets, bits, group_size, x.shape[1])
    return rounded_linear_ref(x_f32, weight, bias, x.dtype)


@triton.jit
def int_words_times_x(
    q_rows,
    s_rows,
    o_rows,
    x_ptr,
    k0,
    hidden,
    col_mask,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    EVEN: tl.constexpr,
    X_PAIRS: tl.constexpr,
):
    """(a, b), both [BLOCK_N, WORDS] float32, for each row (q_rows / s_rows / o_rows: [BLOCK_N, 1]
    row pointers of codes, scales, offsets) and each of its words k0 / V + w: summed over the
    word's V values, weight times x[k] = 2^BITS * a - c * b with c = 2^BITS + 2^(BITS-1) (offsets:
    c = 1). The words are one contiguous load; value i of every word is f = 1 + q / 2^BITS in float
    bits (no int-to-float conversion), a = s * sum f x and b = s * sum x (offsets:
    (2^BITS s - o) * sum x). The scale is one
    vector per step when the group spans the step (GROUP a multiple of WORDS * V), else one per
    word. X_PAIRS: x is bf16 read as int32 pairs (half the x loads; x 4-byte aligned, K even)."""
    PER_WORD: tl.constexpr = 32 // BITS
    w_idx = tl.arange(0, WORDS)
    word_k = k0 + w_idx * PER_WORD  # the first k of each word
    if EVEN:
        words = tl.load(q_rows + (k0 // PER_WORD + w_idx)[None, :], eviction_policy="evict_first")
    else:
        w_mask = col_mask[:, None] & (word_k < hidden)[None, :]
        words = tl.load(q_rows + (k0 // PER_WORD + w_idx)[None, :], mask=w_mask, other=0,
                        eviction_policy="evict_first")  # fmt: skip
    part = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    xsum = tl.zeros([WORDS], dtype=tl.float32)
    if X_PAIRS:
        x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        for j in tl.static_range(PER_WORD // 2):
            if EVEN:
                pair = tl.load(x_words + (word_k + 2 * j) // 2)
            else:
                pair = tl.load(x_words + (word_k + 2 * j) // 2, mask=word_k + 2 * j < hidden, other=0)
            lo = (pair << 16).to(tl.float32, bitcast=True)
            hi = (pair & -65536).to(tl.float32, bitcast=True)
            part += code_as_float(words, 2 * j * BITS, BITS) * lo[None, :]
            part += code_as_float(words, (2 * j + 1) * BITS, BITS) * hi[None, :]
            xsum += lo + hi
    else:
        for i in tl.static_range(PER_WORD):
            if EVEN:
                xi = tl.load(x_ptr + word_k + i).to(tl.float32)
            else:
                xi = tl.load(x_ptr + word_k + i, mask=word_k + i < hidden, other=0.0).to(tl.float32)
            part += code_as_float(words, i * BITS, BITS) * xi[None, :]
            xsum += xi
    if GROUP % (WORDS * PER_WORD) == 0:  # one group per step: scale vectors
        if EVEN:
            s = tl.load(s_rows + k0 // GROUP).to(tl.float32)
        else:
            s = tl.load(s_rows + k0 // GROUP, mask=col_mask[:, None], other=0.0).to(tl.float32)
        if HAS_OFFSET:
            o = tl.load(o_rows + k0 // GROUP, mask=col_mask[:, None], other=0.0)
    else:
        groups = (word_k // GROUP)[None, :]
        if EVEN:
            s = tl.load(s_rows + groups).to(tl.float32)
        else:
            s = tl.load(s_rows + groups, mask=w_mask, other=0.0).to(tl.float32)
        if HAS_OFFSET:
            o = tl.load(o_rows + groups, mask=col_mask[:, None] & (word_k < hidden)[None, :], other=0.0)
    if HAS_OFFSET:
        return s * part, (s * (1 << BITS) - o) * xsum[None, :]
    return s * part, s * xsum[None, :]


@triton.jit
def _int_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    bias_ptr,
    out_ptr,
    num_cols,
    hidden,
    stride_qn,
    stride_sn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_N divides num_cols and BLOCK_K divides hidden: no masks
    X_PAIRS: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    """One row: BLOCK_N weight rows x the whole of K per program, [BLOCK_N, words] fp32
    accumulators reduced once after the loop (the layout of kernels/gemv.py)."""
    pdl.begin(PDL)
    WORDS: tl.constexpr = BLOCK_K // (32 // BITS)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < num_cols
    q_rows = q_ptr + cols.to(tl.int64)[:, None] * stride_qn
    s_rows = s_ptr + cols.to(tl.int64)[:, None] * stride_sn
    o_rows = o_ptr + cols.to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    acc_x = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        a, b = int_words_times_x(
            q_rows, s_rows, o_rows, x_ptr, k0, hidden, col_mask,
            BITS, GROUP, HAS_OFFSET, BLOCK_N, WORDS, EVEN, X_PAIRS,
        )  # fmt: skip
        acc += a
        acc_x += b
    if HAS_OFFSET:
        out = tl.sum(acc * (1 << BITS) - acc_x, axis=1)
    else:
        out = tl.sum(acc * (1 << BITS) - acc_x * ((1 << BITS) + (1 << (BITS - 1))), axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_mask)


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


def gemv_block_k(block_k: int, hidden: int, bits: int) -> int:
    """The K step of the integer GEMV: block_k capped at next_power_of_2(K), at least 16 and one word."""
    return max(16, 32 // bits, min(block_k, triton.next_power_of_2(hidden)))


def int_linear_triton(
    x, packed, scales, offsets, bits, group_size, bias=None, *, tile: IntTile | None = None
):
    """Triton int_linear_ref. x: [M, K] bf16/fp16/fp32, contiguous along K; bias [N] or None.
    One row runs the GEMV kernel above, more rows kernels/quant_dot.py; a MagicTile runs
    kernels/quant_int_magic.py, a Half2Tile kernels/quant_int_half2.py and a GemvTile
    kernels/quant_int_gemv.py where they fit (else the default tile). Returns a new [M, N] of x.dtype.
    x may also be a Half2X (quant_int_half2.py: one row as the f16x2 GEMV's operands), which runs that
    GEMV at `tile` (a Half2Tile; None: HALF2X_DEFAULT).
    Raises ValueError for shapes that do not fit the layout, a group size that splits a packed word,
    or a GEMV tile given several rows."""
    if isinstance(x, Half2X):
        check_int_weights(packed, scales, offsets, bits, group_size, x.hidden)
        if bits != 4:
            raise ValueError(f"Half2X feeds the 4-bit f16x2 GEMV; these weights have {bits} bits")
        tile = tile if isinstance(tile, Half2Tile) else HALF2X_DEFAULT
        scales, offsets = scales.contiguous(), offsets.contiguous() if offsets is not None else None
        return quant_int_half2.half2_int4_gemv(x, packed, scales, offsets, group_size, bias, tile=tile)
    num_rows, hidden = x.shape
    check_int_weights(packed, scales, offsets, bits, group_size, hidden)
    if x.stride(1) != 1:
        raise ValueError("int_linear needs x contiguous along K: call .contiguous() first")
    if group_size < hidden and group_size % values_per_word(bits):
        raise ValueError(
            f"group size {group_size} is not a multiple of the {values_per_word(bits)} values "
            f"in a packed int32 word at {bits} bits"
        )
    num_cols = packed.shape[0]
    scales = scales.contiguous()
    offsets = offsets.contiguous() if offsets is not None else None
    if isinstance(tile, MagicTile):
        if quant_int_magic.fits(x, bits, group_size):
            return quant_int_magic.magic_int4_gemv(x, packed, scales, offsets, group_size, bias, tile=tile)
        tile = None
    if isinstance(tile, Half2Tile):
        if num_rows != 1:
            raise ValueError(f"the half2 GEMV tile takes one row; got {num_rows}")
        if quant_int_half2.fits(x, bits, group_size):
            return quant_int_half2.half2_int4_gemv(x, packed, scales, offsets, group_size, bias, tile=tile)
        tile = None
    if isinstance(tile, GemvTile):
        if num_rows != 1:
            raise ValueError(f"the GEMV tile takes one row; got {num_rows}")
        if quant_int_gemv.fits(bits, group_size, hidden):
            return quant_int_gemv.int_gemv(x, packed, scales, offsets, bits, group_size, bias, tile=tile)
        tile = None
    tile = launch_tile(tile, num_rows)
    if tile.block_m > 1:
        return quant_dot(
            x, packed, scales, offsets, bias, bits=bits, scale_n=1, scale_k=group_size, tile=tile
        )
    out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    if num_cols == 0:
        return out
    block_k = gemv_block_k(tile.block_k, hidden, bits)
    _int_gemv_kernel[(triton.cdiv(num_cols, tile.block_n),)](
        x, packed, scales, offsets if offsets is not None else scales, bias if bias is not None else x, out,
        num_cols, hidden, packed.stride(0), scales.stride(0),
        BITS=bits, GROUP=group_size, HAS_OFFSET=offsets is not None, HAS_BIAS=bias is not None,
        BLOCK_N=tile.block_n, BLOCK_K=block_k, EVEN=num_cols % tile.block_n == 0 and hidden % block_k == 0,
        X_PAIRS=x_pairs(x), num_warps=tile.num_warps, num_stages=tile.num_stages,
        **pdl.launch(x.device),
    )  # fmt: skip
    return out
