"""Writes each token's key and value into its slot of the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hk, D]; k_cache, v_cache: [num_blocks, block_size, Hk, D], written in place.

    slot_mapping: [T] int, slot = block * block_size + offset; a negative slot means "do not store"
    (padding tokens of a CUDA-graph batch).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    num_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    # A negative slot marks a padding token: nothing is read or written for it.
    mask = (heads < num_heads) & (cols < head_dim) & ((heads * 0 + slot) >= 0)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + heads * stride_ch + cols
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + cols, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + cols, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton store_kv_ref. k, v: [T, Hk, D] (may be strided views; last dim contiguous);
    k_cache, v_cache: [num_blocks, block_size, Hk, D] with the same strides, written in place;
    slot_mapping: [T] int32/int64, negative slots skipped. Raises ValueError on mismatched layouts."""
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError("store_kv needs k_cache and v_cache of one shape and layout")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("store_kv needs k, v and the caches contiguous in the last (head_dim) dim")
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k.shape[1],
        k.shape[2],
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_HEADS=triton.next_power_of_2(k.shape[1]),
        BLOCK_D=triton.next_power_of_2(k.shape[2]),
        num_warps=4,
    )
