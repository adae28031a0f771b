"""MLA prefill / verify attention: causal attention of each sequence's newest q_len tokens over its
paged latent context, in the absorbed form (mla_attention.py).

The query tokens of sequence b are the last q_len_b positions of its context (q_len_b from
query_start_loc), so one op serves a first prefill, a chunk after cached prefix blocks and the
k + 1 tokens of a verify pass; their latent rows must already be in the cache. A verify pass (one
row tile per sequence) also splits its keys, by decode attention's shape-only rule.
"""

from __future__ import annotations

import torch
import triton

from tpfuse.kernels.mla_attention import check_mla_inputs, mla_attention_launch
from tpfuse.kernels.mla_decode import gather_latent, mla_decode_launch
from tpfuse.kernels.paged_attention_common import choose_num_splits

VERIFY_PROGRAMS_PER_SM = 1


def mla_prefill_ref(q_latent, q_rope, cache, block_tables, seq_lens, query_start_loc, max_query_len, scale):
    """q_latent [T, H, R], q_rope [T, H, P] (all sequences' query tokens, concatenated); cache
    [num_blocks, block_size, R + P]; block_tables [B, max_blocks] int32; seq_lens [B] int32 context
    length including the query tokens; query_start_loc [B + 1] int32. Returns a new [T, H, R] of
    q_latent.dtype (float64 inputs are computed in float64)."""
    del max_query_len
    check_mla_inputs(q_latent, q_rope, cache)
    rank = q_latent.shape[-1]
    acc = torch.float64 if q_latent.dtype == torch.float64 else torch.float32
    out = torch.zeros_like(q_latent)
    for b in range(block_tables.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if end == start:
            continue
        n = int(seq_lens[b])
        kv = gather_latent(cache, block_tables[b], n).to(acc)
        ql, qr = q_latent[start:end].to(acc), q_rope[start:end].to(acc)
        scores = torch.einsum("qhr,nr->hqn", ql, kv[:, :rank]) + torch.einsum("qhp,np->hqn", qr, kv[:, rank:])
        q_pos = torch.arange(n - (end - start), n, device=q_latent.device)
        visible = torch.arange(n, device=q_latent.device)[None, :] <= q_pos[:, None]
        scores = (scores * scale).masked_fill(~visible[None], float("-inf"))
        out[start:end] = torch.einsum("hqn,nr->qhr", scores.softmax(-1), kv[:, :rank]).to(q_latent.dtype)
    return out


def mla_prefill_tile_config(max_query_len: int, heads: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages): row tiles no taller than the longest query's
    (token, head) rows, at most 64 (the latent accumulator is block_m x kv_lora_rank float32)."""
    rows = max(max_query_len, 1) * heads
    block_m = min(max(triton.next_power_of_2(rows), 16), 64)
    return block_m, 32, 4 if block_m <= 32 else 8, 2


def mla_prefill_triton(
    q_latent, q_rope, cache, block_tables, seq_lens, query_start_loc, max_query_len, scale
):
    """Triton mla_prefill_ref (same shapes and dtypes). max_query_len must bound every q_len (it sizes
    the grid); rows of the output past the last sequence's queries are left unwritten."""
    heads = q_latent.shape[1]
    block_m, block_n, num_warps, num_stages = mla_prefill_tile_config(max_query_len, heads)
    num_splits = 1
    if max_query_len * heads <= block_m:
        num_splits = choose_num_splits(
            block_tables.shape[0], 1, block_tables.shape[1], cache.shape[1], q_latent.device,
            programs_per_sm=VERIFY_PROGRAMS_PER_SM,
        )  # fmt: skip
    return mla_attention_launch(
        q_latent, q_rope, cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
        num_splits, block_m, block_n, num_warps, num_stages,
    )  # fmt: skip


def compile_mla_variants(cache: torch.Tensor, rope_dim: int, num_heads: int, max_query_len: int) -> int:
    """Launches the MLA attention kernel once per compiled variant an engine can meet (decode with and
    without key splits, every prefill tile config mla_prefill_tile_config gives, keys split or not),
    on tiny inputs over the real cache's layout, so no step stops to compile one while serving. The
    queries are built as the model builds them (q_latent a head-major product viewed token-major).
    The cache is only read. Returns the number of launches."""
    rope = rope_dim
    rank = cache.shape[-1] - rope
    device, dtype = cache.device, cache.dtype
    configs = {}
    for query_len in range(1, min(max_query_len, 64) + 1):
        configs.setdefault(mla_prefill_tile_config(query_len, num_heads), query_len)
    launches = 0
    for splits in (1, 2):  # decode
        q_lat = torch.zeros(num_heads, 1, rank, dtype=dtype, device=device).transpose(0, 1)
        q_rope = torch.zeros(1, num_heads, rope, dtype=dtype, device=device)
        tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
        lens = torch.ones(1, dtype=torch.int32, device=device)
        mla_decode_launch(q_lat, q_rope, cache, tables, lens, 1.0, splits)
        launches += 1
    for (block_m, block_n, num_warps, num_stages), q_len in configs.items():
        q_lat = torch.zeros(num_heads, q_len, rank, dtype=dtype, device=device).transpose(0, 1)
        q_rope = torch.zeros(q_len, num_heads, rope, dtype=dtype, device=device)
        tables = torch.zeros(1, triton.cdiv(q_len, cache.shape[1]), dtype=torch.int32, device=device)
        lens = torch.full((1,), q_len, dtype=torch.int32, device=device)
        starts = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        for splits in (1, 2) if q_len * num_heads <= block_m else (1,):
            mla_attention_launch(
                q_lat, q_rope, cache, tables, lens, starts, q_len, 1.0, splits, block_m, block_n, num_warps,
                num_stages,
            )  # fmt: skip
            launches += 1
    return launches
