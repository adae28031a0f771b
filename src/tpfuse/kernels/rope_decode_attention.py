"""Decode attention that brings its own token: (Qwen3's per-head RMSNorm of q and k,) rotary embedding,
the KV-cache store of the step's key and value, and split-K paged decode attention in one launch (plus
the merge launch where there are splits), instead of a rope/store launch before the attention.

Grid (sequence, KV head, split), as decode_attention.py. Each program normalises and rotates its group's
query heads in registers (q is not written) and computes the step's rotated key the same way. The split
whose key range holds the step's token (key seq_len - 1) stores k and v into their cache slot
(slot_mapping; negative: a padding row, nothing stored) and attends to them from registers, one more
online-softmax step after its cache keys, so no program reads a slot this launch writes.

When the split rule gives several splits, every split rotates the same query heads again. On the H100
that still beat the rope launch it replaces where a KV head has at most four query heads (llama), with
or without PDL, but lost under PDL with eight (qwen3-30b-a3b: 1.5 % of its batch-1 step); without PDL it
won at both (docs/PERF.md). So launches of one split, or of several splits with at most
FUSED_SPLIT_MAX_GROUP query heads a KV head, fuse; the others run the two launches (rope/store, then
decode attention).

Numerics are those of rope_store_kv_ref (or qk_norm_rope_store_kv_ref) followed by decode attention:
each head normalised in float32 and rounded to the activation dtype, rotated in float32 and rounded once
more, k converted to the cache dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.decode_attention import (
    attend_key_range,
    decode_attention_launch,
    decode_attention_ref,
    store_split_result,
)
from tpfuse.kernels.decode_merge import arrival_counters, launch_merge
from tpfuse.kernels.paged_attention_common import (
    DECODE_BLOCK_N,
    attention_output,
    check_paged_attention_args,
    choose_num_splits,
    split_key_range,
    split_partials,
)
from tpfuse.kernels.qk_norm_rope_store_kv import (
    check_qk_norm_weights,
    qk_norm_rope_store_kv_ref,
    qk_norm_rope_store_kv_triton,
)
from tpfuse.kernels.rope_store_kv import check_rope_store_kv_args, rope_store_kv_ref, rope_store_kv_triton

QkNorm = tuple[torch.Tensor, torch.Tensor, float]  # (q_norm weight [D], k_norm weight [D], eps)

FUSED_SPLIT_MAX_GROUP = 4  # query heads a KV head up to which split launches fuse too (module doc)


def fuses(num_splits: int, group: int) -> bool:
    """Whether a launch of num_splits key splits and group query heads a KV head runs fused."""
    return num_splits == 1 or group <= FUSED_SPLIT_MAX_GROUP


def rope_decode_attention_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    qk_norm: QkNorm | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence. positions, slot_mapping: [B]; q: [B, Hq, D] (its contents after the
    call unspecified: the Triton twin may rotate it in place), k, v: [B, Hk, D] (only read); caches
    [num_blocks, block_size, Hk, D], written at slot_mapping (negative: skipped); block_tables
    [B, max_blocks] int32; seq_lens [B] int32, the step's token included (it is key seq_len - 1, at
    slot_mapping). qk_norm: Qwen3's per-head norms, or None. Returns [B, Hq, D] of q.dtype:
    rope_store_kv_ref (or qk_norm_rope_store_kv_ref) on a copy of q, then decode_attention_ref."""
    q = q.clone()
    if qk_norm is None:
        rope_store_kv_ref(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
    else:
        q_w, k_w, eps = qk_norm
        qk_norm_rope_store_kv_ref(
            positions, q, k, v, q_w, k_w, eps, cos_sin_cache, k_cache, v_cache, slot_mapping
        )
    return decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out)


