"""Token sampling: greedy, temperature, top-k, top-p, seeded per row.

Each row carries its own seed (the engine derives it from the request's seed and the token index),
so a seeded request gives the same tokens whatever else is in the batch. Sampling is Gumbel-max:
argmax(logits / T + Gumbel noise) over the tokens that survive top-k and top-p.

The Triton version filters top-k/top-p only when some sampled row asks for it: torch.topk when every
row has a small top_k, else one cut value per row found without sorting (sampling_cut.py). Then the
noise + argmax: each row is split over several programs (about 1024 in all, so one row spreads over
the SMs), each taking the best (value, token) of its chunk, and a merge of one program per row takes
the best of those, the lowest token on ties: the token one program streaming the row would pick.
The noise comes from Philox (tl.rand) keyed by the row's seed and the token index, so it does not
depend on the split: deterministic per seed, independent of the other rows, but not the same stream
as the torch reference's generator. z = logits / T is the IEEE float32 division (tl.div_rn), as in
torch and in the cut. Cost at 128k tokens: one read of the row (256 KB bf16) and ~150 ops a token
(Philox, two logs, the division), spread over ~126 programs at 1 row, 16 a row at 64 rows.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from tpfuse.kernels.sampling_cut import row_cuts


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """logits: [B, V] float32, already divided by temperature. Returns a copy with the tokens outside
    each row's top-k (k <= 0: off) and top-p nucleus (p >= 1: off) set to -inf. The top token is kept."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab)[:, None]
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs  # probability mass strictly before each token
    drop |= (before >= top_ps[:, None]) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_ref(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    seeds: torch.Tensor,
    plan: tuple[bool, int] | None = None,
    parts: int | None = None,
) -> torch.Tensor:
    """logits: [B, V] (any float dtype); temperatures: [B] float (0: greedy); top_ks: [B] int;
    top_ps: [B] float; seeds: [B] int64. Returns [B] int64 token ids. plan, parts: the Triton twin's
    filter plan and row split, not needed here (the reference always sorts, one row at a time)."""
    logits = logits.float()
    greedy = logits.argmax(-1)
    temps = temperatures.float().clamp(min=1e-6)[:, None]
    filtered = apply_top_k_top_p(logits / temps, top_ks, top_ps.float())
    out = torch.empty_like(greedy)
    for b in range(logits.shape[0]):
        if float(temperatures[b]) <= 0.0:
            out[b] = greedy[b]
            continue
        gen = torch.Generator(device=logits.device).manual_seed(int(seeds[b]) & 0x7FFF_FFFF_FFFF_FFFF)
        u = torch.rand(logits.shape[-1], generator=gen, device=logits.device).clamp_(1e-20, 1.0)
        out[b] = (filtered[b] - torch.log(-torch.log(u))).argmax()
    return out


@triton.jit
def _chunk_argmax(values_ptr, start, chunk, vocab, temperature, seed, ADD_NOISE: tl.constexpr,
                  BLOCK_V: tl.constexpr, cut, CUT: tl.constexpr):  # fmt: skip
    """(largest value, its index; ties: the lowest index) over tokens [start, start + chunk) of one
    row, (-inf, 0) if all are -inf. With ADD_NOISE, of values / temperature (IEEE division) +
    Gumbel(seed, token index); with CUT, over the tokens whose values / temperature is >= cut
    (sampling_cut.row_cuts)."""
    best_value = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int32)
    temperatures = tl.zeros([BLOCK_V], tl.float32) + temperature
    for chunk_start in range(start, start + chunk, BLOCK_V):
        tokens = chunk_start + tl.arange(0, BLOCK_V)
        values = tl.load(values_ptr + tokens, mask=tokens < vocab, other=float("-inf")).to(tl.float32)
        if ADD_NOISE:
            u = tl.maximum(tl.rand(seed, tokens), 1.0e-20)
            scaled = tl.div_rn(values, temperatures)
            if CUT:
                scaled = tl.where(scaled >= cut, scaled, float("-inf"))
            values = scaled - tl.log(-tl.log(u))
        chunk_best, chunk_index = tl.max(values, axis=0, return_indices=True)  # ties: the lowest index
        chunk_index += chunk_start
        # Strictly greater: an earlier block keeps a tie, as torch.argmax does.
        better = chunk_best > best_value
        best_index = tl.where(better, chunk_index, best_index)
        best_value = tl.where(better, chunk_best, best_value)
    return best_value, best_index


