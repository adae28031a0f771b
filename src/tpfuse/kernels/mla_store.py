"""Store each token's MLA latent row (normalised c, then rotated k_pe) into its paged cache slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def store_latent_ref(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
):
    """latent [T, R], k_pe [T, P] (any row strides); cache [num_blocks, block_size, R + P] written at
    slot_mapping [T] int64 (block * block_size + offset; slot < 0 skipped). Returns cache."""
    rank = latent.shape[-1]
    flat = cache.view(-1, cache.shape[-1])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat[slots, :rank] = latent[keep].to(cache.dtype)
    flat[slots, rank:] = k_pe[keep].to(cache.dtype)
    return cache


@triton.jit
def _store_latent_kernel(latent_ptr, k_pe_ptr, cache_ptr, slot_ptr, stride_lt, stride_kt, stride_cs,
                         RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_P: tl.constexpr):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        lat = tl.arange(0, BLOCK_R)
        rot = tl.arange(0, BLOCK_P)
        row = cache_ptr + slot * stride_cs
        c = tl.load(latent_ptr + token * stride_lt + lat, mask=lat < RANK)
        tl.store(row + lat, c.to(cache_ptr.dtype.element_ty), mask=lat < RANK)
        k = tl.load(k_pe_ptr + token * stride_kt + rot, mask=rot < ROPE)
        tl.store(row + RANK + rot, k.to(cache_ptr.dtype.element_ty), mask=rot < ROPE)


def store_latent_triton(latent, k_pe, cache, slot_mapping):
    """Triton store_latent_ref. The cache's slots must be contiguous rows (cache.view(-1, R + P)).
    Raises ValueError when the widths do not add up to the cache row or a last dim is strided."""
    rank, rope = latent.shape[-1], k_pe.shape[-1]
    if cache.shape[-1] != rank + rope:
        raise ValueError(
            f"latent ({rank}) + k_pe ({rope}) widths must equal the cache row ({cache.shape[-1]})"
        )
    if latent.stride(-1) != 1 or k_pe.stride(-1) != 1 or not cache.is_contiguous():
        raise ValueError("store_latent needs contiguous rows of latent and k_pe and a contiguous cache")
    if latent.shape[0]:
        _store_latent_kernel[(latent.shape[0],)](
            latent, k_pe, cache, slot_mapping, latent.stride(0), k_pe.stride(0), cache.stride(1),
            RANK=rank, ROPE=rope, BLOCK_R=triton.next_power_of_2(rank), BLOCK_P=triton.next_power_of_2(rope),
            num_warps=4,
        )  # fmt: skip
    return cache