@triton.jit
def _rotated_rows(
    row_ptrs, dims, partner, mask, w_ptr, cos, signed_sin, eps, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr
):  # fmt: skip
    """[R, BLOCK_D] heads at row_ptrs ([R] pointers) in their own dtype: (RMS-normalised by w over
    HEAD_DIM and rounded, then) rotated in float32 and rounded. partner: the column each column pairs
    with; signed_sin: -sin on the first half, +sin on the second."""
    x = tl.load(row_ptrs[:, None] + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(row_ptrs[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = row_ptrs.dtype.element_ty
    if QK_NORM:
        dim_mask = dims < HEAD_DIM
        w = tl.load(w_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)
        w_partner = tl.load(w_ptr + partner, mask=dim_mask, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
        x = (x * inv_rms[:, None] * w[None, :]).to(dtype).to(tl.float32)
        x_partner = (x_partner * inv_rms[:, None] * w_partner[None, :]).to(dtype).to(tl.float32)
    return (x * cos[None, :] + x_partner * signed_sin[None, :]).to(dtype)


@triton.jit
def _rope_decode_split_kernel(
    positions_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, k_cache_ptr,
    v_cache_ptr, block_tables_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, out_ptr, counter_ptr,
    scale_log2e, eps, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_cos_sin,
    stride_ob, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, QK_NORM: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):  # fmt: skip
    pdl.begin(PDL)
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start, end = split_key_range(seq_len, split, NUM_SPLITS, BLOCK_N)

    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    head_mask = g < GROUP
    dim_mask = dims < HEAD_DIM
    partner = tl.where(dims < HALF, dims + HALF, dims - HALF)
    pos = tl.load(positions_ptr + b).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + dims % HALF, mask=dim_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + dims % HALF, mask=dim_mask, other=0.0)
    signed_sin = tl.where(dims < HALF, -sin, sin)
    q = _rotated_rows(q_ptr + b * stride_qb + heads * stride_qh, dims, partner,
                      head_mask[:, None] & dim_mask[None, :], q_norm_ptr, cos, signed_sin, eps, HEAD_DIM,
                      QK_NORM)  # fmt: skip
    one = tl.arange(0, 1)
    new_k = _rotated_rows(k_ptr + b * stride_kb + kv_head * stride_kh + one, dims, partner,
                          (one < 1)[:, None] & dim_mask[None, :], k_norm_ptr, cos, signed_sin, eps, HEAD_DIM,
                          QK_NORM)  # fmt: skip
    new_k = tl.reshape(new_k, [BLOCK_D]).to(k_cache_ptr.dtype.element_ty)
    new_v = tl.load(v_ptr + b * stride_vb + kv_head * stride_vh + dims, mask=dim_mask, other=0.0)
    new_v = new_v.to(v_cache_ptr.dtype.element_ty)

    # The split that holds key seq_len - 1 stores it (split 0 for a row without keys) and attends to it
    # from registers after the cache keys before it.
    new_key = seq_len - 1
    owner = (start <= new_key) & (new_key < end)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if (owner | ((seq_len <= 0) & (split == 0))) & (slot >= 0):
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_head * stride_ch + dims
        tl.store(k_cache_ptr + dst, new_k, mask=dim_mask)
        tl.store(v_cache_ptr + dst, new_v, mask=dim_mask)

    m_i, l_i, acc = attend_key_range(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr + b * stride_bt, start, tl.minimum(end, new_key),
        kv_head, dims, dim_mask, scale_log2e, stride_cb, stride_cs, stride_ch, stride_cb, stride_cs,
        stride_ch, BLOCK_SIZE, BLOCK_G, BLOCK_D, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    # The new key, one more step of the online softmax (p rounded to q's dtype as the tiles' P @ V is).
    score = tl.sum(q.to(tl.float32) * new_k.to(q.dtype).to(tl.float32)[None, :], axis=1) * scale_log2e
    score = tl.where(owner, score, float("-inf"))
    m_new = tl.maximum(m_i, score)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(score - m_new)
    l_i = l_i * alpha + p
    acc = (
        acc * alpha[:, None]
        + p.to(q.dtype).to(tl.float32)[:, None] * new_v.to(q.dtype).to(tl.float32)[None, :]
    )
    m_i = m_new
    store_split_result(
        m_i, l_i, acc, part_out_ptr, part_lse_ptr, out_ptr, counter_ptr, b, kv_head, split, heads, head_mask,
        dims, dim_mask, stride_ob, stride_oh, GROUP, HEAD_DIM, NUM_SPLITS, BLOCK_G, BLOCK_D, MERGE_IN_KERNEL,
    )  # fmt: skip


def rope_decode_attention_launch(
    positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
    num_splits, qk_norm=None, block_n=DECODE_BLOCK_N, merge_in_kernel=False, out=None,
):  # fmt: skip
    """rope_decode_attention_triton with an explicit number of splits, key tile and merge (tests,
    benchmarks)."""
    check_rope_store_kv_args(q, k, v, cos_sin_cache, k_cache, v_cache)
    check_paged_attention_args(q, k_cache, v_cache, "decode attention")
    head_dim = q.shape[-1]
    if qk_norm is not None:
        check_qk_norm_weights(head_dim, qk_norm[0], qk_norm[1])
    q_w, k_w, eps = qk_norm if qk_norm is not None else (q, q, 0.0)  # unused without QK_NORM
    out = attention_output(q, out)
    batch, num_heads, _ = q.shape
    if batch == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    part_out, part_lse = split_partials(out, num_splits)
    merge_in_kernel = merge_in_kernel and num_splits > 1
    counters = arrival_counters(q.device, batch * num_kv_heads) if merge_in_kernel else seq_lens
    block_d = max(triton.next_power_of_2(head_dim), 16)
    _rope_decode_split_kernel[(batch, num_kv_heads, num_splits)](
        positions, slot_mapping, q, k, v, q_w, k_w, cos_sin_cache, k_cache, v_cache, block_tables, seq_lens,
        part_out, part_lse, out, counters, scale * 1.4426950408889634, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), GROUP=group, HEAD_DIM=head_dim, HALF=head_dim // 2, NUM_SPLITS=num_splits,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_G=max(triton.next_power_of_2(group), 16), BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QK_NORM=qk_norm is not None,
        MERGE_IN_KERNEL=merge_in_kernel, num_warps=4, num_stages=2, **pdl.launch(q.device),
    )  # fmt: skip
    if num_splits > 1 and not merge_in_kernel:
        launch_merge(part_out, part_lse, out, num_splits, block_d)
    return out


def rope_decode_attention_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    qk_norm: QkNorm | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton rope_decode_attention_ref (same shapes and dtypes; q, k, v may be views of one fused qkv
    output with a contiguous last dim), split by decode attention's shape-only rule: CUDA-graph safe.
    One launch (plus the merge) where the module doc says so, else the rope/store launch, which
    leaves q normed and rotated in place, then decode attention.

    Raises ValueError as rope_store_kv and decode attention do, or on norm weights not [head_dim]."""
    num_splits = choose_num_splits(
        q.shape[0], k_cache.shape[2], block_tables.shape[1], k_cache.shape[1], q.device
    )
    if fuses(num_splits, q.shape[1] // k_cache.shape[2]):
        return rope_decode_attention_launch(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
            num_splits, qk_norm, out=out,
        )  # fmt: skip
    if qk_norm is None:
        rope_store_kv_triton(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping)
    else:
        q_w, k_w, eps = qk_norm
        qk_norm_rope_store_kv_triton(
            positions, q, k, v, q_w, k_w, eps, cos_sin_cache, k_cache, v_cache, slot_mapping
        )
    return decode_attention_launch(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, out=out)
