"""One-row INT4 GEMV with the dequantization and the products two weights per instruction (f16x2).

Contract and weight layout of kernels/quant_int.py (which checks the inputs and launches this for a
Half2Tile): packed [N, ceil(K / 8)] int32, value i of a word in bits [4i, 4i + 4); scales
[N, ceil(K / group)] any float; offsets None (w = (q - 8) s) or float32 of the scales' shape
(w = q s + o); x [1, K] bf16 or fp16 with K a multiple of 32 and the group a multiple of 32 (fits);
out [1, N] of x's dtype.

Per word and pair of f16 lanes (PTX inline, module constants below): one LOP3 turns the codes at
bits 0-3 and 16-19 into the f16 pair (1024 + q_i, 1024 + q_i+4), or those at bits 4-7 / 20-23 into
1024 + 16 q; one HSUB2 makes q - 8 (times 16) exactly; one HFMA2 multiplies it by the matching x pair
and adds it to an f16x2 sum over the 16-byte vector (32 codes, one scale group). So the product
costs about 1.6 instructions a weight, 2.2-3.0 with x's conversion and the loads (sm_90, the tiles
start-up times), against 3.1-3.4 for the fp32 forms of kernels/quant_int_gemv.py.

x is turned into those pairs once a step for all of a program's rows, in block floating point: each
vector's x is multiplied by m = 2^-E (E the exponent of its largest |x|), so the largest is in
[1, 2), every product of the f16 sum is at most 16 and the sum at most 256 whatever x's range, and
values more than 2^10 below the vector's largest (which add nothing a bf16 output can show) are the
only ones that lose precision (f16 subnormals). The x16 lanes take m / 16. The vector's sum P goes
to fp32 and takes its scale there: sum_k w x = (s / m) P (+ (8 s + o) X with offsets, X the vector's
x sum). Accuracy: each product rounds to f16 (11 bits) and so does each of a lane's 16 partial sums:
about 1e-3 of a vector's magnitude, against bf16 output's 4e-3.

Layout: a step is a [BLOCK_N, CH, 4] tile of words (row, 16-byte vector, word), each thread one
vector of each of its rows, and x of that vector as 4 more 16-byte loads of the same shape
(kernels/quant_int_gemv.py's arrangement), so codes, x pairs and scales share registers without
shared memory. The f16x2 code needs a GPU: under TRITON_INTERPRET the same sums run in fp32 (the
CPU tests check the layout, masks, scales and offsets; the GPU tests the f16x2 code).

Every program converts x again. half2_x makes those operands once (Half2X: the same bits), and the
kernel also takes x in that form: about a quarter fewer instructions a program and fewer registers
(tests/kernels/quant_int_asm.py --ready). The kernels that make x write it in that form themselves
(store_half2x: the fused add + RMSNorm, SiLU-and-mul) where the projection reading x takes Half2X
(model/input_forms.py), so the conversion costs no launch of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.decode_merge import arrival_counters
from tpfuse.kernels.quant_dot import IntTile
from tpfuse.kernels.quant_int_gemv import one_row_output, split4
from tpfuse.kernels.skinny_linear import partials_buffer, store_row_split_k

__all__ = [
    "Half2Tile", "Half2X", "check_holds", "empty_half2x", "fits", "half2_int4_gemv", "half2_x", "holds",
    "interpreting", "rows_dot_x", "store_half2x",
]

VECTOR_VALUES = 32  # codes in one 16-byte vector (4 words)

# Two float32 values as one f16 pair: $1 the low lane, $2 the high one.
_F16_PAIR = tl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;")


def _word(w: int, x0: int) -> str:
    """PTX: word operand $w, its x pairs $x0 .. $x0 + 3, into the f16x2 register acc."""
    return f"""
