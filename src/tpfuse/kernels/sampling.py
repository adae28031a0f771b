"""Token sampling: greedy, temperature, top-k, top-p, seeded per row.

Each row carries its own seed (the engine derives it from the request's seed and the token index),
so a seeded request gives the same tokens whatever else is in the batch. Sampling is Gumbel-max:
argmax(logits / T + Gumbel noise) over the tokens that survive top-k and top-p.
"""

from __future__ import annotations

import torch


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
) -> torch.Tensor:
    """logits: [B, V] (any float dtype); temperatures: [B] float (0: greedy); top_ks: [B] int;
    top_ps: [B] float; seeds: [B] int64. Returns [B] int64 token ids."""
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
