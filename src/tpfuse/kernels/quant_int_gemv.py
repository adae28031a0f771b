"""One-row integer GEMV forms laid out so each thread's codes, x and scale share one register layout
(a GemvTile; kernels/quant_int.py checks the inputs and launches these). Weight layout and contract
of kernels/quant_int.py: packed [N, ceil(K / V)] int32 (V = 32 / bits values a word, value i in bits
[i * bits, (i + 1) * bits)), scales [N, ceil(K / group)] any float, offsets None (w = (q - 2^(bits-1)) s)
or float32 of the scales' shape (w = q s + o); x [1, K]; out [1, N] of x's dtype.

Layout. A step is a [BLOCK_N, CH, 4] tile of words: row n, 16-byte vector c (4 words, VK = 4 V values
of K: 32 at 4 bits, 16 at 8), word v. With CH at least the block's thread count every thread loads
one whole vector of each of the BLOCK_N rows (BLOCK_N 16-byte loads in flight) at the same K, and x
for that vector is 4 more 16-byte loads ([CH, V / 2] bf16 pairs per word) of the same shape and
contiguity as the words, so the compiler gives them the words' register layout: no shared-memory
exchange of x, no barrier in the K loop (the GEMV of kernels/quant_int.py converts x through shared
memory every step). The scale ([BLOCK_N, CH], constant over a vector: the group a multiple of VK)
lands in the same layout and multiplies once per vector and row.

Codes as floats, two per shift. For the pair of values (2j, 2j + 1) of a 4-bit word one shift puts
them at bits 15-18 and 19-22, and one LOP3 each makes the float 1 + q / 2^L (L = 8 and 4: mask, or
1.0's bits), so a weight costs 1.5 integer ops and one FFMA against x (8-bit codes: one shift and one
LOP3 each, L = 8). The masks are kernel arguments so they stay in registers (as immediates ptxas
re-materializes them into registers before every use: 4.7 instructions a weight instead of 3.75 at
n8 k4096 w4 pin). Per row and vector, with A_lo / A_hi the two chains (even / odd values) and
X_lo / X_hi their x sums (shared by all rows),
    sum_k w x = 2^H s [2^(L_lo - H)(A_lo - X_lo) + (A_hi - X_hi) - c X] (+ o X),   H = L_hi,
c = 2^(bits-1) / 2^H = 1/2 for symmetric codes (0 with offsets). The chain A_hi starts at minus the
row-free part, so a vector costs two FFMAs a row past the weights': P = 16 A_lo + A_hi, then
acc += s P. acc [BLOCK_N, CH] is one register a row; it is reduced across the block once after the
K loop (5 shuffle levels a row, then shared memory across warps: about 0.5 instructions a weight
when a thread's part of a row is one vector, K = 4096 on 4 warps). The lo chain's codes sit 4 bits
lower (1 + q / 256), which costs about 4 bits of the fp32 chain's precision (about 1e-6 relative).

Issue. ptxas sinks each load to shortly before its first use (a few hundred instructions), so a
step's 8 row loads would go out one by one between rows' arithmetic. GemvTile.pin adds to the
chains' start a +0.0 computed from every row's codes and scale (_pin, through a runtime zero), so all
of a step's loads are issued together at its top (at 128 registers for 8 rows, against 80 unpinned).
A register prefetch of the next step is sunk the same way to the end of the current one.

Forms (GemvTile.form):
  "vec"  each program takes BLOCK_N rows over the whole of K in steps of BLOCK_K (one step at
         K = 4096 with 4 warps); prefetch loads the next step's codes and scales into registers
         during this one (not with pin);
  "xs"   x-stationary: each thread converts its K-slice of x (and its vectors' x sums) once (K at most
         one step), and each program loops over row groups of BLOCK_N (groups pid, pid + P, ...:
         P programs, at most programs_per_sm per SM, each taking the same number of groups),
         reducing each group across the block as it goes; prefetch: the next group's codes and
         scales in flight while it computes this one's. Longer K runs "vec" with the same tile.
Groups that are not a multiple of VK (and smaller than K) do not fit either form: they run the GEMV of
kernels/quant_int.py (its default tile). Offsets into the weights are int32 (the launcher checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.paged_attention_common import device_sms
from tpfuse.kernels.quant_dot import IntTile

__all__ = [
    "FORMS", "GemvTile", "fits", "gemv_step", "int_gemv", "k_mask", "one_row_output", "split4", "x_pairs",
    "xs_programs",
]  # fmt: skip

FORMS = ("vec", "xs")
MASKS = {4: (0xF << 15, 0xF << 19), 8: (0xFF << 15, 0xFF << 15)}  # (lo, hi) code bits after the shift


@dataclass(frozen=True)
class GemvTile(IntTile):
    """A launch of the forms here (block_m 1; block_n rows per thread and step or row group; block_k the
    K step at 4 bits, one 16-byte vector per thread and row at 1024 * num_warps: gemv_step; num_stages
    unused, the K loop never runs Triton's pipeliner)."""

    form: str = "vec"
    prefetch: bool = False
    programs_per_sm: int = 4  # "xs": programs launched per SM (each loops over row groups)
    max_registers: int = 0  # ptxas's cap per thread (maxnreg), 0: none
    pin: bool = False  # issue a step's loads together before its arithmetic (_pin); not with prefetch

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"GemvTile form {self.form!r} is not one of {FORMS}")
        if self.pin and self.prefetch:  # pinning a prefetch stalls on it where it is pinned
            raise ValueError("GemvTile: pin and prefetch exclude each other")

    def label(self) -> str:
        extra = " prefetch" * self.prefetch + (f" p{self.programs_per_sm}" if self.form == "xs" else "")
        extra += f" r{self.max_registers}" if self.max_registers else ""
        extra += " pin" * self.pin
        return f"gemv-{self.form} n{self.block_n} k{self.block_k} w{self.num_warps}{extra}"


