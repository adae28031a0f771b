"""Paged decode attention: one query token per sequence, grouped-query heads, keys from the paged cache."""

from __future__ import annotations

import torch


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hk, D] -> [length, Hk, D] for one sequence."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, Hq, D]; caches: [num_blocks, block_size, Hk, D]; block_tables: [B, max_blocks] int32;
    seq_lens: [B] int32 (keys 0..seq_len-1 are attended, the current token's included).
    Returns a new [B, Hq, D] tensor of q.dtype. Hq must be a multiple of Hk.
    """
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        k = _gather_kv(k_cache, block_tables[b], n).float().repeat_interleave(group, dim=1)
        v = _gather_kv(v_cache, block_tables[b], n).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
