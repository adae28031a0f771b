"""Rotary embedding fused with the KV-cache store: one launch per layer instead of two.

q is rotated in place (attention reads it next); the rotated k and the untouched v go straight into
their cache slots, so the rotated k never round-trips through the qkv buffer. Numerics are those of
rope_ref followed by store_kv_ref: each half is rotated in float32, rounded once to k's dtype, then
converted to the cache dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.kv_store import store_kv_ref
from tpfuse.kernels.rope import _rotate_heads, rope_ref


def rope_store_kv_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """positions: [T] int; q: [T, Hq, D], rotated in place and returned; k, v: [T, Hk, D], only read;
    cos_sin_cache: [max_pos, D] float32 from rope_cos_sin_cache; k_cache, v_cache:
    [num_blocks, block_size, Hk, D], written at slot_mapping ([T] int; a negative slot is skipped).
    """
    rotated_k = k.clone()
    rope_ref(positions, q, rotated_k, cos_sin_cache)
    store_kv_ref(rotated_k, v, k_cache, v_cache, slot_mapping)
    return q


@triton.jit
def _rope_store_kv_kernel(
    positions_ptr,
    slot_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos_sin,
    stride_cb,
    stride_cs,
    stride_ch,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    pdl.begin(PDL)
    # grid (T, 2): part 0 rotates q in place, part 1 rotates k and stores k and v, so that a
    # batch-1 decode step spreads its few kilobytes over two SMs.
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + cols, mask=col_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + cols, mask=col_mask, other=0.0)[None, :]
    if part == 0:
        _rotate_heads(q_ptr, stride_qt, stride_qh, num_q_heads, token, cos, sin, HALF, BLOCK_QH, BLOCK_HALF)
    else:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        heads = tl.arange(0, BLOCK_KH)[:, None]
        # A negative slot marks a padding token: nothing is read or written for it.
        mask = (heads < num_kv_heads) & col_mask[None, :] & ((heads * 0 + slot) >= 0)
        k_first = k_ptr + token * stride_kt + heads * stride_kh + cols[None, :]
        v_first = v_ptr + token * stride_vt + heads * stride_vh + cols[None, :]
        k1 = tl.load(k_first, mask=mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_first + HALF, mask=mask, other=0.0).to(tl.float32)
        v1 = tl.load(v_first, mask=mask)
        v2 = tl.load(v_first + HALF, mask=mask)
        dst = (
            (slot // BLOCK_SIZE) * stride_cb
            + (slot % BLOCK_SIZE) * stride_cs
            + heads * stride_ch
            + cols[None, :]
        )
        k_dtype = k_ptr.dtype.element_ty
        cache_dtype = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst, (k1 * cos - k2 * sin).to(k_dtype).to(cache_dtype), mask=mask)
        tl.store(k_cache_ptr + dst + HALF, (k2 * cos + k1 * sin).to(k_dtype).to(cache_dtype), mask=mask)
        tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_rope_store_kv_args(q, k, v, cos_sin_cache, k_cache, v_cache) -> None:
    """Raises ValueError on an odd head_dim, head_dims or KV head counts that differ, caches of different
    shapes or layouts, or a last dim that is not contiguous (shared by the fused variants)."""
    head_dim = q.shape[-1]
    if head_dim % 2 or {k.shape[-1], v.shape[-1], k_cache.shape[-1], cos_sin_cache.shape[-1]} != {head_dim}:
        raise ValueError(
            f"rope_store_kv needs an even head_dim shared by q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}, the caches {tuple(k_cache.shape)} and cos_sin {tuple(cos_sin_cache.shape)}"
        )
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError("rope_store_kv needs k_cache and v_cache of one shape and layout")
    if k.shape != v.shape or k.shape[1] != k_cache.shape[2]:
        raise ValueError(
            f"rope_store_kv needs k {tuple(k.shape)} and v {tuple(v.shape)} of one shape, with as many "
            f"heads as the cache {tuple(k_cache.shape)}"
        )
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, cos_sin_cache)):
        raise ValueError(
            "rope_store_kv needs q, k, v, the caches and cos_sin contiguous in the last dim; "
            "pass views of a contiguous qkv output"
        )


def rope_store_kv_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Triton rope_store_kv_ref (same shapes and dtypes). q, k, v may be strided views of a fused qkv
    output but their last dim must be contiguous; q is rotated in place and returned, k and v are only
    read, k_cache and v_cache are written at slot_mapping (negative slots skipped).

    Raises ValueError as check_rope_store_kv_args does."""
    check_rope_store_kv_args(q, k, v, cos_sin_cache, k_cache, v_cache)
    head_dim = q.shape[-1]
    if q.shape[0] == 0:
        return q
    half = head_dim // 2
    _rope_store_kv_kernel[(q.shape[0], 2)](
        positions,
        slot_mapping,
        q,
        k,
        v,
        cos_sin_cache,
        k_cache,
        v_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        q.shape[1],
        k.shape[1],
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_QH=triton.next_power_of_2(q.shape[1]),
        BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4,
        **pdl.launch(q.device),
    )
    return q
