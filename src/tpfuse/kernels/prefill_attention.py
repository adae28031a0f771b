"""Prefill attention: variable-length causal attention whose keys come from the paged cache.

The query tokens of sequence b are the last q_len_b positions of its context (q_len_b from
query_start_loc), so the same op serves a first prefill, a chunk of a chunked prefill after cached
prefix blocks, and the k+1 tokens of a speculative verify pass. K/V of the query tokens must already
be in the cache (store_kv runs first).
"""

from __future__ import annotations

import torch

from tpfuse.kernels.decode_attention import _gather_kv


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D] (all sequences' query tokens, concatenated); caches: [num_blocks, block_size, Hk, D];
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 context length including the query tokens;
    query_start_loc: [B + 1] int32. Returns a new [T, Hq, D] tensor of q.dtype.
    """
    del max_query_len
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for b in range(block_tables.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if end == start:
            continue
        n = int(seq_lens[b])
        k = _gather_kv(k_cache, block_tables[b], n).float().repeat_interleave(group, dim=1)
        v = _gather_kv(v_cache, block_tables[b], n).float().repeat_interleave(group, dim=1)
        qb = q[start:end].float()
        q_pos = torch.arange(n - (end - start), n)
        mask = torch.arange(n)[None, :] <= q_pos[:, None]  # [q_len, n]
        scores = torch.einsum("qhd,nhd->hqn", qb, k) * scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        out[start:end] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
