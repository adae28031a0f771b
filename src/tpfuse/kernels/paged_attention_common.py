"""What the paged attention kernels share (decode, prefill / verify, MLA decode and prefill): the
argument check and K/V tile loads of the paged cache, split-K key ranges, the shape-only split rule
and the partial buffers.

Paged K/V cache: [num_blocks, block_size, Hk, D] (block_size a power of two); token t of a sequence
is in slot t % block_size of physical block block_table_row[t // block_size].
Split-K: split s of num_splits attends keys [start, end) from split_key_range, an equal share of whole
BLOCK_N tiles (the last splits of a short context may be empty). Each split writes its output
normalised within the split to part_out [rows, H, num_splits, D] and its log-sum-exp (log2 domain, -inf
without keys) to part_lse [rows, H, num_splits], both contiguous float32 (split_partials); with one
split the kernel writes out directly. decode_merge.py merges the partials.
Split rule (decode, and the verify passes of prefill and MLA prefill; MLA decode has its own on
device_sms): num_splits_for / choose_num_splits depend only on shapes (batch, KV heads, block-table
width, block_size) and the device's SM count, never on seq_lens, so a CUDA-graph replay launches the
same grid; each program finds its key range from the seq_len it loads on the device.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """cache: [num_blocks, block_size, Hk, D] -> [length, Hk, D] for one sequence."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


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


# The decode kernel's key tile; the split rule counts the key tiles of the block-table width in it.
DECODE_BLOCK_N = 64
# From the H200 split sweep at llama-3.1-8b shapes (8 KV heads): best 16 splits at batch 1 (ctx 2048
# and 8192), 8 at batch 8, 1 at batch 64, i.e. about four programs per SM, rounded down, at most 16.
DECODE_PROGRAMS_PER_SM = 4
DECODE_MAX_SPLITS = 16


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


def attention_output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where paged attention writes its [rows, Hq, D] result: out (checked: q's shape and dtype, unit
    last stride), or a new tensor like q when out is None."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"attention out must match q ({tuple(q.shape)}, {q.dtype}) with a unit last stride; got "
            f"{tuple(out.shape)}, {out.dtype}, strides {out.stride()}"
        )
    return out


def split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(part_out [rows, H, num_splits, D], part_lse [rows, H, num_splits]) float32 buffers for the key
    splits of out [rows, H, D]; with one split the kernel writes out directly, so both are out."""
    if num_splits <= 1:
        return out, out
    rows, num_heads, head_dim = out.shape
    part_out = torch.empty((rows, num_heads, num_splits, head_dim), dtype=torch.float32, device=out.device)
    part_lse = torch.empty((rows, num_heads, num_splits), dtype=torch.float32, device=out.device)
    return part_out, part_lse