@triton.jit
def _sample_kernel(
    logits_ptr,
    filtered_ptr,
    temperatures_ptr,
    seeds_ptr,
    cuts_ptr,
    part_values_ptr,
    part_tokens_ptr,
    out_ptr,
    vocab,
    stride_logits,
    stride_filtered,
    chunk,
    FILTERED: tl.constexpr,
    CUT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Program (row, part): the row's best (value, token) over its part's chunk of the vocabulary, to
    part_values / part_tokens [B, parts] for _merge_kernel (SPLIT), or the token to out (one part)."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * chunk
    temperature = tl.load(temperatures_ptr + row).to(tl.float32)
    seed = tl.load(seeds_ptr + row)
    logits_row = logits_ptr + row * stride_logits
    if temperature <= 0.0:
        value, token = _chunk_argmax(logits_row, start, chunk, vocab, 1.0, seed, False, BLOCK_V, 0.0, False)
    elif FILTERED:
        # filtered rows are already divided by the temperature
        value, token = _chunk_argmax(
            filtered_ptr + row * stride_filtered, start, chunk, vocab, 1.0, seed, True, BLOCK_V, 0.0, False
        )
    elif CUT:
        cut = tl.load(cuts_ptr + row)
        value, token = _chunk_argmax(
            logits_row, start, chunk, vocab, temperature, seed, True, BLOCK_V, cut, True
        )
    else:
        value, token = _chunk_argmax(
            logits_row, start, chunk, vocab, temperature, seed, True, BLOCK_V, 0.0, False
        )
    if SPLIT:
        slot = row * tl.num_programs(1) + part
        tl.store(part_values_ptr + slot, value)
        tl.store(part_tokens_ptr + slot, token)
    else:
        tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit(do_not_specialize=["parts"])
def _merge_kernel(part_values_ptr, part_tokens_ptr, out_ptr, parts, PARTS: tl.constexpr):
    """out[row]: the token of the row's largest part value; ties: the lowest token (the parts are
    in token order), 0 if every value is -inf; the same token one program over the row would give."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, PARTS)
    values = tl.load(part_values_ptr + row * parts + i, mask=i < parts, other=float("-inf"))
    tokens = tl.load(part_tokens_ptr + row * parts + i, mask=i < parts, other=0)
    best = tl.max(values, axis=0)
    token = tl.min(tl.where(values == best, tokens, 2147483647), axis=0)
    tl.store(out_ptr + row, tl.where(best > float("-inf"), token, 0).to(tl.int64))


SAMPLE_BLOCK = 1024  # tokens a sampling program draws at once
SAMPLE_WARPS = 8
SAMPLE_PROGRAMS = 1024  # programs the sampling launch aims for, whatever the batch
INTERPRETER_BLOCK = 4096  # fewer, larger numpy ops under TRITON_INTERPRET=1; the token is the same


def _sample_split(batch: int, vocab: int, parts: int | None = None) -> tuple[int, int, int]:
    """(programs a row, tokens a program, block): by default about SAMPLE_PROGRAMS programs in all,
    each a whole number of blocks. The token does not depend on the split."""
    block = INTERPRETER_BLOCK if os.environ.get("TRITON_INTERPRET") == "1" else SAMPLE_BLOCK
    block = min(block, triton.next_power_of_2(vocab))
    parts = parts or max(1, min(triton.cdiv(vocab, block), triton.cdiv(SAMPLE_PROGRAMS, batch)))
    chunk = triton.cdiv(triton.cdiv(vocab, parts), block) * block
    return triton.cdiv(vocab, chunk), chunk, block


TOP_K_SELECT_MAX = 1024  # above this a full sort is about as cheap as torch.topk


def filter_plan(temperatures, top_ks, top_ps) -> tuple[bool, int]:
    """(whether any sampled row filters, k bound for top-k selection or 0 for a full sort) of the
    rows' values as the host knows them (sequences of floats and ints; top_p compared as float32,
    as the device holds it), so that a launch need not read them back from the device."""
    t = np.asarray(temperatures, dtype=np.float32)
    k = np.asarray(top_ks, dtype=np.int64)
    p = np.asarray(top_ps, dtype=np.float32)
    sampled = t > 0
    if not sampled.any():
        return False, 0
    any_filter = bool((sampled & ((k > 0) | (p < 1))).any())
    ks = np.where(sampled, k, 1)  # greedy rows never read the filtered logits
    k_min, k_max = int(ks.min()), int(ks.max())
    return any_filter, (k_max if k_min > 0 and k_max <= TOP_K_SELECT_MAX else 0)


def _filter_plan(temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> tuple[bool, int]:
    """filter_plan of device tensors: one host sync (none while capturing: then filter by sorting)."""
    if temperatures.is_cuda and torch.cuda.is_current_stream_capturing():
        return True, 0
    sampled = temperatures > 0
    filters = sampled & ((top_ks > 0) | (top_ps < 1))
    ks = torch.where(sampled, top_ks.long(), 1)  # greedy rows never read the filtered logits
    any_filter, k_min, k_max = torch.stack([filters.any().long(), ks.min(), ks.max()]).tolist()
    return bool(any_filter), (k_max if k_min > 0 and k_max <= TOP_K_SELECT_MAX else 0)


def filter_top_k_top_p(
    scaled: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, k_bound: int
) -> torch.Tensor:
    """apply_top_k_top_p with a shortcut: when every row's 0 < top_k <= k_bound, only the k_bound
    largest logits (torch.topk) are ranked instead of sorting the whole vocabulary. k_bound 0: sort.
    scaled: [B, V] float32, divided by temperature. Returns a new [B, V] tensor."""
    if k_bound <= 0 or k_bound >= scaled.shape[-1]:
        return apply_top_k_top_p(scaled, top_ks, top_ps)
    values, indices = scaled.topk(k_bound, dim=-1)  # sorted, so ranks and the nucleus are unchanged
    kept = apply_top_k_top_p(values, top_ks, top_ps)
    return torch.full_like(scaled, float("-inf")).scatter_(-1, indices, kept)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where its data is not 16-byte aligned (a view into a packed step): Triton
    compiles a kernel apart for each pointer alignment, and the warm-up compiles the aligned one."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def sample_triton(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    seeds: torch.Tensor,
    plan: tuple[bool, int] | None = None,
    parts: int | None = None,
) -> torch.Tensor:
    """Triton sample_ref: same arguments and result ([B] int64). Greedy rows (temperature <= 0) are
    exactly torch.argmax of the logits; sampled rows are deterministic for a given seed and row
    contents, whatever else is in the batch. logits may be any float dtype, last dim contiguous.
    plan: filter_plan of the rows when the caller knows it (else read from the device: a sync).
    parts: programs a row for the noise + argmax (default _sample_split's; the tokens are the same)."""
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    temperatures, top_ks, top_ps, seeds = (_aligned(t) for t in (temperatures, top_ks, top_ps, seeds))
    filtered = logits
    use_filter, k_bound = plan if plan is not None else _filter_plan(temperatures, top_ks, top_ps)
    cut = use_filter and k_bound == 0  # no small top_k everywhere: one cut per row, no sort
    cuts = out
    if cut:
        cuts = row_cuts(logits, temperatures, top_ks, top_ps)
    elif use_filter:
        temps = temperatures.float().clamp(min=1e-6)[:, None]
        filtered = filter_top_k_top_p(logits.float() / temps, top_ks, top_ps.float(), k_bound)
    parts, chunk, block = _sample_split(batch, vocab, parts)
    part_values = torch.empty(batch, parts, dtype=torch.float32, device=logits.device)
    part_tokens = torch.empty(batch, parts, dtype=torch.int32, device=logits.device)
    _sample_kernel[(batch, parts)](
        logits, filtered, temperatures, seeds, cuts, part_values, part_tokens, out, vocab, logits.stride(0),
        filtered.stride(0), chunk, FILTERED=use_filter and not cut, CUT=cut, BLOCK_V=block, SPLIT=parts > 1,
        num_warps=SAMPLE_WARPS,
    )  # fmt: skip
    if parts > 1:  # PARTS bounded by the vocabulary alone: a new batch size compiles nothing
        bound = triton.next_power_of_2(max(parts, _sample_split(1, vocab)[0]))
        _merge_kernel[(batch,)](part_values, part_tokens, out, parts, PARTS=bound, num_warps=1)
    return out


WARM_UP_PLANS = ((False, 0), (True, 0), (True, 8))  # no filter, the cut, top-k selection
WARM_UP_BATCHES = (1, 16)  # rows split into parts not a multiple of 16, and into a multiple of 16


def warm_up_sampling(vocab: int, device: torch.device) -> int:
    """Launches sample_triton on float32 logits (what compute_logits gives) for each filter path
    and for batch sizes whose split arguments Triton specializes differently, so that no request
    stops the engine later to compile the sampler, the cut or the merge. Returns the number of
    calls."""
    calls = 0
    for batch in WARM_UP_BATCHES:
        logits = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
        temperatures = torch.ones(batch, device=device)
        seeds = torch.arange(batch, device=device)
        for use_filter, k_bound in WARM_UP_PLANS:
            top_ks = torch.full((batch,), k_bound, dtype=torch.int64, device=device)
            top_ps = torch.full((batch,), 0.9 if use_filter else 1.0, device=device)
            sample_triton(logits, temperatures, top_ks, top_ps, seeds, (use_filter, k_bound))
            calls += 1
    ones = torch.ones(1, device=device)  # one program a row: the split-free variant (huge batches)
    sample_triton(
        torch.zeros(1, vocab, device=device), ones, ones.long(), ones, ones.long(), (False, 0), parts=1
    )
    return calls + 1
