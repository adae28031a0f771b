"""Paged decode attention: one query token per sequence, grouped-query heads, keys from the paged cache.

The Triton version is split-K (flash-decoding): the grid is (batch, kv_head, split); each program
holds all query heads of one KV group, so K/V is read once per group, and attends to its share of
the context; the splits are merged by their log-sum-exp, by a second kernel or by the last split
program to finish (decode_merge.py). The number of splits depends only on shapes (batch, heads,
block-table width) and the device, never on seq_lens, so the launch is the same on every CUDA-graph
replay; each program finds its token range from the seq_len it loads on the device. The split rule,
the paged tile loads and the partial buffers are shared with the other paged kernels
(paged_attention_common.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.decode_merge import arrival_counters, launch_merge, merge_group_in_last_split
from tpfuse.kernels.paged_attention_common import (
    DECODE_BLOCK_N,
    _gather_kv,
    _load_paged_tile,
    _load_pages,
    attention_output,
    check_paged_attention_args,
    choose_num_splits,
    split_key_range,
    split_partials,
)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    split: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, Hq, D]; caches: [num_blocks, block_size, Hk, D]; block_tables: [B, max_blocks] int32;
    seq_lens: [B] int32 (keys 0..seq_len-1 are attended, the current token's included).
    Returns [B, Hq, D] of q.dtype: out when given (any [B, Hq, D] view with unit last stride), else
    a new tensor. Hq must be a multiple of Hk. split: the Triton twin's launch choice, without
    effect here.
    """
    out = attention_output(q, out)
    group = q.shape[1] // k_cache.shape[2]
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        k = _gather_kv(k_cache, block_tables[b], n).float().repeat_interleave(group, dim=1)
        v = _gather_kv(v_cache, block_tables[b], n).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


