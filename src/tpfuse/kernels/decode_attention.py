"""Paged decode attention: one query token per sequence, grouped-query heads, keys from the paged cache.

The Triton version is split-K (flash-decoding): the grid is (batch, kv_head, split); each program
holds all query heads of one KV group, so K/V is read once per group, and attends to its share of
the context; the splits are merged by their log-sum-exp, by a second kernel or by the last split
program to finish (decode_merge.py). The number of splits depends only on shapes (batch, heads,
block-table width) and the device, never on seq_lens, so the launch is the same on every CUDA-graph
replay; each program finds its token range from the seq_len it loads on the device.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tpfuse.kernels.decode_merge import arrival_counters, launch_merge, merge_group_in_last_split


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


@triton.jit
def _load_paged_tile(cache_ptr, pages, tokens, token_mask, kv_head, dims, dim_mask,
                     stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_D] tile of one KV head; pages: [BLOCK_N] int64 physical block of each token."""
    offsets = pages * stride_block + (tokens % BLOCK_SIZE) * stride_slot + kv_head * stride_head
    return tl.load(
        cache_ptr + offsets[:, None] + dims[None, :], mask=token_mask[:, None] & dim_mask[None, :], other=0.0
    )


@triton.jit
def _load_pages(block_table_row, tokens, token_mask, BLOCK_SIZE: tl.constexpr):
    """[BLOCK_N] int64 physical block of each token position of one sequence."""
    return tl.load(block_table_row + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)


@triton.jit
def _load_kv_tile(cache_ptr, block_table_row, tokens, token_mask, kv_head, dims, dim_mask,
                  stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_D] tile of one KV head for the given token positions of one sequence."""
    pages = _load_pages(block_table_row, tokens, token_mask, BLOCK_SIZE)
    return _load_paged_tile(cache_ptr, pages, tokens, token_mask, kv_head, dims, dim_mask,
                            stride_block, stride_slot, stride_head, BLOCK_SIZE)  # fmt: skip


@triton.jit
def split_key_range(num_keys, split, num_splits, BLOCK_N: tl.constexpr):
    """[start, end) of the keys 0 .. num_keys - 1 that split `split` of num_splits attends: an equal
    share of whole BLOCK_N tiles (empty for the last splits of a short context)."""
    tiles_per_split = tl.cdiv(tl.cdiv(num_keys, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    return start, tl.minimum(start + tiles_per_split * BLOCK_N, num_keys)


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
):
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
    block_table_row = block_tables_ptr + b * stride_bt

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


DECODE_BLOCK_N = 64
# From the H200 split sweep at llama-3.1-8b shapes (8 KV heads): best 16 splits at batch 1 (ctx 2048
# and 8192), 8 at batch 8, 1 at batch 64, i.e. about four programs per SM, rounded down, at most 16.
DECODE_PROGRAMS_PER_SM = 4
DECODE_MAX_SPLITS = 16
# The last split program of each (sequence, KV head) can merge the partials instead of a second
# launch (decode_merge.py): correct on the H200 but measured no faster (docs/PERF.md, the PDL and
# last-split merge trial), so the merge launch stays.
DECODE_MERGE_IN_SPLIT_KERNEL = False


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """SM count of a CUDA device (cached per index); 8 stands in on CPU, so split rules run there."""
    if device.type != "cuda":
        return 8
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def num_splits_for(
    batch: int,
    num_kv_heads: int,
    max_blocks: int,
    block_size: int,
    num_sms: int,
    programs_per_sm: int = DECODE_PROGRAMS_PER_SM,
) -> int:
    """Splits per sequence from shapes only (CUDA-graph safe): about programs_per_sm programs per SM
    counting every (sequence, KV head, split), rounded down, never more splits than key tiles fit in
    the block-table width, at most DECODE_MAX_SPLITS, at least 1 (which needs no merge)."""
    max_tiles = triton.cdiv(max_blocks * block_size, DECODE_BLOCK_N)
    wanted = programs_per_sm * num_sms // max(batch * num_kv_heads, 1)
    return max(1, min(wanted, max_tiles, DECODE_MAX_SPLITS))


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_blocks: int,
    block_size: int,
    device,
    programs_per_sm: int = DECODE_PROGRAMS_PER_SM,
) -> int:
    """num_splits_for on this device's SM count (8 SMs stand in on CPU)."""
    sms = device_sms(device)
    return num_splits_for(batch, num_kv_heads, max_blocks, block_size, sms, programs_per_sm)


def check_paged_attention_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, what: str
) -> None:
    """Raises ValueError unless q [rows, Hq, D] and the caches [num_blocks, block_size, Hk, D] have Hq a
    multiple of Hk, a contiguous head_dim and a power-of-two block_size (what names the caller)."""
    num_heads, num_kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"{what} needs q and the caches contiguous in head_dim")
    if block_size & (block_size - 1):
        raise ValueError(f"KV cache block_size must be a power of two; got {block_size}")


def split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(part_out [rows, H, num_splits, D], part_lse [rows, H, num_splits]) float32 buffers for the key
    splits of out [rows, H, D]; with one split the kernel writes out directly, so both are out."""
    if num_splits <= 1:
        return out, out
    rows, num_heads, head_dim = out.shape
    part_out = torch.empty((rows, num_heads, num_splits, head_dim), dtype=torch.float32, device=out.device)
    part_lse = torch.empty((rows, num_heads, num_splits), dtype=torch.float32, device=out.device)
    return part_out, part_lse


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
):
    """decode_attention_triton with an explicit number of splits, key tile and merge (tests,
    benchmarks); merge_in_kernel None takes DECODE_MERGE_IN_SPLIT_KERNEL."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_paged_attention_args(q, k_cache, v_cache, "decode attention")
    out = torch.empty_like(q)
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
) -> torch.Tensor:
    """Triton decode_attention_ref (same shapes and dtypes); CUDA-graph safe: the launch depends only
    on shapes, seq_lens is read on the device. A sequence with seq_len 0 gives zeros.

    Raises ValueError when Hq is not a multiple of Hk, block_size is not a power of two, or a
    head_dim is strided."""
    num_splits = choose_num_splits(
        q.shape[0], k_cache.shape[2], block_tables.shape[1], k_cache.shape[1], q.device
    )
    return decode_attention_launch(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)
