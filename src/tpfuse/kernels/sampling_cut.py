"""Top-k / top-p without sorting the vocabulary: one cut value per row, by a parallel radix select.

For a row of scaled logits z = logits / temperature (float32, IEEE division), the tokens the sort
rule (sampling.apply_top_k_top_p) keeps are the largest down to a cut: the k-th largest z (top-k),
then among those the z at which the mass exp(z - max z) taken from the top first reaches top_p of
their total (top-p). `row_cuts` finds that z exactly, as the 32-bit order-preserving key of a float32
(u(a) < u(b) exactly when a < b), most significant digit first:

- top-k, 3 passes of 11, 11 and 10 bits: each counts per digit value (tl.histogram) the tokens whose
  key matches the digits found so far; the digit kept is the largest at which the count from the top
  reaches k.
- top-p, 8 passes of 4 bits over the tokens top-k keeps: each sums per digit value exp(z - max z) as
  40-bit fixed point in int64, so sums are exact and independent of order (rounding each exp down to
  2^-40 moves a 128k row's mass by < 2^-23 of the top token's); the digit kept is the largest at
  which the mass from the top reaches ceil(top_p * the mass top-k keeps) (at least one unit, so
  top_p <= 0 keeps the top token).

Ties at the cut are all kept (the sort keeps an arbitrary subset of them). Greedy rows and rows that
filter nothing get -inf. The sampler keeps z >= cut, z computed with the same division (tl.div_rn).

Each pass is one launch of rows x parts programs; a program takes one contiguous chunk of its row and
adds its histogram into the row's with integer atomics. The digit a pass needs from the pass before is
picked at the start of every program of the row (the same pick from the same finished histogram);
part 0 records it for the pass after. No host sync, no float atomics, and a launch sequence fixed by
the shapes alone (one memset, 11 passes, one program a row to finish), so it is deterministic and may
run inside a CUDA graph.

Cost at a 128k vocabulary (bf16, H200; estimated from the sm_90 SASS, not measured): every pass reads
each row once (256 KB; 16 MB at 64 rows, which stays in L2). Per token a top-k pass is ~40
instructions (load, IEEE division, key, shared-memory histogram); a top-p pass ~135 where it sums (16
bins x compare / select / add in int64) and ~40 in blocks of 512 tokens with none to sum. The first
~4 top-p passes (sign, exponent, top mantissa bits) sum almost everywhere, the later ones almost
nowhere. 1 row (126 programs of 1024 tokens): 12 dependent launches of ~3-5 us, ~50 us. 8 rows: ~1 M
tokens x ~800 instructions ~ 30 us of issue plus the launches, ~70 us. 64 rows (16 programs a row):
8.2 M x ~800 ~ 6.6 G instructions ~ 230 us at the full issue rate, ~300 us. The sort takes 121 / 378
/ 1154 us at 1 / 8 / 64 rows.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

TOP_K_BITS = (11, 11, 10)  # digits of the top-k passes, most significant first
TOP_P_BITS = 4
TOP_P_PASSES = 32 // TOP_P_BITS
COUNT_BINS = 1 << max(TOP_K_BITS)  # int32 slots of a top-k pass's histogram
MASS_BINS = 1 << TOP_P_BITS  # int64 slots of a top-p pass's histogram
FIXED_POINT = 2.0**40  # one unit of mass is 2^-40 of the top token's
COUNT_BLOCK = 1024  # tokens a top-k program loads at once
MASS_BLOCK = 512  # tokens a top-p program loads at once (x 16 int64 accumulators)
PASS_WARPS = 8
# The interpreter runs each op on a whole block in numpy, so tests run fast with large blocks. The
# histograms are integer sums, so the cut does not depend on the block sizes.
INTERPRETER_BLOCK = 4096
TARGET_PROGRAMS = 1024  # programs a pass aims for, whatever the batch
# A row's workspace, in int64 words: the top-k histograms (2 int32 slots a word), the top-p
# histograms, then the state: (digits found so far, count above them) after top-k pass i at 2i, the
# top-p target at 6, (digits, mass above them) after top-p pass j at 8 + 2j.
MASS_AT = len(TOP_K_BITS) * COUNT_BINS // 2
STATE_AT = MASS_AT + TOP_P_PASSES * MASS_BINS
K_STATE, NEED, P_STATE = 0, 2 * len(TOP_K_BITS), 2 * len(TOP_K_BITS) + 2
WORKSPACE_WORDS = STATE_AT + P_STATE + 2 * TOP_P_PASSES
K_CUT = K_STATE + 2 * (len(TOP_K_BITS) - 1)  # the key of the top-k cut: the last top-k digits
# The same, as the kernels read them.
_COUNT_BINS = tl.constexpr(COUNT_BINS)
_MASS_BINS = tl.constexpr(MASS_BINS)
_FIXED_POINT = tl.constexpr(FIXED_POINT)
_TOP_P_BITS = tl.constexpr(TOP_P_BITS)
_TOP_P_PASSES = tl.constexpr(TOP_P_PASSES)
_LAST_K_BINS = tl.constexpr(1 << TOP_K_BITS[-1])
_MASS_AT = tl.constexpr(MASS_AT)
_STATE_AT = tl.constexpr(STATE_AT)
_WORKSPACE_WORDS = tl.constexpr(WORKSPACE_WORDS)
_K_STATE = tl.constexpr(K_STATE)
_K_CUT = tl.constexpr(K_CUT)
_NEED = tl.constexpr(NEED)
_P_STATE = tl.constexpr(P_STATE)


@triton.jit
def _value(key):
    """The float32 of a key held in an int64 in [0, 2^32): the inverse of the kernels' key
    u(z) = bits(z) ^ (0xFFFFFFFF if z < 0 else 0x80000000), an order-preserving uint32 (-0.0 as 0.0)."""
    u = key.to(tl.uint32)
    # u ^ 0xFFFFFFFF is ~u, which Triton 3.8's interpreter cannot take of a uint32
    bits = tl.where(u >= 0x80000000, u ^ 0x80000000, u ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rules(temperatures_ptr, top_ks_ptr, top_ps_ptr, row, vocab):
    """(temperature, k, p, top-k on, top-p on) of a row; both off on greedy rows."""
    temperature = tl.load(temperatures_ptr + row).to(tl.float32)
    k = tl.load(top_ks_ptr + row).to(tl.int64)
    p = tl.load(top_ps_ptr + row).to(tl.float32)
    sampled = temperature > 0.0
    return temperature, k, p, sampled & (k > 0) & (k < vocab), sampled & (p < 1.0)


@triton.jit
def _pick(hist_ptr, prefix, above, need, SHIFT: tl.constexpr, BINS: tl.constexpr):
    """One digit from a finished pass: the largest d with above + (amount at digits >= d) >= need;
    returns prefix with d at SHIFT and the amount above d. above < need <= above + all holds."""
    bins = tl.arange(0, BINS)
    amount = tl.load(hist_ptr + bins).to(tl.int64)
    at_or_above = above + tl.cumsum(amount, 0, reverse=True)
    digit = tl.max(tl.where(at_or_above >= need, bins, 0), axis=0)
    above += tl.sum(tl.where(bins > digit, amount, 0), axis=0)
    return prefix | (digit.to(tl.int64) << SHIFT), above


@triton.jit
def _top_k_cut(counts_row, state_row, k):
    """The top-k cut key from the last top-k pass's histogram (state of the pass before)."""
    prefix, above = tl.load(state_row + _K_CUT - 2), tl.load(state_row + _K_CUT - 1)
    prefix, above = _pick(counts_row + 2 * _COUNT_BINS, prefix, above, k, 0, _LAST_K_BINS)
    return prefix