lop3.b32 t, ${w}, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t, t, k_lo;
fma.rn.f16x2 acc, t, ${x0}, acc;
lop3.b32 t, ${w}, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 t, t, k_hi;
fma.rn.f16x2 acc, t, ${x0 + 1}, acc;
shr.u32 w8, ${w}, 8;
lop3.b32 t, w8, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t, t, k_lo;
fma.rn.f16x2 acc, t, ${x0 + 2}, acc;
lop3.b32 t, w8, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 t, t, k_hi;
fma.rn.f16x2 acc, t, ${x0 + 3}, acc;
"""


# $0 (f32): sum over a vector of (q - 8) x m; $1..$4 its words, $5..$20 their x pairs (4 a word).
# k_lo / k_hi: 1024 + 8 and 1024 + 128 as f16 pairs.
_VECTOR = tl.constexpr(
    """
{
.reg .b32 t, w8, acc, k_lo, k_hi;
.reg .b16 h0, h1;
.reg .f32 f0, f1;
mov.b32 acc, 0;
mov.b32 k_lo, 0x64086408;
mov.b32 k_hi, 0x64806480;
"""
    + "".join(_word(1 + v, 5 + 4 * v) for v in range(4))
    + """
mov.b32 {h0, h1}, acc;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
add.f32 $0, f0, f1;
}
"""
)


@dataclass(frozen=True)
class Half2Tile(IntTile):
    """A launch of the kernel here (block_m 1; block_n rows a program; block_k the K step, one 16-byte
    vector a thread and row at 32 * 32 * num_warps; num_stages unused; split_k > 1: K divided among
    that many programs a row block, for shapes with too few row blocks to keep the GPU's loads in
    flight)."""

    def label(self) -> str:
        split = f" split{self.split_k}" if self.split_k > 1 else ""
        return f"half2 n{self.block_n} k{self.block_k} w{self.num_warps}{split}"


@dataclass(frozen=True)
class Half2X:
    """x [1, K] as the f16x2 product's operands, made once for every product that reads it (half2_x)
    instead of once a program: pairs [K / 32, 16] int32, word v of a vector its four f16x2 operands
    ((x0, x4) m, (x1, x5) m / 16, (x2, x6) m, (x3, x7) m / 16 of the vector's values 8v .. 8v + 7, the
    low lane first); stats [2, K / 32] float32, contiguous: inv_m (1 / m, the module doc's block
    floating point) then sums (each vector's x sum, for offset codes), one tensor so that a kernel
    writes both from one pointer; dtype, x's."""

    pairs: torch.Tensor
    stats: torch.Tensor
    dtype: torch.dtype

    @property
    def inv_m(self) -> torch.Tensor:
        return self.stats[0]

    @property
    def sums(self) -> torch.Tensor:
        return self.stats[1]

    @property
    def hidden(self) -> int:
        return self.pairs.shape[0] * VECTOR_VALUES

    @property
    def shape(self) -> tuple[int, int]:
        return (1, self.hidden)

    @property
    def device(self) -> torch.device:
        return self.pairs.device

    @property
    def is_cuda(self) -> bool:
        return self.pairs.is_cuda

    def values(self) -> torch.Tensor:
        """The x [1, K] float32 the operands stand for: each value rounded to f16 at its vector's scale
        (exactly what the f16x2 product multiplies; reference paths use it)."""
        lanes = torch.stack([self.pairs & 0xFFFF, self.pairs >> 16], dim=-1)  # [vector, word * 4 + j, lane]
        halves = lanes.to(torch.int16).view(torch.float16).float().reshape(-1, 4, 4, 2)
        halves = halves * torch.tensor([1.0, 16.0, 1.0, 16.0], device=halves.device)[None, None, :, None]
        xm = halves.permute(0, 1, 3, 2).reshape(-1, VECTOR_VALUES)  # [vector, word * 8 + lane * 4 + j]
        return (xm * self.inv_m[:, None]).reshape(1, -1)


def holds(rows: int, cols: int, dtype: torch.dtype) -> bool:
    """Whether a Half2X holds x [rows, cols] of dtype: one bf16 / fp16 row of a multiple of 32 values."""
    return rows == 1 and cols % VECTOR_VALUES == 0 and dtype in (torch.bfloat16, torch.float16)


def check_holds(rows: int, cols: int, dtype: torch.dtype) -> None:
    """Raises ValueError naming the shape unless holds(rows, cols, dtype)."""
    if not holds(rows, cols, dtype):
        raise ValueError(
            f"Half2X takes one bf16 / fp16 row of a multiple of 32 values; got ({rows}, {cols}) {dtype}"
        )


def empty_half2x(hidden: int, dtype: torch.dtype, device) -> Half2X:
    """An unwritten Half2X of x [1, hidden] (hidden a multiple of 32), for store_half2x."""
    vectors = hidden // VECTOR_VALUES
    return Half2X(
        torch.empty((vectors, 16), dtype=torch.int32, device=device),
        torch.empty((2, vectors), dtype=torch.float32, device=device),
        dtype,
    )


def half2_x(x: torch.Tensor) -> Half2X:
    """x [1, K] (bf16 / fp16, K a multiple of 32) as Half2X: the operands the kernel would make in
    registers, bit for bit (m a power of two, so x m is exact in fp32 and rounds once to f16). Raises
    ValueError for another shape or dtype."""
    if x.dim() != 2:
        raise ValueError(f"half2_x takes x [1, K]; got {tuple(x.shape)}")
    check_holds(*x.shape, x.dtype)
    vectors = x.float().reshape(-1, VECTOR_VALUES)
    amax = vectors.abs().amax(dim=1)
    e = (amax.view(torch.int32) >> 23).clamp(1, 253)
    m = ((254 - e) << 23).view(torch.float32)
    inv_m = (e << 23).view(torch.float32)
    xm = (vectors * m[:, None]).reshape(-1, 4, 2, 4)  # [vector, word, value // 4, value % 4]
    xm = xm * torch.tensor([1.0, 0.0625, 1.0, 0.0625], device=x.device)  # the x16 lanes take m / 16
    halves = xm.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF  # [vector, word, lane, j]
    pairs = halves[:, :, 0, :] | (halves[:, :, 1, :] << 16)  # (x_j, x_j+4) for j = 0..3
    return Half2X(pairs.reshape(-1, 16).contiguous(), torch.stack([inv_m, vectors.sum(dim=1)]), x.dtype)


def fits(x: torch.Tensor, bits: int, group_size: int) -> bool:
    """Whether the kernel takes this layout: 4 bits, bf16 / fp16 x as aligned pairs, K and the group
    (unless it spans K) multiples of 32."""
    hidden = x.shape[-1]
    return (
        bits == 4
        and x.dtype in (torch.bfloat16, torch.float16)
        and hidden % VECTOR_VALUES == 0
        and (group_size >= hidden or group_size % VECTOR_VALUES == 0)
        and x.data_ptr() % 16 == 0
    )


@triton.jit
def store_half2x(y, pairs_ptr, stats_ptr, first_vector, num_vectors, BLOCK: tl.constexpr):
    """Writes y (float32 [BLOCK], BLOCK a multiple of 32: x's values from vector first_vector on, each
    already rounded to x's dtype, lanes past x's end 0) into a Half2X of num_vectors vectors (its pairs
    at pairs_ptr, its stats [2, num_vectors] at stats_ptr), the vectors below num_vectors: half2_x's
    operands, bit for bit (the sums to float32 rounding)."""
    NV: tl.constexpr = BLOCK // 32
    vectors = tl.reshape(y, [NV, 32])
    amax = tl.max(tl.abs(vectors), axis=1)
    e = tl.minimum(tl.maximum(amax.to(tl.int32, bitcast=True) >> 23, 1), 253)
    m = ((254 - e) << 23).to(tl.float32, bitcast=True)
    index = first_vector + tl.arange(0, NV)
    ok = index < num_vectors
    tl.store(stats_ptr + index, (e << 23).to(tl.float32, bitcast=True), mask=ok)  # inv_m
    tl.store(stats_ptr + num_vectors + index, tl.sum(vectors, axis=1), mask=ok)  # sums
    xm = tl.reshape(vectors * m[:, None], [NV, 4, 2, 4])  # [vector, word, value // 4, value % 4]
    j = tl.arange(0, 4)
    xm = xm * tl.where(j % 2 == 1, 0.0625, 1.0)[None, None, None, :]  # the x16 lanes take m / 16
    halves = xm.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    low, high = tl.split(tl.permute(halves, (0, 1, 3, 2)))  # [vector, word, j]: (x_j, x_j+4)
    words = tl.reshape(low | (high << 16), [NV * 16])
    w = tl.arange(0, NV * 16)
    tl.store(pairs_ptr + first_vector * 16 + w, words, mask=first_vector * 16 + w < num_vectors * 16)


@triton.jit
def _x_word(x_words, k_vec, k_ok, v: tl.constexpr, X_FP16: tl.constexpr, K_MASK: tl.constexpr):
    """x of word v of each vector (k_vec [CH] its first k) as float32 (low, high) [CH, 4]: low[c, j] =
    x[k + 2j], high[c, j] = x[k + 2j + 1] (read as int32 pairs; zeros masked)."""
    idx = (k_vec // 2 + 4 * v)[:, None] + tl.arange(0, 4)[None, :]
    if K_MASK:
        pairs = tl.load(x_words + idx, mask=k_ok[:, None], other=0)
    else:
        pairs = tl.load(x_words + idx)
    if X_FP16:
        lo = (pairs & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = (pairs << 16).to(tl.float32, bitcast=True)
        hi = (pairs & -65536).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _abs_max(lo, hi):
    return tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=1)


@triton.jit
def _columns(t, CH: tl.constexpr):
    """[CH, 4] -> its four columns [CH]."""
    e02, e13 = tl.split(tl.reshape(t, [CH, 2, 2]))
    e0, e2 = tl.split(e02)
    e1, e3 = tl.split(e13)
    return e0, e1, e2, e3


@triton.jit
def _f16_pair(low, high):
    return tl.inline_asm_elementwise(_F16_PAIR, "=r,r,r", [low, high], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _word_operands(lo, hi, m, CH: tl.constexpr):
    """A word's x (_x_word) times the vectors' m [CH] as its four f16x2 operands [CH]: (x0, x4),
    (x1, x5) / 16, (x2, x6), (x3, x7) / 16, the low lane first (module doc)."""
    l0, l1, l2, l3 = _columns(lo * m[:, None], CH)
    h0, h1, h2, h3 = _columns(hi * (m * 0.0625)[:, None], CH)
    return _f16_pair(l0, l2), _f16_pair(h0, h2), _f16_pair(l1, l3), _f16_pair(h1, h3)


@triton.jit
def _word_sum_fp32(w, lo, hi, m, CH: tl.constexpr):
    """The interpreter's stand-in for the PTX: sum over a word's 8 codes of (q - 8) x m in fp32
    ([BLOCK_N, CH] words, _x_word's x, m [CH])."""
    x = tl.reshape(tl.join(lo, hi), [CH, 8]) * m[:, None]  # x[c, i] m for the word's value i
    shifts = tl.arange(0, 8) * 4
    q = ((w[:, :, None] >> shifts[None, None, :]) & 0xF).to(tl.float32) - 8.0
    return tl.sum(q * x[None, :, :], axis=2)


@triton.jit
def _ready_word(pairs_ptr, vectors, k_ok, v: tl.constexpr, CH: tl.constexpr, K_MASK: tl.constexpr):
    """Half2X's four operands [CH] of word v of each vector (vectors [CH] their indices)."""
    idx = (vectors * 16 + 4 * v)[:, None] + tl.arange(0, 4)[None, :]
    if K_MASK:
        operands = tl.load(pairs_ptr + idx, mask=k_ok[:, None], other=0)
    else:
        operands = tl.load(pairs_ptr + idx)
    return _columns(operands, CH)


@triton.jit
def _lanes_sum_fp32(w, operand, j: tl.constexpr, scale: tl.constexpr):
    """The interpreter's stand-in for a word's operand: (q_j - 8) x_j m + (q_j+4 - 8) x_j+4 m in fp32
    ([BLOCK_N, CH] words, [CH] operand whose lanes hold x m / scale)."""
    lo = (operand & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * scale
    hi = (operand >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * scale
    q_lo = ((w >> (4 * j)) & 0xF).to(tl.float32) - 8.0
    q_hi = ((w >> (4 * j + 16)) & 0xF).to(tl.float32) - 8.0
    return q_lo * lo[None, :] + q_hi * hi[None, :]


@triton.jit
def _ready_word_sum_fp32(w, a, b, c, d):
    return (_lanes_sum_fp32(w, a, 0, 1.0) + _lanes_sum_fp32(w, b, 1, 16.0)
            + _lanes_sum_fp32(w, c, 2, 1.0) + _lanes_sum_fp32(w, d, 3, 16.0))  # fmt: skip


@triton.jit
def rows_dot_x(
    q_rows, s_rows, o_rows, x_ptr, hidden, row_mask, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASK_N: tl.constexpr, K_MASK: tl.constexpr,
    X_FP16: tl.constexpr, INTERPRET: tl.constexpr, pairs_ptr=None, inv_m_ptr=None, sums_ptr=None,
    X_READY: tl.constexpr = False, k_start=0,
):  # fmt: skip
    """[BLOCK_N] float32: BLOCK_N weight rows dotted with x over k_start .. hidden (module doc; k_start a
    multiple of BLOCK_K). q_rows
    [BLOCK_N, 1, 1] points at each row's first word, s_rows / o_rows [BLOCK_N, 1] at its first scale
    / offset, x_ptr at x's first value (16-byte aligned). MASK_N: rows outside row_mask read as zeros;
    K_MASK: BLOCK_K does not divide K (whole vectors masked). INTERPRET: fp32 sums instead of the
    f16x2 PTX (TRITON_INTERPRET). X_READY: x comes as Half2X (its pairs, inv_m and sums pointers; x_ptr
    unused) instead of being converted here."""
    CH: tl.constexpr = BLOCK_K // 32
    c = tl.arange(0, CH)
    vec = c[:, None] * 4 + tl.arange(0, 4)[None, :]
    x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    acc = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
    for k0 in range(k_start, hidden, BLOCK_K):
        k_vec = k0 + c * 32
        k_ok = k_vec < hidden
        w_mask = tl.full([BLOCK_N, CH, 4], 1, tl.int1)
        s_mask = tl.full([BLOCK_N, CH], 1, tl.int1)
        if MASK_N:
            w_mask = w_mask & row_mask[:, None, None]
            s_mask = s_mask & row_mask[:, None]
        if K_MASK:
            w_mask = w_mask & k_ok[None, :, None]
            s_mask = s_mask & k_ok[None, :]
        words = tl.load(
            q_rows + (k0 // 8 + vec)[None, :, :], mask=w_mask, other=0, eviction_policy="evict_first"
        )
        groups = (k_vec // GROUP)[None, :]
        s = tl.load(s_rows + groups, mask=s_mask, other=0.0).to(tl.float32)
        w0, w1, w2, w3 = split4(words, BLOCK_N, CH)
        if X_READY:
            vectors = k_vec // 32
            inv_m = tl.load(inv_m_ptr + vectors, mask=k_ok, other=0.0)
            a0, b0, c0, d0 = _ready_word(pairs_ptr, vectors, k_ok, 0, CH, K_MASK)
            a1, b1, c1, d1 = _ready_word(pairs_ptr, vectors, k_ok, 1, CH, K_MASK)
            a2, b2, c2, d2 = _ready_word(pairs_ptr, vectors, k_ok, 2, CH, K_MASK)
            a3, b3, c3, d3 = _ready_word(pairs_ptr, vectors, k_ok, 3, CH, K_MASK)
            if INTERPRET:
                p = _ready_word_sum_fp32(w0, a0, b0, c0, d0) + _ready_word_sum_fp32(w1, a1, b1, c1, d1)
                p += _ready_word_sum_fp32(w2, a2, b2, c2, d2) + _ready_word_sum_fp32(w3, a3, b3, c3, d3)
            if HAS_OFFSET:
                x_sum = tl.load(sums_ptr + vectors, mask=k_ok, other=0.0)
        else:
            lo0, hi0 = _x_word(x_words, k_vec, k_ok, 0, X_FP16, K_MASK)
            lo1, hi1 = _x_word(x_words, k_vec, k_ok, 1, X_FP16, K_MASK)
            lo2, hi2 = _x_word(x_words, k_vec, k_ok, 2, X_FP16, K_MASK)
            lo3, hi3 = _x_word(x_words, k_vec, k_ok, 3, X_FP16, K_MASK)
            # per vector m = 2^-E, E the exponent of its largest |x| kept within [-126, 126], so that m and
            # 1 / m stay normal floats (a vector of subnormal x keeps its values, one of zeros gives zeros)
            amax = tl.maximum(tl.maximum(_abs_max(lo0, hi0), _abs_max(lo1, hi1)),
                              tl.maximum(_abs_max(lo2, hi2), _abs_max(lo3, hi3)))  # fmt: skip
            e = tl.minimum(tl.maximum(amax.to(tl.int32, bitcast=True) >> 23, 1), 253)
            m = ((254 - e) << 23).to(tl.float32, bitcast=True)
            inv_m = (e << 23).to(tl.float32, bitcast=True)
            if INTERPRET:
                p = _word_sum_fp32(w0, lo0, hi0, m, CH) + _word_sum_fp32(w1, lo1, hi1, m, CH)
                p += _word_sum_fp32(w2, lo2, hi2, m, CH) + _word_sum_fp32(w3, lo3, hi3, m, CH)
            else:
                a0, b0, c0, d0 = _word_operands(lo0, hi0, m, CH)
                a1, b1, c1, d1 = _word_operands(lo1, hi1, m, CH)
                a2, b2, c2, d2 = _word_operands(lo2, hi2, m, CH)
                a3, b3, c3, d3 = _word_operands(lo3, hi3, m, CH)
            if HAS_OFFSET:
                x_sum = tl.sum(lo0 + hi0 + lo1 + hi1 + lo2 + hi2 + lo3 + hi3, axis=1)
        if not INTERPRET:
            p = tl.inline_asm_elementwise(
                _VECTOR, "=r" + ",r" * 20,
                [w0, w1, w2, w3, a0[None, :], b0[None, :], c0[None, :], d0[None, :], a1[None, :],
                 b1[None, :], c1[None, :], d1[None, :], a2[None, :], b2[None, :], c2[None, :], d2[None, :],
                 a3[None, :], b3[None, :], c3[None, :], d3[None, :]],
                dtype=tl.float32, is_pure=True, pack=1,
            )  # fmt: skip
        acc += s * inv_m[None, :] * p
        if HAS_OFFSET:  # sum w x = s sum (q - 8) x + (8 s + o) X
            o = tl.load(o_rows + groups, mask=s_mask, other=0.0)
            acc_o += (8.0 * s + o) * x_sum[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_OFFSET:
        out += tl.sum(acc_o, axis=1)
    return out


@triton.jit
def _half2_kernel(
    x_ptr, pairs_ptr, inv_m_ptr, sums_ptr, q_ptr, s_ptr, o_ptr, bias_ptr, out_ptr, partials_ptr, counter_ptr,
    num_cols, hidden: tl.constexpr, stride_qn: tl.constexpr, stride_sn: tl.constexpr, GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,  # BLOCK_N divides num_cols: rows unmasked
    K_MASK: tl.constexpr,  # BLOCK_K does not divide K: whole vectors masked
    X_FP16: tl.constexpr,
    X_READY: tl.constexpr,  # x as Half2X (pairs, inv_m, sums); x_ptr unused
    INTERPRET: tl.constexpr,  # fp32 sums instead of the f16x2 PTX (TRITON_INTERPRET)
    SPLIT_K: tl.constexpr,  # > 1: program_id(1) takes K_PER_SPLIT columns; partials summed by the last
    K_PER_SPLIT: tl.constexpr,  # a multiple of BLOCK_K
    PDL: tl.constexpr,  # kernels/pdl.py
):  # fmt: skip
    """BLOCK_N rows over the whole of K per program, or over one of SPLIT_K parts of it (rows_dot_x).
    Offsets are int32 (the launcher checks N * row stride < 2^31)."""
    pdl.begin(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = cols < num_cols
    k_start = 0
    k_end = hidden
    if SPLIT_K > 1:
        k_start = tl.program_id(1) * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, hidden)
    out = rows_dot_x(
        q_ptr + (cols * stride_qn)[:, None, None], s_ptr + (cols * stride_sn)[:, None],
        o_ptr + (cols * stride_sn)[:, None], x_ptr, k_end, row_mask, GROUP, HAS_OFFSET, BLOCK_N, BLOCK_K,
        not EVEN_N, K_MASK, X_FP16, INTERPRET, pairs_ptr, inv_m_ptr, sums_ptr, X_READY, k_start,
    )  # fmt: skip
    store_row_split_k(out, partials_ptr, counter_ptr, cols, row_mask, num_cols, bias_ptr, out_ptr, HAS_BIAS,
                      SPLIT_K)  # fmt: skip


def interpreting() -> bool:
    """Whether Triton runs under its interpreter (TRITON_INTERPRET=1): rows_dot_x's INTERPRET."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def half2_step(tile: Half2Tile, hidden: int) -> int:
    """The K step: tile.block_k capped at next_power_of_2(K), at least one vector."""
    return max(VECTOR_VALUES, min(tile.block_k, triton.next_power_of_2(hidden)))


def half2_split(tile: Half2Tile, hidden: int) -> tuple[int, int]:
    """(parts, columns a part) of K for the tile: at most tile.split_k parts of whole K steps, none
    empty."""
    block_k = half2_step(tile, hidden)
    split_k = max(1, min(tile.split_k, triton.cdiv(hidden, block_k)))
    k_per_split = max(block_k, triton.cdiv(triton.cdiv(hidden, split_k), block_k) * block_k)
    return max(1, triton.cdiv(hidden, k_per_split)), k_per_split


def half2_int4_gemv(x, packed, scales, offsets, group_size, bias=None, *, tile: Half2Tile, out=None):
    """x [1, K] (or that x made once as Half2X) @ dequant(packed, scales, offsets).T (+ bias) -> out
    [1, N] of x's dtype (allocated when None); inputs checked by kernels/quant_int.py, layout fitting
    (fits)."""
    ready = isinstance(x, Half2X)
    hidden = x.hidden if ready else x.shape[1]
    num_cols = packed.shape[0]
    if ready and not (group_size >= hidden or group_size % VECTOR_VALUES == 0):
        raise ValueError(f"Half2X takes groups of whole 32-value vectors; got group {group_size}")
    if ready:
        out = torch.empty((1, num_cols), dtype=x.dtype, device=packed.device) if out is None else out
    out = one_row_output(out if ready else x, packed, scales, out, "the half2 GEMV's programs")
    if num_cols == 0:
        return out
    block_k = half2_step(tile, hidden)
    split_k, k_per_split = half2_split(tile, hidden)
    grid = (triton.cdiv(num_cols, tile.block_n), split_k)
    partials = counters = out
    if split_k > 1:
        partials = partials_buffer(packed.device, split_k * num_cols)
        counters = arrival_counters(packed.device, grid[0])
    o_arg = offsets if offsets is not None else scales
    bias_arg = bias if bias is not None else out
    shape = dict(
        hidden=hidden, stride_qn=packed.stride(0), stride_sn=scales.stride(0), GROUP=group_size,
        HAS_OFFSET=offsets is not None, HAS_BIAS=bias is not None, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        EVEN_N=num_cols % tile.block_n == 0, K_MASK=hidden % block_k != 0, INTERPRET=interpreting(),
        SPLIT_K=split_k, K_PER_SPLIT=k_per_split, num_warps=tile.num_warps, num_stages=1,
        **pdl.launch(packed.device),
    )  # fmt: skip
    x_parts = (packed, x.pairs, x.inv_m, x.sums) if ready else (x, x, x, x)  # x_ptr, pairs, inv_m, sums
    _half2_kernel[grid](
        *x_parts, packed, scales, o_arg, bias_arg, out, partials, counters, num_cols, **shape,
        X_FP16=not ready and x.dtype == torch.float16, X_READY=ready,
    )  # fmt: skip
    return out
