"""Token sampling: greedy, temperature, top-k, top-p, seeded per row.

Each row carries its own seed (the engine derives it from the request's seed and the token index),
so a seeded request gives the same tokens whatever else is in the batch. Sampling is Gumbel-max:
argmax(logits / T + Gumbel noise) over the tokens that survive top-k and top-p.

The Triton version filters top-k/top-p only when some sampled row asks for it: torch.topk when every
row has a small top_k, else one cut value per row found without sorting (sampling_cut.py); then the
noise + argmax run in one kernel, one program per row streaming the vocabulary. Its noise comes from Philox
(tl.rand) keyed by the row's seed and the token index: deterministic per seed, independent of the
other rows, but not the same stream as the torch reference's generator.
"""

from __future__ import annotations

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
) -> torch.Tensor:
    """logits: [B, V] (any float dtype); temperatures: [B] float (0: greedy); top_ks: [B] int;
    top_ps: [B] float; seeds: [B] int64. Returns [B] int64 token ids. plan: the Triton twin's
    filter plan, not needed here (the reference always sorts)."""
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
def _row_argmax(values_ptr, vocab, temperature, seed, ADD_NOISE: tl.constexpr, BLOCK_V: tl.constexpr,
                cut, CUT: tl.constexpr):  # fmt: skip
    """Index of the largest value of one row (ties: the lowest index); with ADD_NOISE, of
    values / temperature + Gumbel(seed, token index); with CUT, over the tokens whose
    values / temperature is >= cut (sampling_cut.row_cuts)."""
    best_value = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int32)
    for chunk_start in range(0, vocab, BLOCK_V):
        tokens = chunk_start + tl.arange(0, BLOCK_V)
        values = tl.load(values_ptr + tokens, mask=tokens < vocab, other=float("-inf")).to(tl.float32)
        if ADD_NOISE:
            u = tl.maximum(tl.rand(seed, tokens), 1.0e-20)
            scaled = values / temperature
            if CUT:
                scaled = tl.where(scaled >= cut, scaled, float("-inf"))
            values = scaled - tl.log(-tl.log(u))
        chunk_best = tl.max(values, axis=0)
        chunk_index = chunk_start + tl.argmax(values, axis=0)
        # Strictly greater: an earlier chunk keeps a tie, as torch.argmax does.
        better = chunk_best > best_value
        best_index = tl.where(better, chunk_index, best_index)
        best_value = tl.where(better, chunk_best, best_value)
    return best_index


@triton.jit
def _sample_kernel(
    logits_ptr,
    filtered_ptr,
    temperatures_ptr,
    seeds_ptr,
    out_ptr,
    cuts_ptr,
    vocab,
    stride_logits,
    stride_filtered,
    FILTERED: tl.constexpr,
    CUT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperatures_ptr + row).to(tl.float32)
    seed = tl.load(seeds_ptr + row)
    if temperature <= 0.0:
        token = _row_argmax(logits_ptr + row * stride_logits, vocab, 1.0, seed, False, BLOCK_V, 0.0, False)
        tl.store(out_ptr + row, token.to(tl.int64))
    elif FILTERED:
        # filtered rows are already divided by the temperature
        token = _row_argmax(filtered_ptr + row * stride_filtered, vocab, 1.0, seed, True, BLOCK_V, 0.0, False)
        tl.store(out_ptr + row, token.to(tl.int64))
    elif CUT:
        cut = tl.load(cuts_ptr + row)
        token = _row_argmax(
            logits_ptr + row * stride_logits, vocab, temperature, seed, True, BLOCK_V, cut, True
        )
        tl.store(out_ptr + row, token.to(tl.int64))
    else:
        token = _row_argmax(
            logits_ptr + row * stride_logits, vocab, temperature, seed, True, BLOCK_V, 0.0, False
        )
        tl.store(out_ptr + row, token.to(tl.int64))


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


def sample_triton(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    seeds: torch.Tensor,
    plan: tuple[bool, int] | None = None,
) -> torch.Tensor:
    """Triton sample_ref: same arguments and result ([B] int64). Greedy rows (temperature <= 0) are
    exactly torch.argmax of the logits; sampled rows are deterministic for a given seed and row
    contents, whatever else is in the batch. logits may be any float dtype, last dim contiguous.
    plan: filter_plan of the rows when the caller knows it (else read from the device: a sync)."""
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    filtered = logits
    use_filter, k_bound = plan if plan is not None else _filter_plan(temperatures, top_ks, top_ps)
    cut = use_filter and k_bound == 0  # no small top_k everywhere: one cut per row, no sort
    cuts = out
    if cut:
        cuts = row_cuts(logits, temperatures, top_ks, top_ps)
    elif use_filter:
        temps = temperatures.float().clamp(min=1e-6)[:, None]
        filtered = filter_top_k_top_p(logits.float() / temps, top_ks, top_ps.float(), k_bound)
    _sample_kernel[(batch,)](
        logits,
        filtered,
        temperatures,
        seeds,
        out,
        cuts,
        vocab,
        logits.stride(0),
        filtered.stride(0),
        FILTERED=use_filter and not cut,
        CUT=cut,
        BLOCK_V=min(triton.next_power_of_2(vocab), 4096),
        num_warps=8,
    )
    return out