@triton.jit
def _top_k_pass_kernel(
    logits_ptr,
    temperatures_ptr,
    top_ks_ptr,
    top_ps_ptr,
    counts_ptr,
    work_ptr,
    zmax_ptr,
    vocab,
    stride,
    chunk,
    PASS: tl.constexpr,
    SHIFT: tl.constexpr,
    BITS: tl.constexpr,
    BINS: tl.constexpr,
    PREV_BINS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Top-k pass PASS over one chunk of a row: the count per BITS-bit digit at SHIFT of the tokens
    matching the digits above it (pass 0 also records the chunk's max z)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    temperature, k, p, top_k, top_p = _rules(temperatures_ptr, top_ks_ptr, top_ps_ptr, row, vocab)
    counts_row = counts_ptr + row * (2 * _WORKSPACE_WORDS)
    state_row = work_ptr + row * _WORKSPACE_WORDS + _STATE_AT
    active = top_k
    if PASS == 0:
        active = top_k | top_p  # pass 0 also finds the max z that top-p needs
    if active:
        prefix = tl.zeros([], tl.int64)
        if PASS > 0:
            above = tl.zeros([], tl.int64)
            if PASS > 1:
                prefix = tl.load(state_row + _K_STATE + 2 * (PASS - 2))
                above = tl.load(state_row + _K_STATE + 2 * (PASS - 2) + 1)
            prefix, above = _pick(
                counts_row + (PASS - 1) * _COUNT_BINS, prefix, above, k, SHIFT + BITS, PREV_BINS
            )
            if part == 0:
                tl.store(state_row + _K_STATE + 2 * (PASS - 1), prefix)
                tl.store(state_row + _K_STATE + 2 * (PASS - 1) + 1, above)
        high = (prefix >> (SHIFT + BITS)).to(tl.uint32)
        row_ptr = logits_ptr + row * stride
        hist = tl.zeros([BINS], tl.int32)
        z_max = tl.full([], float("-inf"), tl.float32)
        counted = tl.where(top_k, vocab, 0)  # pass 0 of a top-p-only row counts nothing
        temperatures = tl.zeros([BLOCK], tl.float32) + temperature
        for start in range(0, chunk, BLOCK):
            tokens = part * chunk + start + tl.arange(0, BLOCK)
            valid = tokens < vocab
            x = tl.load(row_ptr + tokens, mask=valid, other=float("-inf")).to(tl.float32)
            z = tl.div_rn(x, temperatures)
            if PASS == 0:
                z_max = tl.maximum(z_max, tl.max(tl.where(valid, z, float("-inf")), axis=0))
            bits = tl.where(z == 0.0, 0.0, z).to(tl.uint32, bitcast=True)
            key = bits ^ ((bits.to(tl.int32, bitcast=True) >> 31).to(tl.uint32, bitcast=True) | 0x80000000)
            match = tokens < counted
            if PASS > 0:
                match &= (key >> (SHIFT + BITS)) == high
            digit = ((key >> SHIFT) & (BINS - 1)).to(tl.int32)
            hist += tl.histogram(digit, BINS, mask=match)
        bins = tl.arange(0, BINS)
        tl.atomic_add(counts_row + PASS * _COUNT_BINS + bins, hist, mask=hist > 0, sem="relaxed")
        if PASS == 0:
            tl.store(zmax_ptr + row * (tl.num_programs(1) + 1) + part, z_max)


@triton.jit
def _top_p_state(mass_row, state_row, p, part, PASS: tl.constexpr):
    """(digits found so far, mass above them, need) before top-p pass PASS; part 0 records what the
    passes after it read. need = ceil(p * the mass top-k keeps), at least 1."""
    prefix = tl.zeros([], tl.int64)
    above = tl.zeros([], tl.int64)
    need = tl.zeros([], tl.int64)
    if PASS == 1:
        kept = tl.sum(tl.load(mass_row + tl.arange(0, _MASS_BINS)), axis=0)
        target = p.to(tl.float64) * kept.to(tl.float64)
        need = target.to(tl.int64)
        need += (need.to(tl.float64) < target).to(tl.int64)
        need = tl.maximum(need, 1)
        if part == 0:
            tl.store(state_row + _NEED, need)
    if PASS > 1:
        need = tl.load(state_row + _NEED)
        prefix = tl.load(state_row + _P_STATE + 2 * (PASS - 2))
        above = tl.load(state_row + _P_STATE + 2 * (PASS - 2) + 1)
    if PASS > 0:
        prefix, above = _pick(
            mass_row + (PASS - 1) * _MASS_BINS, prefix, above, need, 32 - PASS * _TOP_P_BITS, _MASS_BINS
        )
        if part == 0:
            tl.store(state_row + _P_STATE + 2 * (PASS - 1), prefix)
            tl.store(state_row + _P_STATE + 2 * (PASS - 1) + 1, above)
    return prefix, above, need


@triton.jit
def _top_p_pass_kernel(
    logits_ptr,
    temperatures_ptr,
    top_ks_ptr,
    top_ps_ptr,
    counts_ptr,
    work_ptr,
    zmax_ptr,
    vocab,
    stride,
    chunk,
    PASS: tl.constexpr,
    PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Top-p pass PASS over one chunk of a row: the fixed-point mass exp(z - max z) per 4-bit digit
    of the tokens top-k keeps whose keys match the digits above it. Pass 0 also records the top-k cut
    of every top-k row."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    temperature, k, p, top_k, top_p = _rules(temperatures_ptr, top_ks_ptr, top_ps_ptr, row, vocab)
    counts_row = counts_ptr + row * (2 * _WORKSPACE_WORDS)
    mass_row = work_ptr + row * _WORKSPACE_WORDS + _MASS_AT
    state_row = work_ptr + row * _WORKSPACE_WORDS + _STATE_AT
    kcut = tl.zeros([], tl.int64)  # the top-k cut's key; 0 keeps every token
    if top_k:
        if PASS == 0:
            kcut = _top_k_cut(counts_row, state_row, k)
            if part == 0:
                tl.store(state_row + _K_CUT, kcut)
        else:
            kcut = tl.load(state_row + _K_CUT)
    if top_p:
        zmax_row = zmax_ptr + row * (parts + 1)  # the parts' maxima, then the row's
        if PASS == 0:
            i = tl.arange(0, PARTS)
            z_max = tl.max(tl.load(zmax_row + i, mask=i < parts, other=float("-inf")), axis=0)
            if part == 0:
                tl.store(zmax_row + parts, z_max)
        else:
            z_max = tl.load(zmax_row + parts)
        if (z_max > float("-inf")) & (z_max < float("inf")):  # else the row keeps its top-k cut
            prefix, above, need = _top_p_state(mass_row, state_row, p, part, PASS)
            shift: tl.constexpr = 32 - (PASS + 1) * _TOP_P_BITS
            low = kcut.to(tl.uint32)
            high = (prefix >> (shift + _TOP_P_BITS)).to(tl.uint32)
            row_ptr = logits_ptr + row * stride
            bins = tl.arange(0, _MASS_BINS)
            acc = tl.zeros([_MASS_BINS, BLOCK], tl.int64)  # bins x tokens: a thread holds its tokens' 16 bins
            temperatures = tl.zeros([BLOCK], tl.float32) + temperature
            for start in range(0, chunk, BLOCK):
                tokens = part * chunk + start + tl.arange(0, BLOCK)
                valid = tokens < vocab
                x = tl.load(row_ptr + tokens, mask=valid, other=float("-inf")).to(tl.float32)
                z = tl.div_rn(x, temperatures)
                bits = tl.where(z == 0.0, 0.0, z).to(tl.uint32, bitcast=True)
                key = bits ^ (
                    (bits.to(tl.int32, bitcast=True) >> 31).to(tl.uint32, bitcast=True) | 0x80000000
                )
                match = valid & (key >= low)
                if PASS > 0:
                    match &= (key >> (shift + _TOP_P_BITS)) == high
                if tl.max(match.to(tl.int32), axis=0) > 0:  # most blocks have none past the exponent bits
                    mass = (tl.exp(z - z_max) * _FIXED_POINT).to(tl.int64)
                    digit = ((key >> shift) & (_MASS_BINS - 1)).to(tl.int32)
                    hit = (digit[None, :] == bins[:, None]) & match[None, :]
                    acc += tl.where(hit, mass[None, :], 0)
            hist = tl.sum(acc, axis=1)
            tl.atomic_add(mass_row + PASS * _MASS_BINS + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit(do_not_specialize=["parts"])
def _finish_kernel(
    temperatures_ptr,
    top_ks_ptr,
    top_ps_ptr,
    counts_ptr,
    work_ptr,
    zmax_ptr,
    cuts_ptr,
    vocab,
    parts,
):
    """The cut of each row from the last pass it ran: top-p, else top-k, else -inf."""
    row = tl.program_id(0).to(tl.int64)
    temperature, k, p, top_k, top_p = _rules(temperatures_ptr, top_ks_ptr, top_ps_ptr, row, vocab)
    mass_row = work_ptr + row * _WORKSPACE_WORDS + _MASS_AT
    state_row = work_ptr + row * _WORKSPACE_WORDS + _STATE_AT
    cut = tl.full([], float("-inf"), tl.float32)
    if top_k:
        cut = _value(tl.load(state_row + _K_CUT))
    if top_p:
        z_max = tl.load(zmax_ptr + row * (parts + 1) + parts)
        if (z_max > float("-inf")) & (z_max < float("inf")):
            last: tl.constexpr = _TOP_P_PASSES - 1
            prefix, above = _pick(
                mass_row + last * _MASS_BINS,
                tl.load(state_row + _P_STATE + 2 * (last - 1)),
                tl.load(state_row + _P_STATE + 2 * (last - 1) + 1),
                tl.load(state_row + _NEED),
                0,
                _MASS_BINS,
            )
            cut = _value(prefix)
    tl.store(cuts_ptr + row, cut)


def _blocks() -> tuple[int, int]:
    """(top-k, top-p) tokens a program loads at once."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return INTERPRETER_BLOCK, INTERPRETER_BLOCK
    return COUNT_BLOCK, MASS_BLOCK


def parts_per_row(batch: int, vocab: int) -> int:
    """Programs a pass gives each row: about TARGET_PROGRAMS in all, each at least one top-k block."""
    return max(1, min(triton.cdiv(vocab, _blocks()[0]), triton.cdiv(TARGET_PROGRAMS, batch)))


def row_cuts(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    parts: int | None = None,
) -> torch.Tensor:
    """[B] float32: per row, the smallest z = logits / temperature (IEEE float32 division) that top-k
    (k <= 0 or >= V: off) and then top-p (p >= 1: off) keep, ties at it all kept; -inf for greedy rows
    and rows that filter nothing. logits [B, V] any float dtype without NaN, last dim contiguous;
    temperatures, top_ps [B] float; top_ks [B] int. parts: programs per row (default parts_per_row;
    fewer if the row has fewer blocks). Deterministic, and no host sync."""
    batch, vocab = logits.shape
    cuts = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return cuts
    count_block, mass_block = _blocks()
    parts = parts or parts_per_row(batch, vocab)
    chunk = triton.cdiv(triton.cdiv(vocab, parts), count_block) * count_block
    parts = triton.cdiv(vocab, chunk)
    work = torch.zeros(batch, WORKSPACE_WORDS, dtype=torch.int64, device=logits.device)
    counts = work.view(torch.int32)  # the top-k histograms at the start of each row
    zmax = torch.empty(batch, parts + 1, dtype=torch.float32, device=logits.device)  # parts' maxima, row's
    rules = (temperatures, top_ks, top_ps, counts, work, zmax)
    # The passes' PARTS bound comes from the vocabulary alone, so a new batch size compiles nothing.
    parts_bound = max(parts, parts_per_row(1, vocab))
    for kernel, constexprs in pass_launches(parts_bound, count_block, mass_block):
        kernel[(batch, parts)](
            logits, *rules, vocab, logits.stride(0), chunk, **constexprs, num_warps=PASS_WARPS
        )
    _finish_kernel[(batch,)](*rules, cuts, vocab, parts, num_warps=1)
    return cuts


def pass_launches(parts_bound: int, count_block: int = COUNT_BLOCK, mass_block: int = MASS_BLOCK):
    """(kernel, constexprs) of the 11 passes in launch order, for rows split in at most `parts_bound`
    programs."""
    launches, shift = [], 32
    for i, bits in enumerate(TOP_K_BITS):
        shift -= bits
        previous = 1 << TOP_K_BITS[i - 1] if i else 1
        constexprs = dict(
            PASS=i, SHIFT=shift, BITS=bits, BINS=1 << bits, PREV_BINS=previous, BLOCK=count_block
        )
        launches.append((_top_k_pass_kernel, constexprs))
    for i in range(TOP_P_PASSES):
        launches.append(
            (_top_p_pass_kernel, dict(PASS=i, PARTS=triton.next_power_of_2(parts_bound), BLOCK=mass_block))
        )
    return launches
