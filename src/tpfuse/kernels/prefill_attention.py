"""Prefill attention: variable-length causal attention whose keys come from the paged cache.

The query tokens of sequence b are the last q_len_b positions of its context (q_len_b from
query_start_loc), so the same op serves a first prefill, a chunk of a chunked prefill after cached
prefix blocks, and the k+1 tokens of a speculative verify pass. K/V of the query tokens must already
be in the cache (store_kv runs first).

Tree attention (speculative tree verify, EAGLE tree drafting): an optional `tree_mask` [T] int64 narrows
the causal rule per query token. Bit d of tree_mask[i] says whether query i (at cache position P_i)
sees the key at position P_i - d, for d in 0..63; keys 64 or more positions back follow the causal
rule alone. So -1 (every bit) is plain causal, and a tree node sees its ancestors and the context.

The Triton version is a flash-attention forward: one program per (query tile, KV head, sequence),
keys and values gathered from the paged cache through the block table, online softmax in float32.
A tile's rows are (query token, query head) pairs of the KV head's group, token-major: row r is token
r // GROUP, head r % GROUP. So the group's query heads share every key and value tile they load (a KV
head is read once, not once per query head), and a verify pass of k + 1 tokens fills (k + 1) * GROUP
rows instead of padding k + 1 rows to a 16-row tile per head. When one tile holds a sequence's
whole query (a verify pass), its keys are also split over several programs, as decode attention
splits them (same shape-only rule), and a second launch merges the partials: at batch 1 one program
per KV head would otherwise walk the whole context alone. The grid depends only on max_query_len and
the shapes; tiles past a sequence's q_len exit at once.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from tpfuse.kernels.decode_merge import launch_merge
from tpfuse.kernels.paged_attention_common import (
    _gather_kv,
    _load_kv_tile,
    attention_output,
    check_paged_attention_args,
    choose_num_splits,
    split_key_range,
    split_partials,
)


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    tree_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] (all sequences' query tokens, concatenated); caches: [num_blocks, block_size, Hk, D];
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 context length including the query tokens;
    query_start_loc: [B + 1] int32; tree_mask: None (causal) or [T] int64 relative visibility bits
    (module docstring). Returns [T, Hq, D] of q.dtype: out when given (any [T, Hq, D] view with unit
    last stride), else a new tensor.
    """
    del max_query_len
    out = attention_output(q, out)
    group = q.shape[1] // k_cache.shape[2]
    for b in range(block_tables.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        if end == start:
            continue
        n = int(seq_lens[b])
        k = _gather_kv(k_cache, block_tables[b], n).float().repeat_interleave(group, dim=1)
        v = _gather_kv(v_cache, block_tables[b], n).float().repeat_interleave(group, dim=1)
        qb = q[start:end].float()
        q_pos = torch.arange(n - (end - start), n, device=q.device)
        distance = q_pos[:, None] - torch.arange(n, device=q.device)[None, :]  # [q_len, n]
        mask = distance >= 0
        if tree_mask is not None:
            bits = tree_mask[start:end, None].to(torch.int64) >> distance.clamp(0, 63)
            mask &= (distance >= 64) | (bits & 1).bool()
        scores = torch.einsum("qhd,nhd->hqn", qb, k) * scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        out[start:end] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


# The split count and the block-table width vary from launch to launch in eager steps (a catch-up's
# batch and contexts): as runtime values, not specialised, they do not compile a new variant each
# (on the H200 a speculative step's first catch-up at a new shape stalled 0.6-0.7 s, most likely
# such a compile).
@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2e,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    tree_mask_ptr,
    num_splits,
    HAS_TREE_MASK: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
):
    tile = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    kv_head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + b).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + b + 1).to(tl.int64) - q_start
    if tile * BLOCK_M >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # (token, head in group) pairs, token-major
    tokens_q = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = tokens_q < q_len
    positions = seq_len - q_len + tokens_q  # position of each row's query token in its context
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q_offsets = (q_start + tokens_q)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0)
    block_table_row = block_tables_ptr + b * stride_bt
    if HAS_TREE_MASK:
        tree_bits = tl.load(tree_mask_ptr + q_start + tokens_q, mask=row_mask, other=-1).to(tl.int64)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Causal: the tile's last query token sees keys up to its own position.
    last_token = tl.minimum((tile + 1) * BLOCK_M - 1, q_len * GROUP - 1) // GROUP
    kv_end = seq_len - q_len + last_token + 1
    start, end = split_key_range(kv_end, split, num_splits, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        k = _load_kv_tile(
            k_cache_ptr, block_table_row, tokens, token_mask, kv_head, dims, dim_mask,
            stride_kb, stride_ks, stride_kh, BLOCK_SIZE,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2e
        distance = positions[:, None] - tokens[None, :]
        visible = token_mask[None, :] & (distance >= 0)
        if HAS_TREE_MASK:
            shifted = tree_bits[:, None] >> tl.minimum(tl.maximum(distance, 0), 63)
            visible = visible & ((distance >= 64) | ((shifted & 1) != 0))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_kv_tile(
            v_cache_ptr, block_table_row, tokens, token_mask, kv_head, dims, dim_mask,
            stride_vb, stride_vs, stride_vh, BLOCK_SIZE,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if not SPLIT_KEYS:  # num_splits == 1
        out_offsets = (q_start + tokens_q)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # partials as decode_merge.py reads them: out [T, Hq, num_splits, HEAD_DIM] normalised within
        # the split, lse [T, Hq, num_splits] in the log2 domain (-inf: no keys in this split)
        part_row = ((q_start + tokens_q) * GROUP * tl.num_programs(1) + heads) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], out, mask=io_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_mask)


# A verify tile carries (k + 1) x group query rows, four times a decode program's work at k = 3, so
# keys are split only until the programs fill the SMs once (H200: 16 splits at batch 1 vs 29 us
# unsplit; at batch 32 two splits and the merge took 34 us against 24 us unsplit).
VERIFY_PROGRAMS_PER_SM = 1


def prefill_tile_config(max_query_len: int, head_dim: int, group: int = 1) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) from launch bounds only: query tiles no taller than
    the longest query's rows (max_query_len * group: a verify of a few tokens does not pay for 128
    rows), 128 rows for long ones."""
    rows = max(max_query_len, 1) * group
    block_m = min(max(triton.next_power_of_2(rows), 16), 128 if head_dim <= 128 else 64)
    if block_m == 128:
        return 128, 64, 8, 3
    return block_m, 64, 4, 2


def prefill_attention_launch(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
    block_m=64, block_n=64, num_warps=4, num_stages=2, tree_mask=None, num_splits=1, out=None,
):  # fmt: skip
    """prefill_attention_triton with explicit tile sizes and key splits (tests, benchmarks). With
    num_splits > 1 each query tile's keys are divided among num_splits programs whose partials a
    second launch merges (decode_merge.launch_merge, one row per query token)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_paged_attention_args(q, k_cache, v_cache, "prefill attention")
    out = attention_output(q, out)
    batch = block_tables.shape[0]
    if num_tokens == 0 or batch == 0 or max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    part_out, part_lse = split_partials(out, num_splits)
    block_d = max(triton.next_power_of_2(head_dim), 16)
    grid = (triton.cdiv(max_query_len * group, block_m) * num_splits, num_kv_heads, batch)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, part_out, part_lse,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        tree_mask if tree_mask is not None else seq_lens, num_splits, HAS_TREE_MASK=tree_mask is not None,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLIT_KEYS=num_splits > 1,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        launch_merge(part_out, part_lse, out, num_splits, block_d)
    return out


def prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    tree_mask: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton prefill_attention_ref (same shapes and dtypes, same optional tree_mask and out). max_query_len
    must bound every q_len (it sizes the grid); rows of q past the last sequence's queries are left unwritten.

    Raises ValueError when Hq is not a multiple of Hk, block_size is not a power of two, or a
    head_dim is strided."""
    group = q.shape[1] // max(k_cache.shape[2], 1)
    block_m, block_n, num_warps, num_stages = prefill_tile_config(max_query_len, q.shape[-1], group)
    num_splits = 1
    if max_query_len * group <= block_m:  # one query tile per sequence (a verify): split the keys
        num_splits = choose_num_splits(
            block_tables.shape[0],
            k_cache.shape[2],
            block_tables.shape[1],
            k_cache.shape[1],
            q.device,
            programs_per_sm=VERIFY_PROGRAMS_PER_SM,
        )
    return prefill_attention_launch(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
        block_m, block_n, num_warps, num_stages, tree_mask, num_splits, out=out,
    )  # fmt: skip


def compile_prefill_variants(
    k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int, max_query_len: int, tree: bool
) -> int:
    """Launches the prefill kernel once per compiled variant an engine can meet (query tile size x
    keys split or not x tree mask if tree), on a tiny input over the real caches' layout, so no
    prefill, verify or drafter catch-up later stops to compile one (on the H200 the first catch-up at
    a new shape stalled a speculative step for 0.6-0.7 s, most likely a compile). The caches are only
    read. Returns the number of launches."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    group = num_q_heads // num_kv_heads
    device, dtype = k_cache.device, k_cache.dtype
    configs = {}  # every tile config prefill_tile_config gives (past 128 rows it gives one), once
    for query_len in range(1, min(max_query_len, 128) + 1):
        configs.setdefault(prefill_tile_config(query_len, head_dim, group), query_len)
    launches = 0
    for (block_m, block_n, num_warps, num_stages), q_len in configs.items():
        # q as the model makes it: a view of a fused qkv projection output
        qkv = torch.zeros(q_len, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
        q = qkv[:, : num_q_heads * head_dim].view(q_len, num_q_heads, head_dim)
        tables = torch.zeros(1, triton.cdiv(q_len, k_cache.shape[1]), dtype=torch.int32, device=device)
        lens = torch.full((1,), q_len, dtype=torch.int32, device=device)
        starts = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        masks = [None, torch.ones(q_len, dtype=torch.int64, device=device)] if tree else [None]
        for tree_mask, num_splits in itertools.product(masks, (1, 2)):
            if num_splits > 1 and q_len * group > block_m:
                continue  # several query tiles: keys are never split
            prefill_attention_launch(
                q, k_cache, v_cache, tables, lens, starts, q_len, 1.0,
                block_m, block_n, num_warps, num_stages, tree_mask, num_splits,
            )  # fmt: skip
            launches += 1
    return launches