def vector_values(bits: int) -> int:
    """K values in one 16-byte vector of codes."""
    return 4 * (32 // bits)


def fits(bits: int, group_size: int, hidden: int) -> bool:
    """Whether the forms here take this layout: each 16-byte vector of codes inside one group."""
    return bits in MASKS and (group_size >= hidden or group_size % vector_values(bits) == 0)


def gemv_step(tile: GemvTile, hidden: int, bits: int) -> int:
    """The K step: tile.block_k at 4 bits, half of it at 8 (the same 16-byte vectors a thread and row),
    capped at next_power_of_2(K), at least one vector."""
    step = tile.block_k * 4 // bits
    return max(vector_values(bits), min(step, triton.next_power_of_2(hidden)))


@triton.jit
def split4(t, A: tl.constexpr, B: tl.constexpr):
    """[A, B, 4] -> its four [A, B] slices along the last dim (register renaming)."""
    e02, e13 = tl.split(tl.reshape(t, [A, B, 2, 2]))
    e0, e2 = tl.split(e02)
    e1, e3 = tl.split(e13)
    return e0, e1, e2, e3


@triton.jit
def _columns(t, CH: tl.constexpr, NP: tl.constexpr):
    """[CH, NP] (NP 2 or 4) -> its NP columns (four; the last two repeat the first at NP 2)."""
    if NP == 4:
        e02, e13 = tl.split(tl.reshape(t, [CH, 2, 2]))
        e0, e2 = tl.split(e02)
        e1, e3 = tl.split(e13)
    else:
        e0, e1 = tl.split(t)
        e2, e3 = e0, e1  # unused
    return e0, e1, e2, e3


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _pin(words, s, zero, BLOCK_N: tl.constexpr, CH: tl.constexpr):
    """+0.0 [CH] that depends on every row's codes and scale (zero: a runtime 0), so that an addition
    of it makes ptxas issue all those loads before that point (it otherwise sinks each load to just
    before its first use, a few instructions' latency ahead)."""
    w0, w1, w2, w3 = split4(words, BLOCK_N, CH)
    bits = tl.reduce(w3 ^ s.to(tl.int32, bitcast=True), 0, _xor)
    return (bits & zero).to(tl.float32, bitcast=True)


@triton.jit
def _shifted(w, SHIFT: tl.constexpr):
    if SHIFT > 0:
        out = w << SHIFT
    elif SHIFT < 0:
        out = w >> (-SHIFT)
    else:
        out = w
    return out


@triton.jit
def _as_float(bits, mask):
    return ((bits & mask) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _x_word(x_ptr, k_first, k_ok, hidden, CH: tl.constexpr, NP: tl.constexpr, K_MASK: tl.constexpr,
            X_PAIRS: tl.constexpr):  # fmt: skip
    """x of one word per vector: (lo, hi) [CH, NP] float32, lo[c, j] = x[k_first[c] + 2j], hi the next.
    X_PAIRS: bf16 read as int32 pairs (a 16-byte load of the words' shape per word at 4 bits).
    K_MASK: 0 none, 1 whole vectors (k_ok [CH]), 2 per element."""
    if X_PAIRS:
        x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        idx = k_first[:, None] // 2 + tl.arange(0, NP)[None, :]
        if K_MASK == 0:
            pairs = tl.load(x_words + idx)
        elif K_MASK == 1:
            pairs = tl.load(x_words + idx, mask=k_ok[:, None], other=0)
        else:
            pairs = tl.load(x_words + idx, mask=2 * idx < hidden, other=0)
        lo = (pairs << 16).to(tl.float32, bitcast=True)
        hi = (pairs & -65536).to(tl.float32, bitcast=True)
    else:
        idx = k_first[:, None] + tl.arange(0, 2 * NP)[None, :]
        if K_MASK == 0:
            values = tl.load(x_ptr + idx)
        elif K_MASK == 1:
            values = tl.load(x_ptr + idx, mask=k_ok[:, None], other=0.0)
        else:
            values = tl.load(x_ptr + idx, mask=idx < hidden, other=0.0)
        lo, hi = tl.split(tl.reshape(values.to(tl.float32), [CH, NP, 2]))
    return lo, hi


@triton.jit
def _word_product(w, lo, hi, part_lo, part_hi, m_lo, m_hi, BITS: tl.constexpr, CH: tl.constexpr,
                  NP: tl.constexpr):  # fmt: skip
    """part_lo / part_hi [BLOCK_N, CH] += the word w [BLOCK_N, CH]'s even / odd values (as 1 + q / 2^L)
    times x (lo / hi [CH, NP], _x_word)."""
    lo0, lo1, lo2, lo3 = _columns(lo, CH, NP)
    hi0, hi1, hi2, hi3 = _columns(hi, CH, NP)
    for j in tl.static_range(NP):
        if j == 0:
            xl, xh = lo0, hi0
        elif j == 1:
            xl, xh = lo1, hi1
        elif j == 2:
            xl, xh = lo2, hi2
        else:
            xl, xh = lo3, hi3
        if BITS == 4:  # values 2j, 2j + 1 at bits 15-18, 19-22 after one shift
            sh = _shifted(w, 15 - 8 * j)
            f_lo = _as_float(sh, m_lo)
            f_hi = _as_float(sh, m_hi)
        else:  # 8 bits: each value to bits 15-22
            f_lo = _as_float(_shifted(w, 15 - 16 * j), m_lo)
            f_hi = _as_float(_shifted(w, 7 - 16 * j), m_hi)
        part_lo += f_lo * xl[None, :]
        part_hi += f_hi * xh[None, :]
    return part_lo, part_hi


@triton.jit
def _vector_x(x_ptr, k0, hidden, BITS: tl.constexpr, CH: tl.constexpr, HAS_OFFSET: tl.constexpr,
              K_MASK: tl.constexpr, X_PAIRS: tl.constexpr):  # fmt: skip
    """x of a step's vectors, as _x_word per word v (lo_v, hi_v), the chains' row-free start
    -(2^(L_lo - H) X_lo + X_hi + c X) [CH] and the vectors' x sum X [CH]."""
    PER_WORD: tl.constexpr = 32 // BITS
    NP: tl.constexpr = PER_WORD // 2
    VK: tl.constexpr = 4 * PER_WORD
    k_vec = k0 + tl.arange(0, CH) * VK
    k_ok = k_vec < hidden
    lo0, hi0 = _x_word(x_ptr, k_vec, k_ok, hidden, CH, NP, K_MASK, X_PAIRS)
    lo1, hi1 = _x_word(x_ptr, k_vec + PER_WORD, k_ok, hidden, CH, NP, K_MASK, X_PAIRS)
    lo2, hi2 = _x_word(x_ptr, k_vec + 2 * PER_WORD, k_ok, hidden, CH, NP, K_MASK, X_PAIRS)
    lo3, hi3 = _x_word(x_ptr, k_vec + 3 * PER_WORD, k_ok, hidden, CH, NP, K_MASK, X_PAIRS)
    x_lo = tl.sum(lo0 + lo1 + lo2 + lo3, axis=1)
    x_hi = tl.sum(hi0 + hi1 + hi2 + hi3, axis=1)
    RATIO: tl.constexpr = 16.0 if BITS == 4 else 1.0  # 2^(L_lo - H)
    if HAS_OFFSET:
        start = -(RATIO * x_lo + x_hi)
    else:
        start = -(RATIO * x_lo + x_hi + 0.5 * (x_lo + x_hi))  # c = 2^(bits-1) / 2^H = 1/2
    return lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, start, x_lo + x_hi


@triton.jit
def _step_words(q_rows, k0, row_mask, hidden, live, BLOCK_N: tl.constexpr, CH: tl.constexpr,
                PER_WORD: tl.constexpr, MASK_N: tl.constexpr, K_MASK: tl.constexpr,
                LIVE: tl.constexpr):  # fmt: skip
    """[BLOCK_N, CH, 4] words of the K step at k0 (q_rows: [BLOCK_N, 1, 1] row pointers). LIVE: live
    (a scalar: False for a prefetch past the end) predicates the whole load."""
    VK: tl.constexpr = 4 * PER_WORD
    c = tl.arange(0, CH)
    vec = c[:, None] * 4 + tl.arange(0, 4)[None, :]
    ptrs = q_rows + (k0 // PER_WORD + vec)[None, :, :]
    if MASK_N or K_MASK > 0 or LIVE:
        mask = tl.full([BLOCK_N, CH, 4], 1, tl.int1)
        if MASK_N:
            mask = mask & row_mask[:, None, None]
        if K_MASK == 1:  # whole vectors: 16-byte loads stay
            mask = mask & (k0 + c * VK < hidden)[None, :, None]
        elif K_MASK == 2:
            mask = mask & ((k0 // PER_WORD + vec) * PER_WORD < hidden)[None, :, :]
        if LIVE:
            mask = mask & live
        words = tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
    else:
        words = tl.load(ptrs, eviction_policy="evict_first")
    return words


@triton.jit
def _step_scales(s_rows, o_rows, k0, row_mask, hidden, BLOCK_N: tl.constexpr, CH: tl.constexpr,
                 VK: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr,
                 MASK_N: tl.constexpr, K_MASK: tl.constexpr, live, LIVE: tl.constexpr):  # fmt: skip
    """Scales (and offsets) of a step's vectors, [BLOCK_N, CH] float32 (s_rows / o_rows [BLOCK_N, 1]);
    LIVE as in _step_words."""
    k_vec = k0 + tl.arange(0, CH) * VK
    groups = (k_vec // GROUP)[None, :]
    if MASK_N or K_MASK > 0 or LIVE:
        mask = tl.full([BLOCK_N, CH], 1, tl.int1)
        if MASK_N:
            mask = mask & row_mask[:, None]
        if K_MASK > 0:
            mask = mask & (k_vec < hidden)[None, :]
        if LIVE:
            mask = mask & live
        s = tl.load(s_rows + groups, mask=mask, other=0.0).to(tl.float32)
        o = s
        if HAS_OFFSET:
            o = tl.load(o_rows + groups, mask=mask, other=0.0)
    else:
        s = tl.load(s_rows + groups).to(tl.float32)
        o = s
        if HAS_OFFSET:
            o = tl.load(o_rows + groups)
    return s, o


@triton.jit
def _step_product(words, s, o, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, start, x_sum, acc, acc_o,
                  m_lo, m_hi, BITS: tl.constexpr, BLOCK_N: tl.constexpr, CH: tl.constexpr,
                  HAS_OFFSET: tl.constexpr):  # fmt: skip
    """acc [BLOCK_N, CH] += s * P for a step's words (module doc); acc_o += o * X with offsets."""
    NP: tl.constexpr = 16 // BITS
    w0, w1, w2, w3 = split4(words, BLOCK_N, CH)
    part_lo = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
    part_hi = tl.zeros([BLOCK_N, CH], dtype=tl.float32) + start[None, :]
    part_lo, part_hi = _word_product(w0, lo0, hi0, part_lo, part_hi, m_lo, m_hi, BITS, CH, NP)
    part_lo, part_hi = _word_product(w1, lo1, hi1, part_lo, part_hi, m_lo, m_hi, BITS, CH, NP)
    part_lo, part_hi = _word_product(w2, lo2, hi2, part_lo, part_hi, m_lo, m_hi, BITS, CH, NP)
    part_lo, part_hi = _word_product(w3, lo3, hi3, part_lo, part_hi, m_lo, m_hi, BITS, CH, NP)
    if BITS == 4:
        p = part_lo * 16.0 + part_hi
    else:
        p = part_lo + part_hi
    acc += s * p
    if HAS_OFFSET:
        acc_o += o * x_sum[None, :]
    return acc, acc_o


@triton.jit
def _finish(acc, acc_o, cols, row_mask, bias_ptr, out_ptr, BITS: tl.constexpr, HAS_OFFSET: tl.constexpr,
            HAS_BIAS: tl.constexpr):  # fmt: skip
    SCALE: tl.constexpr = 16.0 if BITS == 4 else 256.0  # 2^H
    out = tl.sum(acc, axis=1) * SCALE
    if HAS_OFFSET:
        out += tl.sum(acc_o, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["zero"])
def _vec_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    bias_ptr,
    out_ptr,
    num_cols,
    m_lo,
    m_hi,
    zero,
    hidden: tl.constexpr,
    stride_qn: tl.constexpr,
    stride_sn: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVEN_N: tl.constexpr,  # BLOCK_N divides num_cols: rows unmasked
    K_MASK: tl.constexpr,  # 0: BLOCK_K divides K; 1: the vector (VK) does, masks per vector; 2: per value
    X_PAIRS: tl.constexpr,
    PIN: tl.constexpr,  # a step's loads issued together before its arithmetic (_pin; not with PREFETCH)
    PDL: tl.constexpr,  # kernels/pdl.py
):
    """BLOCK_N rows over the whole of K per program (module doc, form "vec"). Offsets are int32 (the
    launcher checks N * row stride < 2^31)."""
    pdl.begin(PDL)
    PER_WORD: tl.constexpr = 32 // BITS
    VK: tl.constexpr = 4 * PER_WORD
    CH: tl.constexpr = BLOCK_K // VK
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = cols < num_cols
    q_rows = q_ptr + (cols * stride_qn)[:, None, None]
    s_rows = s_ptr + (cols * stride_sn)[:, None]
    o_rows = o_ptr + (cols * stride_sn)[:, None]
    acc = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
    if PREFETCH:
        ahead = _step_words(q_rows, 0, row_mask, hidden, True, BLOCK_N, CH, PER_WORD, not EVEN_N, K_MASK,
                            False)  # fmt: skip
        s_ahead, o_ahead = _step_scales(s_rows, o_rows, 0, row_mask, hidden, BLOCK_N, CH, VK, GROUP,
                                        HAS_OFFSET, not EVEN_N, K_MASK, True, False)  # fmt: skip
    for k0 in range(0, hidden, BLOCK_K):
        if PREFETCH:  # the next step's codes and scales in flight while this step computes
            words, s, o = ahead, s_ahead, o_ahead
            live = k0 + BLOCK_K < hidden
            ahead = _step_words(q_rows, k0 + BLOCK_K, row_mask, hidden, live, BLOCK_N, CH, PER_WORD,
                                not EVEN_N, K_MASK, True)  # fmt: skip
            s_ahead, o_ahead = _step_scales(s_rows, o_rows, k0 + BLOCK_K, row_mask, hidden, BLOCK_N, CH, VK,
                                            GROUP, HAS_OFFSET, not EVEN_N, K_MASK, live, True)  # fmt: skip
        else:
            words = _step_words(q_rows, k0, row_mask, hidden, True, BLOCK_N, CH, PER_WORD, not EVEN_N, K_MASK,
                                False)  # fmt: skip
            s, o = _step_scales(s_rows, o_rows, k0, row_mask, hidden, BLOCK_N, CH, VK, GROUP, HAS_OFFSET,
                                not EVEN_N, K_MASK, True, False)  # fmt: skip
        lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, start, x_sum = _vector_x(
            x_ptr, k0, hidden, BITS, CH, HAS_OFFSET, K_MASK, X_PAIRS
        )
        if PIN and not PREFETCH:
            start += _pin(words, s, zero, BLOCK_N, CH)
        acc, acc_o = _step_product(words, s, o, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, start, x_sum,
                                   acc, acc_o, m_lo, m_hi, BITS, BLOCK_N, CH, HAS_OFFSET)  # fmt: skip
    _finish(acc, acc_o, cols, row_mask, bias_ptr, out_ptr, BITS, HAS_OFFSET, HAS_BIAS)


@triton.jit(do_not_specialize=["zero"])
def _xs_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    bias_ptr,
    out_ptr,
    num_cols,
    m_lo,
    m_hi,
    zero,
    hidden: tl.constexpr,
    stride_qn: tl.constexpr,
    stride_sn: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # covers K: one step
    PREFETCH: tl.constexpr,
    EVEN_N: tl.constexpr,
    K_MASK: tl.constexpr,
    X_PAIRS: tl.constexpr,
    PIN: tl.constexpr,  # as in _vec_kernel (a row group's loads)
    PDL: tl.constexpr,  # kernels/pdl.py
):
    """x-stationary (module doc, form "xs"): x loaded once; row groups pid, pid + P, ... of BLOCK_N."""
    pdl.begin(PDL)
    PER_WORD: tl.constexpr = 32 // BITS
    VK: tl.constexpr = 4 * PER_WORD
    CH: tl.constexpr = BLOCK_K // VK
    lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, start, x_sum = _vector_x(
        x_ptr, 0, hidden, BITS, CH, HAS_OFFSET, K_MASK, X_PAIRS
    )
    rows = tl.arange(0, BLOCK_N)
    step = tl.num_programs(0) * BLOCK_N
    first = tl.program_id(0) * BLOCK_N
    if PREFETCH:
        cols = first + rows
        ahead = _step_words(q_ptr + (cols * stride_qn)[:, None, None], 0, cols < num_cols, hidden, True,
                            BLOCK_N, CH, PER_WORD, not EVEN_N, K_MASK, False)  # fmt: skip
        offs = (cols * stride_sn)[:, None]
        s_ahead, o_ahead = _step_scales(s_ptr + offs, o_ptr + offs, 0, cols < num_cols, hidden, BLOCK_N, CH,
                                        VK, GROUP, HAS_OFFSET, not EVEN_N, K_MASK, True, False)  # fmt: skip
    for row0 in range(first, num_cols, step):
        cols = row0 + rows
        row_mask = cols < num_cols
        acc = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
        acc_o = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
        if PREFETCH:  # the next row group's codes and scales in flight while this one computes
            words, s, o = ahead, s_ahead, o_ahead
            nxt = cols + step
            ahead = _step_words(q_ptr + (nxt * stride_qn)[:, None, None], 0, nxt < num_cols, hidden, True,
                                BLOCK_N, CH, PER_WORD, True, K_MASK, False)  # fmt: skip
            offs = (nxt * stride_sn)[:, None]
            s_ahead, o_ahead = _step_scales(s_ptr + offs, o_ptr + offs, 0, nxt < num_cols, hidden, BLOCK_N,
                                            CH, VK, GROUP, HAS_OFFSET, True, K_MASK, True, False)  # fmt: skip
            group_start = start
        else:
            words = _step_words(q_ptr + (cols * stride_qn)[:, None, None], 0, row_mask, hidden, True,
                                BLOCK_N, CH, PER_WORD, not EVEN_N, K_MASK, False)  # fmt: skip
            s, o = _step_scales(s_ptr + (cols * stride_sn)[:, None], o_ptr + (cols * stride_sn)[:, None], 0,
                                row_mask, hidden, BLOCK_N, CH, VK, GROUP, HAS_OFFSET, not EVEN_N, K_MASK,
                                True, False)  # fmt: skip
            group_start = start + _pin(words, s, zero, BLOCK_N, CH) if PIN else start
        acc, acc_o = _step_product(words, s, o, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, group_start, x_sum,
                                   acc, acc_o, m_lo, m_hi, BITS, BLOCK_N, CH, HAS_OFFSET)  # fmt: skip
        _finish(acc, acc_o, cols, row_mask, bias_ptr, out_ptr, BITS, HAS_OFFSET, HAS_BIAS)


def x_pairs(x: torch.Tensor) -> bool:
    """Whether the GEMVs may read x's bf16 values as int32 pairs (bf16, 4-byte aligned rows, K even)."""
    return (
        x.dtype == torch.bfloat16
        and x.shape[-1] % 2 == 0
        and x.data_ptr() % 4 == 0
        and (x.dim() == 1 or x.stride(0) % 2 == 0)
    )


def xs_programs(tile: GemvTile, num_cols: int, device: torch.device) -> int:
    """Programs of the "xs" form: at most programs_per_sm per SM, as few as keep the row groups per
    program the same (so no program runs one more group than most)."""
    groups = triton.cdiv(num_cols, tile.block_n)
    cap = max(1, tile.programs_per_sm * device_sms(device))
    return triton.cdiv(groups, triton.cdiv(groups, cap))


def k_mask(hidden: int, block_k: int, bits: int) -> int:
    """The kernels' K_MASK: 0 where the step divides K, 1 where a vector does (whole-vector masks keep
    the 16-byte loads), else 2."""
    if hidden % block_k == 0:
        return 0
    return 1 if hidden % vector_values(bits) == 0 else 2


def one_row_output(x, packed, scales, out, kernel: str) -> torch.Tensor:
    """out, or a new [1, N] of x.dtype for a one-row integer GEMV. Raises ValueError where the weights
    are too many for the int32 offsets the one-row kernels index them with (kernel names them)."""
    num_cols = packed.shape[0]
    if out is None:
        out = torch.empty((1, num_cols), dtype=x.dtype, device=x.device)
    if max(num_cols * packed.stride(0), num_cols * scales.stride(0)) >= 2**31:
        raise ValueError(f"{kernel} index the weights with int32 offsets: too many weights")
    return out


def int_gemv(x, packed, scales, offsets, bits, group_size, bias=None, *, tile: GemvTile, out=None):
    """x [1, K] @ dequant(packed, scales, offsets).T (+ bias) -> out [1, N] of x.dtype (allocated when
    None) in the form tile.form; inputs checked by kernels/quant_int.py, layout fitting (fits)."""
    hidden = x.shape[1]
    num_cols = packed.shape[0]
    out = one_row_output(x, packed, scales, out, "the GemvTile forms")
    if num_cols == 0:
        return out
    block_k = gemv_step(tile, hidden, bits)
    form = tile.form if tile.form != "xs" or hidden <= block_k else "vec"
    m_lo, m_hi = MASKS[bits]
    o_arg = offsets if offsets is not None else scales
    args = (x, packed, scales, o_arg, bias if bias is not None else x, out, num_cols, m_lo, m_hi, 0)
    meta = dict(
        hidden=hidden, stride_qn=packed.stride(0), stride_sn=scales.stride(0), BITS=bits, GROUP=group_size,
        HAS_OFFSET=offsets is not None, HAS_BIAS=bias is not None, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        PREFETCH=tile.prefetch, EVEN_N=num_cols % tile.block_n == 0, K_MASK=k_mask(hidden, block_k, bits),
        X_PAIRS=x_pairs(x), PIN=tile.pin, num_warps=tile.num_warps, num_stages=1,
    )  # fmt: skip
    if tile.max_registers:
        meta["maxnreg"] = tile.max_registers
    if form == "xs":
        _xs_kernel[(xs_programs(tile, num_cols, x.device),)](*args, **meta, **pdl.launch(x.device))
    else:
        _vec_kernel[(triton.cdiv(num_cols, tile.block_n),)](*args, **meta, **pdl.launch(x.device))
    return out
