"""Group-quantized integer linear layer (W4A16, W8A16): out = x @ dequant(packed, scales).T (+ bias).

Weight layout (the kernels' own, which every integer format is converted to at load):
  packed:  [N, ceil(K / (32 / bits))] int32. Word j of row n holds k = j*V .. j*V + V - 1
           (V = 32 / bits values), value i in bits [i*bits, (i+1)*bits), unsigned. This is
           compressed-tensors' pack-quantized order; GPTQ, GGUF Q4_0/Q4_1/Q8_0 are repacked to it.
  scales:  [N, ceil(K / group_size)], any float dtype (the checkpoint's, so nothing is rounded).
  offsets: None (symmetric: w = (q - 2^(bits-1)) * s) or [N, ceil(K / group_size)] float32
           (w = q * s + offset: GPTQ zero points as -z * s, Q4_1's minimum).

One row (decode) runs the GEMV kernel here, laid out for bandwidth as kernels/gemv.py is: each
program takes BLOCK_N weight rows over the whole of K, loads BLOCK_K / V contiguous words per row per
step, and for each of the V values of a word multiplies the value's float pattern 1 + q / 2^bits (two
integer ops, no int-to-float conversion) by the x entries it meets; the scale multiplies once per
word (once per step when the group spans it), and the [BLOCK_N, words] accumulator is reduced once.
A StreamTile runs the streaming GEMV (_int_stream_kernel) instead: lanes take 16-byte chunks of
codes along K and registers the rows, so a chunk lies in one scale group (scaled once per chunk) and
each x value serves BLOCK_N / warps rows; each code becomes the float32 denormal q * 2^(p - 149) by
one mask (STREAM_EXP below: exact for |x| < 2^64, products normal for |q x| >= 2^-41); K steps ahead
are prefetched into L2 (no registers), optionally the next into registers; split-K programs fill
the SMs for 4096-row weights (partials summed in split order by the last to arrive: deterministic,
CUDA-graph safe).
Two or more rows run kernels/quant_dot.py (the dequantized tile on tl.dot); kernels/quant_int_magic.py
is the one-row tensor-core alternative (a MagicTile). Which tile runs each shape is measured at
start-up (model/linear_choice.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels import quant_int_magic
from tpfuse.kernels.decode_merge import arrival_counters
from tpfuse.kernels.gemv import rounded_linear_ref
from tpfuse.kernels.quant_dot import IntTile, code_as_float, launch_tile, quant_dot
from tpfuse.kernels.quant_int_magic import MagicTile
from tpfuse.kernels.skinny_linear import partials_buffer

__all__ = [
    "IntTile", "MagicTile", "StreamTile", "dequantize_int", "int_linear_ref", "int_linear_triton", "pack_int",
    "unpack_int",
]  # fmt: skip

SUPPORTED_BITS = (4, 8)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read once, at import


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
    return rounded_linear_ref(x.float(), weight, bias, x.dtype)


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
):
    """One row: BLOCK_N weight rows x the whole of K per program, [BLOCK_N, words] fp32
    accumulators reduced once after the loop (the layout of kernels/gemv.py)."""
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


# The streaming GEMV's code values are float32 denormals: value i of a word masked in place at bit
# p <= 16 (exponent field 0) is q * 2^(p - 149), exactly. x is scaled by 2^(STREAM_EXP - p), so every
# product is q * x * 2^(STREAM_EXP - 149): normal for |q x| >= 2^(23 - STREAM_EXP), and the scaled x is
# finite for |x| < 2^(128 - STREAM_EXP).
STREAM_EXP = tl.constexpr(64)
HIGH_SHIFT = tl.constexpr(12)  # values in bits 16-31 are masked in word >> 12 (at bits 4-19)


@dataclass(frozen=True)
class StreamTile(IntTile):
    """A launch configuration of _int_stream_kernel (one row): block_n rows a program, block_k columns
    a K step, split_k programs over K. num_stages 2: the next K step is loaded into registers before
    this one's arithmetic (1: each step's loads at its start); l2_ahead: K steps beyond that
    prefetched into L2."""

    block_m: int = 1
    block_n: int = 32
    block_k: int = 1024
    num_stages: int = 1
    l2_ahead: int = 1

    def label(self) -> str:
        split = f" split{self.split_k}" if self.split_k > 1 else ""
        form = f"n{self.block_n} k{self.block_k} s{self.num_stages} l2+{self.l2_ahead} w{self.num_warps}"
        return f"stream {form}{split}"


@triton.jit
def _chunk_groups(k0, chunks, BITS: tl.constexpr, GROUP: tl.constexpr, CW: tl.constexpr,
                  BLOCK_K: tl.constexpr):  # fmt: skip
    """The scale group of each chunk of the K step at k0 (a multiple of BLOCK_K): a scalar plus a
    compile-time part where GROUP and BLOCK_K divide one another."""
    CHUNK_K: tl.constexpr = CW * (32 // BITS)
    if BLOCK_K % GROUP == 0:
        groups = k0 // GROUP + (chunks * CHUNK_K) // GROUP
    elif GROUP % BLOCK_K == 0:
        groups = k0 // GROUP + chunks * 0
    else:
        groups = (k0 + chunks * CHUNK_K) // GROUP
    return groups


@triton.jit
def _stream_step(q_base, s_base, o_base, q_rows, s_rows, k0, k_end, hidden, col_mask, BITS: tl.constexpr,
                 GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK_K: tl.constexpr, CW: tl.constexpr,
                 EVEN: tl.constexpr, WHOLE_CHUNKS: tl.constexpr, AHEAD: tl.constexpr):  # fmt: skip
    """The K step at k0 of the rows at q_base + q_rows / s_base + s_rows ([BLOCK_N, 1] element offsets;
    o_base: the offsets, laid out as the scales): codes [BLOCK_N, CHUNKS, CW] int32 (chunk j: words
    k0 / V + j * CW .. + CW, one 16-byte load a row at CW 4) and scales, offsets [BLOCK_N, CHUNKS]
    float32 (a chunk lies in one group). AHEAD: k0 may be at or past k_end (the split's end), where
    nothing is read (EVEN: values undefined, else 0). WHOLE_CHUNKS: K ends on a chunk (masks per
    chunk keep the 16-byte loads)."""
    PER_WORD: tl.constexpr = 32 // BITS
    chunks = tl.arange(0, BLOCK_K // (CW * PER_WORD))
    chunk_k = k0 + chunks * (CW * PER_WORD)  # the first k of each chunk
    word = k0 // PER_WORD + chunks[:, None] * CW + tl.arange(0, CW)[None, :]
    groups = _chunk_groups(k0, chunks, BITS, GROUP, CW, BLOCK_K)[None, :]
    q_ptrs = (q_base + q_rows)[:, :, None] + word[None, :, :]  # row pointers first: rows stay immediates
    s_ptrs = (s_base + s_rows) + groups
    o_ptrs = (o_base + s_rows) + groups
    if EVEN and AHEAD:  # the step is whole or past k_end
        words = tl.load(q_ptrs, mask=(chunk_k < k_end)[None, :, None], eviction_policy="evict_first")
        s = tl.load(s_ptrs, mask=(chunk_k < k_end)[None, :], eviction_policy="evict_first")
        o = s
        if HAS_OFFSET:
            o = tl.load(o_ptrs, mask=(chunk_k < k_end)[None, :], eviction_policy="evict_first")
    elif EVEN:
        words = tl.load(q_ptrs, eviction_policy="evict_first")
        s = tl.load(s_ptrs, eviction_policy="evict_first")
        o = s
        if HAS_OFFSET:
            o = tl.load(o_ptrs, eviction_policy="evict_first")
    else:
        if WHOLE_CHUNKS:
            in_k = (chunk_k < k_end)[:, None]
        else:
            in_k = (word * PER_WORD < hidden) & (chunk_k < k_end)[:, None]
        g_mask = col_mask[:, None] & (chunk_k < k_end)[None, :]
        words = tl.load(q_ptrs, mask=col_mask[:, None, None] & in_k[None, :, :], other=0,
                        eviction_policy="evict_first")  # fmt: skip
        s = tl.load(s_ptrs, mask=g_mask, other=0.0, eviction_policy="evict_first")
        o = s
        if HAS_OFFSET:
            o = tl.load(o_ptrs, mask=g_mask, other=0.0, eviction_policy="evict_first")
    return words, s.to(tl.float32), o.to(tl.float32)


@triton.jit
def _l2_prefetch(ptrs, mask):
    """prefetch.global.L2 of the line holding each pointer where mask is set (no register written)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _stream_prefetch(q_base, s_base, k0, k_end, num_rows, BITS: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STRIDE_QN: tl.constexpr,
                     STRIDE_SN: tl.constexpr):  # fmt: skip
    """Prefetches the K step at k0 of the program's first num_rows rows into L2: one request per 128-byte
    line of codes and one per row of scales, spread over the threads; nothing at or past k_end."""
    PER_WORD: tl.constexpr = 32 // BITS
    LINES: tl.constexpr = max(1, BLOCK_K // (32 * PER_WORD))
    rows = tl.arange(0, BLOCK_N)
    lines = tl.arange(0, LINES)
    ok = (rows < num_rows)[:, None] & (k0 + lines * (32 * PER_WORD) < k_end)[None, :]
    row64 = rows.to(tl.int64)  # apart from the loads' 32-bit row offsets, so theirs stay immediates
    _l2_prefetch(q_base + (row64 * STRIDE_QN)[:, None] + (k0 // PER_WORD + lines * 32)[None, :], ok)
    _l2_prefetch(s_base + row64 * STRIDE_SN + k0 // GROUP, (rows < num_rows) & (k0 < k_end))


@triton.jit
def _word_column(words, c: tl.constexpr, CW: tl.constexpr):
    """words [R, C, CW] -> [R, C]: word c of each chunk (an in-register split)."""
    if CW == 1:
        column = tl.reshape(words, [words.shape[0], words.shape[1]])
    elif CW == 2:
        even, odd = tl.split(words)
        column = even if c == 0 else odd
    else:
        even, odd = tl.split(tl.reshape(words, [words.shape[0], words.shape[1], 2, 2]))  # c = 2 d + e
        lo, hi = tl.split(even if c % 2 == 0 else odd)
        column = lo if c // 2 == 0 else hi
    return column


@triton.jit
def _code_denormal(w, w_hi, i: tl.constexpr, BITS: tl.constexpr):
    """Value i of each word as the float32 q * 2^(p - 149): p = BITS * i for i < V / 2 (masked in w),
    else BITS * i - HIGH_SHIFT (masked in w_hi = w >> HIGH_SHIFT). One LOP3, exact."""
    if i < 16 // BITS:
        f = (w & (((1 << BITS) - 1) << (BITS * i))).to(tl.float32, bitcast=True)
    else:
        f = (w_hi & (((1 << BITS) - 1) << (BITS * i - 12))).to(tl.float32, bitcast=True)
    return f


@triton.jit
def _x_quads(x_ptr, k0, c: tl.constexpr, hidden, BITS: tl.constexpr, CHUNKS: tl.constexpr, CW: tl.constexpr,
             X_QUADS: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """X_QUADS: the bf16 x of word c of each chunk as int64 quads, a tuple of V / 4 [CHUNKS] (else
    placeholders)."""
    PER_WORD: tl.constexpr = 32 // BITS
    quad = k0 // 4 + (tl.arange(0, CHUNKS) * CW + c) * (PER_WORD // 4)
    x_quads = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    if not X_QUADS:
        quads = (quad, quad)
    elif EVEN:
        if PER_WORD == 4:
            quads = (tl.load(x_quads + quad), quad)
        else:
            quads = (tl.load(x_quads + quad), tl.load(x_quads + quad + 1))
    elif PER_WORD == 4:
        quads = (tl.load(x_quads + quad, mask=quad * 4 < hidden, other=0), quad)
    else:
        quads = (tl.load(x_quads + quad, mask=quad * 4 < hidden, other=0),
                 tl.load(x_quads + quad + 1, mask=quad * 4 + 4 < hidden, other=0))  # fmt: skip
    return quads


@triton.jit
def _x_value(x_ptr, k_word, hidden, i: tl.constexpr, quads, X_QUADS: tl.constexpr, EVEN: tl.constexpr):
    """x[k_word + i] as float32 ([CHUNKS]; k_word: each word's first k), from quads (X_QUADS) or loaded."""
    if X_QUADS:
        quad = quads[i // 4]
        if (i // 2) % 2 == 0:
            pair = quad.to(tl.int32)
        else:
            pair = (quad >> 32).to(tl.int32)
        if i % 2 == 0:
            xi = (pair << 16).to(tl.float32, bitcast=True)
        else:
            xi = (pair & -65536).to(tl.float32, bitcast=True)
    elif EVEN:
        xi = tl.load(x_ptr + k_word + i).to(tl.float32)
    else:
        xi = tl.load(x_ptr + k_word + i, mask=k_word + i < hidden, other=0.0).to(tl.float32)
    return xi


@triton.jit
def _int_stream_kernel(
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
    STRIDE_QN: tl.constexpr,  # row strides of codes and scales (constants: a thread's rows are immediates)
    STRIDE_SN: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CW: tl.constexpr,  # words a thread loads per row and chunk (a chunk lies in one group)
    SPLIT_K: tl.constexpr,
    REG_AHEAD: tl.constexpr,  # the next K step is loaded into registers before this one's arithmetic
    L2_AHEAD: tl.constexpr,  # K steps prefetched into L2 beyond that (0 under the interpreter)
    EVEN: tl.constexpr,  # BLOCK_N divides num_cols and BLOCK_K divides hidden: nothing masked
    WHOLE_CHUNKS: tl.constexpr,  # CW * V divides hidden: K masked per chunk, not per word
    X_QUADS: tl.constexpr,  # x is bf16 read as int64 quads (8-byte aligned, K a multiple of 4)
):
    """One row: BLOCK_N weight rows x k_per_split columns per program (program_id(1): the split).
    Lanes take chunks of CW words along K, registers the rows, so each x value meets BLOCK_N / warps
    rows. A chunk's products are summed, then scaled once: acc += s (sum q x - 2^(BITS-1) sum x)
    (offsets: s sum q x + o sum x), in units of 2^(STREAM_EXP - 149). Splits store fp32 partials; the
    last to arrive sums them in split order and resets its counter to 0."""
    PER_WORD: tl.constexpr = 32 // BITS
    CHUNKS: tl.constexpr = BLOCK_K // (CW * PER_WORD)
    UNIT: tl.constexpr = 2.0 ** (STREAM_EXP - 149)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.program_id(0) * BLOCK_N + rows
    col_mask = cols < num_cols
    num_rows = num_cols - tl.program_id(0) * BLOCK_N  # rows from the program's first that exist
    first = (tl.program_id(0) * BLOCK_N).to(tl.int64)
    q_base = q_ptr + first * STRIDE_QN
    s_base = s_ptr + first * STRIDE_SN
    o_base = o_ptr + first * STRIDE_SN
    q_rows = (rows * STRIDE_QN)[:, None]
    s_rows = (rows * STRIDE_SN)[:, None]
    k_start = tl.multiple_of(tl.program_id(1) * k_per_split, BLOCK_K)  # k_per_split: whole steps
    k_end = tl.minimum(k_start + k_per_split, hidden)
    acc = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)
    for ahead in tl.static_range(1, REG_AHEAD + L2_AHEAD):  # the steps no iteration prefetches
        _stream_prefetch(q_base, s_base, k_start + ahead * BLOCK_K, k_end, num_rows, BITS, GROUP, BLOCK_N,
                         BLOCK_K, STRIDE_QN, STRIDE_SN)  # fmt: skip
    if REG_AHEAD:
        words_next, s_next, o_next = _stream_step(
            q_base, s_base, o_base, q_rows, s_rows, k_start, k_end, hidden, col_mask,
            BITS, GROUP, HAS_OFFSET, BLOCK_K, CW, EVEN, WHOLE_CHUNKS, False,
        )  # fmt: skip
    for k0 in range(k_start, k_end, BLOCK_K):
        if L2_AHEAD > 0:
            _stream_prefetch(q_base, s_base, k0 + (REG_AHEAD + L2_AHEAD) * BLOCK_K, k_end, num_rows,
                             BITS, GROUP, BLOCK_N, BLOCK_K, STRIDE_QN, STRIDE_SN)  # fmt: skip
        if REG_AHEAD:
            words, s, o = words_next, s_next, o_next
            words_next, s_next, o_next = _stream_step(
                q_base, s_base, o_base, q_rows, s_rows, k0 + BLOCK_K, k_end, hidden, col_mask,
                BITS, GROUP, HAS_OFFSET, BLOCK_K, CW, EVEN, WHOLE_CHUNKS, True,
            )  # fmt: skip
            tl.debug_barrier()  # ptxas would otherwise sink these loads to the end of the loop body
        else:
            words, s, o = _stream_step(
                q_base, s_base, o_base, q_rows, s_rows, k0, k_end, hidden, col_mask,
                BITS, GROUP, HAS_OFFSET, BLOCK_K, CW, EVEN, WHOLE_CHUNKS, False,
            )  # fmt: skip
        part = tl.zeros([BLOCK_N, CHUNKS], dtype=tl.float32)
        xsum = tl.zeros([CHUNKS], dtype=tl.float32)
        for c in tl.static_range(CW):
            k_word = k0 + (tl.arange(0, CHUNKS) * CW + c) * PER_WORD
            quads = _x_quads(x_ptr, k0, c, hidden, BITS, CHUNKS, CW, X_QUADS, EVEN)
            w = _word_column(words, c, CW)
            w_hi = w >> HIGH_SHIFT
            for i in tl.static_range(PER_WORD):
                xi = _x_value(x_ptr, k_word, hidden, i, quads, X_QUADS, EVEN)
                xsum += xi
                xs = xi * 2.0 ** (STREAM_EXP - BITS * i + HIGH_SHIFT * (i // (16 // BITS)))
                part += _code_denormal(w, w_hi, i, BITS) * xs[None, :]
        if HAS_OFFSET:
            acc += s * part + o * (xsum * UNIT)[None, :]
        else:
            acc += s * (part - (xsum * (UNIT * (1 << (BITS - 1))))[None, :])
    out = tl.sum(acc, axis=1) * 2.0 ** (149 - STREAM_EXP)
    last = True
    if SPLIT_K > 1:
        tl.store(partials_ptr + tl.program_id(1) * num_cols + cols, out, mask=col_mask)
        tl.debug_barrier()  # every thread's partial stores before the release below
        counter = counter_ptr + tl.program_id(0)
        last = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
        if last:
            tl.debug_barrier()
            out = tl.zeros([BLOCK_N], dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                out += tl.load(partials_ptr + split * num_cols + cols, mask=col_mask, other=0.0,
                               cache_modifier=".cg")  # fmt: skip
            tl.atomic_xchg(counter, 0)
    if last:
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_mask)


def x_pairs(x: torch.Tensor) -> bool:
    """Whether the GEMV may read x's bf16 values as int32 pairs (bf16, 4-byte aligned rows, K even)."""
    return (
        x.dtype == torch.bfloat16
        and x.shape[-1] % 2 == 0
        and x.data_ptr() % 4 == 0
        and (x.dim() == 1 or x.stride(0) % 2 == 0)
    )


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


def x_quads(x: torch.Tensor) -> bool:
    """Whether the streaming GEMV may read x's bf16 values as int64 quads (bf16, 8-byte aligned, K a
    multiple of 4)."""
    return x.dtype == torch.bfloat16 and x.shape[-1] % 4 == 0 and x.data_ptr() % 8 == 0


def stream_chunk_words(bits: int, group_size: int, hidden: int) -> int:
    """Words a thread takes per row and chunk in the streaming GEMV: 4, 2 or 1, the most whose values
    lie in one scale group."""
    per_word = values_per_word(bits)
    return next(cw for cw in (4, 2, 1) if group_size >= hidden or group_size % (cw * per_word) == 0)


def stream_gemv(x, packed, scales, offsets, bits, group_size, bias, tile: StreamTile, out=None):
    """int_linear_triton at one row on _int_stream_kernel (inputs checked by the caller; scales and
    offsets contiguous). Writes out ([1, N] of x.dtype; new where None) and returns it."""
    hidden = x.shape[1]
    num_cols = packed.shape[0]
    if out is None:
        out = torch.empty((1, num_cols), dtype=x.dtype, device=x.device)
    if num_cols == 0:
        return out
    chunk_words = stream_chunk_words(bits, group_size, hidden)
    block_k = max(chunk_words * values_per_word(bits), min(tile.block_k, triton.next_power_of_2(hidden)))
    split_k = max(1, min(tile.split_k, triton.cdiv(hidden, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(hidden, split_k), block_k) * block_k
    split_k = triton.cdiv(hidden, k_per_split)  # no empty split
    grid = (triton.cdiv(num_cols, tile.block_n), split_k)
    partials = counters = out
    if split_k > 1:
        partials = partials_buffer(x.device, split_k * num_cols)
        counters = arrival_counters(x.device, grid[0])
    compiled = x.is_cuda and not _INTERPRETED  # the L2 prefetch is inline PTX
    _int_stream_kernel[grid](
        x, packed, scales, offsets if offsets is not None else scales, bias if bias is not None else x, out,
        partials, counters, num_cols, hidden, k_per_split,
        STRIDE_QN=packed.stride(0), STRIDE_SN=scales.stride(0), BITS=bits, GROUP=group_size,
        HAS_OFFSET=offsets is not None, HAS_BIAS=bias is not None, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        CW=chunk_words, SPLIT_K=split_k,
        REG_AHEAD=tile.num_stages > 1, L2_AHEAD=tile.l2_ahead if compiled else 0,
        EVEN=num_cols % tile.block_n == 0 and hidden % block_k == 0,
        WHOLE_CHUNKS=hidden % (chunk_words * values_per_word(bits)) == 0, X_QUADS=x_quads(x),
        num_warps=tile.num_warps, num_stages=1,
    )  # fmt: skip
    return out


def int_linear_triton(
    x, packed, scales, offsets, bits, group_size, bias=None, *, tile: IntTile | None = None
):
    """Triton int_linear_ref. x: [M, K] bf16/fp16/fp32, contiguous along K; bias [N] or None.
    One row runs the GEMV kernel above (a StreamTile: the streaming GEMV), more rows
    kernels/quant_dot.py; a MagicTile runs kernels/quant_int_magic.py where it fits (else the default
    tile). Returns a new [M, N] of x.dtype. Raises ValueError for shapes that do not fit the layout,
    or a group size that splits a packed word."""
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
    tile = launch_tile(tile, num_rows)
    if isinstance(tile, StreamTile):
        return stream_gemv(x, packed, scales, offsets, bits, group_size, bias, tile)
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
    )  # fmt: skip
    return out
