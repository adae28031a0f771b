"""Multi-head latent attention (MLA) over a paged latent cache, in the absorbed form: the Triton kernel.

DeepSeek-V3's attention caches one "head" per token: the normalised KV latent c (kv_lora_rank = R
values) and the rotated shared rope key k_pe (rope_dim = P values), as one row [R + P] of
cache [num_blocks, block_size, R + P]. With the key up-projection absorbed into the query
(q_latent = q_nope @ W_UK, per head) every head's score is q_latent . c + q_rope . k_pe, and its
output o_latent = sum softmax * c stays in the latent space (the caller applies W_UV). So all H
query heads share one key/value stream: a program's rows are (query token, head) pairs, token-major
(row r: token r // H, head r % H), and every key tile it loads serves all of them.

Grid: (row tiles x num_splits, batch). The query tokens of sequence b are the last q_len_b positions
of its context (causal), so one kernel serves decode (q_len 1), verify (k + 1) and prefill chunks.
num_splits divides each row tile's keys among programs (split-K) whose partials decode_merge.py
merges in split order (deterministic). num_splits and the block-table stride are runtime values, so
a new split count or table width does not compile a new variant, and nothing reads the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.decode_merge import launch_merge
from tpfuse.kernels.paged_attention_common import split_key_range, split_partials


@triton.jit
def _load_latent_tile(
    cache_ptr, block_table_row, keys, key_mask, lat, lat_mask, rot, rot_mask, stride_cb, stride_cs,
    RANK: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """(latent c [BLOCK_N, BLOCK_R], rotary k_pe [BLOCK_N, BLOCK_P]) of the paged cache rows of keys
    (through block_table_row); masked-off keys read zeros."""
    pages = tl.load(block_table_row + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    key_rows = cache_ptr + pages * stride_cb + (keys % BLOCK_SIZE) * stride_cs
    c = tl.load(key_rows[:, None] + lat[None, :], mask=key_mask[:, None] & lat_mask[None, :], other=0.0)
    k_pe = tl.load(
        key_rows[:, None] + RANK + rot[None, :], mask=key_mask[:, None] & rot_mask[None, :], other=0.0
    )
    return c, k_pe


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _mla_kernel(
    q_lat_ptr, q_rope_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, scale_log2e,
    stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_bt, num_splits,
    HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_KEYS: tl.constexpr, IS_DECODE: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    b = tl.program_id(1).to(tl.int64)
    if IS_DECODE:  # one query token per sequence: query_start_loc is not read
        q_start = b
        q_len = b * 0 + 1
    else:
        q_start = tl.load(query_start_loc_ptr + b).to(tl.int64)
        q_len = tl.load(query_start_loc_ptr + b + 1).to(tl.int64) - q_start
    if tile * BLOCK_M >= q_len * HEADS:
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens_q = rows // HEADS
    heads = rows % HEADS
    row_mask = tokens_q < q_len
    positions = seq_len - q_len + tokens_q
    lat = tl.arange(0, BLOCK_R)
    rot = tl.arange(0, BLOCK_P)
    lat_mask = lat < RANK
    rot_mask = rot < ROPE
    t_glob = q_start + tokens_q
    q_lat = tl.load(
        q_lat_ptr + t_glob[:, None] * stride_qlt + heads[:, None] * stride_qlh + lat[None, :],
        mask=row_mask[:, None] & lat_mask[None, :], other=0.0,
    )  # fmt: skip
    q_rope = tl.load(
        q_rope_ptr + t_glob[:, None] * stride_qrt + heads[:, None] * stride_qrh + rot[None, :],
        mask=row_mask[:, None] & rot_mask[None, :], other=0.0,
    )  # fmt: skip
    block_table_row = block_tables_ptr + b * stride_bt

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    last_token = tl.minimum((tile + 1) * BLOCK_M - 1, q_len * HEADS - 1) // HEADS
    kv_end = seq_len - q_len + last_token + 1
    start, end = split_key_range(kv_end, split, num_splits, BLOCK_N)
    for tile_start in range(start, end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_mask = keys < end
        c, k_pe = _load_latent_tile(
            cache_ptr, block_table_row, keys, key_mask, lat, lat_mask, rot, rot_mask, stride_cb, stride_cs,
            RANK, BLOCK_SIZE,
        )  # fmt: skip
        s = tl.dot(q_lat, tl.trans(c.to(q_lat.dtype)), input_precision=DOT_PRECISION)
        s += tl.dot(q_rope, tl.trans(k_pe.to(q_rope.dtype)), input_precision=DOT_PRECISION)
        s *= scale_log2e
        visible = key_mask[None, :] & (keys[None, :] <= positions[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(q_lat.dtype), c.to(q_lat.dtype), input_precision=DOT_PRECISION
        )
        m_i = m_new
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    io_mask = row_mask[:, None] & lat_mask[None, :]
    if not SPLIT_KEYS:
        offsets = t_glob[:, None] * stride_ot + heads[:, None] * stride_oh + lat[None, :]
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # partials as decode_merge.py reads them: out [T, H, num_splits, RANK] normalised within the
        # split, lse [T, H, num_splits] in the log2 domain (-inf: no keys in this split)
        part_row = (t_glob * HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * RANK + lat[None, :], out, mask=io_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_mask)


def check_mla_inputs(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor) -> None:
    """Raises ValueError naming the mismatch between the queries and the latent cache."""
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(
            f"MLA queries must be q_latent [T, H, kv_lora_rank] and q_rope [T, H, rope_dim] with the same "
            f"T and H; got {tuple(q_latent.shape)} and {tuple(q_rope.shape)}"
        )
    if cache.dim() != 3 or cache.shape[-1] != q_latent.shape[-1] + q_rope.shape[-1]:
        raise ValueError(
            f"MLA latent cache must be [num_blocks, block_size, kv_lora_rank + rope_dim] = "
            f"[*, *, {q_latent.shape[-1] + q_rope.shape[-1]}]; got {tuple(cache.shape)}"
        )
    if q_latent.stride(-1) != 1 or q_rope.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("MLA attention needs q_latent, q_rope and the cache contiguous in the last dim")
    block_size = cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"KV cache block_size must be a power of two; got {block_size}")


def mla_attention_launch(
    q_latent, q_rope, cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
    num_splits=1, block_m=32, block_n=32, num_warps=4, num_stages=2,
):  # fmt: skip
    """Absorbed MLA attention with explicit launch parameters (the decode and prefill wrappers, tests,
    benchmarks). q_latent [T, H, R], q_rope [T, H, P], cache [num_blocks, block_size, R + P] ->
    new [T, H, R] of q_latent.dtype. query_start_loc None: decode (token b is sequence b's query).
    max_query_len bounds every q_len (it sizes the grid); rows of the output past the last
    sequence's queries are left unwritten."""
    check_mla_inputs(q_latent, q_rope, cache)
    num_tokens, heads, rank = q_latent.shape
    rope = q_rope.shape[-1]
    out = torch.empty_like(q_latent)
    batch = block_tables.shape[0]
    if num_tokens == 0 or batch == 0 or max_query_len <= 0:
        return out
    part_out, part_lse = split_partials(out, num_splits)
    block_r = max(triton.next_power_of_2(rank), 16)
    grid = (triton.cdiv(max_query_len * heads, block_m) * num_splits, batch)
    _mla_kernel[grid](
        q_latent, q_rope, cache, block_tables, seq_lens,
        seq_lens if query_start_loc is None else query_start_loc, out, part_out, part_lse,
        scale * 1.4426950408889634,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        out.stride(0), out.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0), num_splits,
        HEADS=heads, RANK=rank, ROPE=rope, BLOCK_SIZE=cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_P=max(triton.next_power_of_2(rope), 16),
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32", SPLIT_KEYS=num_splits > 1,
        IS_DECODE=query_start_loc is None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        launch_merge(part_out, part_lse, out, num_splits, block_r)
    return out