@triton.jit
def attend_key_range(
    q, k_cache_ptr, v_cache_ptr, block_table_row, start, end, kv_head, dims, dim_mask, scale_log2e,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax of q [BLOCK_G, BLOCK_D] over keys [start, end) of one sequence's paged cache:
    (running max m [BLOCK_G], sum l [BLOCK_G], unnormalised output acc [BLOCK_G, BLOCK_D]), scores in
    the log2 domain (scale_log2e applied)."""
    # Running max starts finite so that fully masked tiles give p = 0, never NaN.
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        pages = _load_pages(block_table_row, tokens, token_mask, BLOCK_SIZE)
        k = _load_paged_tile(k_cache_ptr, pages, tokens, token_mask, kv_head, dims, dim_mask,
                             stride_kb, stride_ks, stride_kh, BLOCK_SIZE)  # fmt: skip
        # V is loaded before the scores are used so both tiles are in flight together.
        v = _load_paged_tile(v_cache_ptr, pages, tokens, token_mask, kv_head, dims, dim_mask,
                             stride_vb, stride_vs, stride_vh, BLOCK_SIZE)  # fmt: skip
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * scale_log2e
        s = tl.where(token_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def store_split_result(
    m_i, l_i, acc, part_out_ptr, part_lse_ptr, out_ptr, counter_ptr, b, kv_head, split, heads, head_mask,
    dims, dim_mask, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr,
):  # fmt: skip
    """One split's attend_key_range result: the output itself with one split, else its partials
    (normalised within the split, lse in the log2 domain, -inf without keys), merged by the last split
    to arrive with MERGE_IN_KERNEL (decode_merge.py). Grid (batch, KV heads, NUM_SPLITS)."""
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    mask = head_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        # partials: out [B, Hq, NUM_SPLITS, HEAD_DIM], lse [B, Hq, NUM_SPLITS] (log2 domain), contiguous
        row = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out, mask=mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=head_mask)
        if MERGE_IN_KERNEL:
            rows = b * GROUP * tl.num_programs(1) + heads
            merge_group_in_last_split(part_out_ptr, part_lse_ptr, out_ptr, counter_ptr, b, kv_head, rows,
                                      heads, head_mask, dims, dim_mask, stride_ob, stride_oh, HEAD_DIM,
                                      NUM_SPLITS, BLOCK_G, BLOCK_D)  # fmt: skip


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    counter_ptr,
    scale_log2e,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MERGE_IN_KERNEL: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
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
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    m_i, l_i, acc = attend_key_range(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr + b * stride_bt, start, end, kv_head, dims, dim_mask,
        scale_log2e, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE, BLOCK_G,
        BLOCK_D, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    store_split_result(
        m_i, l_i, acc, part_out_ptr, part_lse_ptr, out_ptr, counter_ptr, b, kv_head, split, heads, head_mask,
        dims, dim_mask, stride_ob, stride_oh, GROUP, HEAD_DIM, NUM_SPLITS, BLOCK_G, BLOCK_D, MERGE_IN_KERNEL,
    )  # fmt: skip


# The last split program of each (sequence, KV head) can merge the partials instead of a second
# launch (decode_merge.py): correct on the H200 but measured no faster (docs/PERF.md, the PDL and
# last-split merge trial), so the merge launch stays.
DECODE_MERGE_IN_SPLIT_KERNEL = False


def decode_attention_launch(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    scale,
    num_splits,
    block_n=DECODE_BLOCK_N,
    merge_in_kernel=None,
    out=None,
):
    """decode_attention_triton with an explicit number of splits, key tile and merge (tests,
    benchmarks); merge_in_kernel None takes DECODE_MERGE_IN_SPLIT_KERNEL."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_paged_attention_args(q, k_cache, v_cache, "decode attention")
    out = attention_output(q, out)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    part_out, part_lse = split_partials(out, num_splits)
    if merge_in_kernel is None:
        merge_in_kernel = DECODE_MERGE_IN_SPLIT_KERNEL
    merge_in_kernel = merge_in_kernel and num_splits > 1
    counters = arrival_counters(q.device, batch * num_kv_heads) if merge_in_kernel else seq_lens
    block_d = max(triton.next_power_of_2(head_dim), 16)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        out,
        counters,
        scale * 1.4426950408889634,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(triton.next_power_of_2(group), 16),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        MERGE_IN_KERNEL=merge_in_kernel,
        num_warps=4,
        num_stages=2,
        **pdl.launch(q.device),
    )
    if num_splits > 1 and not merge_in_kernel:
        launch_merge(part_out, part_lse, out, num_splits, block_d)
    return out


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    split: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton decode_attention_ref (same shapes and dtypes, written into out when given); CUDA-graph
    safe: the launch depends only on shapes, seq_lens is read on the device. A sequence with seq_len 0
    gives zeros. split False: one program per (sequence, KV head), whatever the shapes (the decode
    rows of a mixed step: one compiled variant, which compile_unsplit_variants builds at start-up).

    Raises ValueError when Hq is not a multiple of Hk, block_size is not a power of two, or a
    head_dim is strided."""
    num_splits = 1
    if split:
        num_splits = choose_num_splits(
            q.shape[0], k_cache.shape[2], block_tables.shape[1], k_cache.shape[1], q.device
        )
    return decode_attention_launch(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, out=out)


UNSPLIT_TABLE_WIDTHS = (1, 16, 17)  # block-table row strides Triton specialises apart: 1, 16k, other


def compile_unsplit_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int) -> int:
    """Launches the unsplit decode kernel once per block-table stride class, on one query over the
    real caches' layout (q a view of a fused qkv output, as the model makes it), so that a mixed
    step's decode rows never stop to compile. The caches are only read. Returns the launches."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    qkv = torch.zeros(
        1, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=k_cache.dtype, device=k_cache.device
    )
    q = qkv[:, : num_q_heads * head_dim].view(1, num_q_heads, head_dim)
    lens = torch.ones(1, dtype=torch.int32, device=k_cache.device)
    for width in UNSPLIT_TABLE_WIDTHS:
        tables = torch.zeros(1, width, dtype=torch.int32, device=k_cache.device)
        decode_attention_launch(q, k_cache, v_cache, tables, lens, 1.0, num_splits=1)
    return len(UNSPLIT_TABLE_WIDTHS)
