"""MLA's per-token prologue in one launch: rotate q_pe (a new contiguous q_rope for the attention
kernels), normalise the latent c (kv_a_layernorm), rotate the shared k_pe, and write [c_normed, k_rot]
into the token's latent-cache slot. The norm rounds as kernels/rmsnorm.py does; the rotation takes
interleaved pairs or halves in and gives halves out (kernels/mla_rope.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.mla_rope import mla_rope_ref
from tpfuse.kernels.mla_store import store_latent_ref
from tpfuse.kernels.rmsnorm import rmsnorm_ref, rmsnorm_row_weighted


def mla_rope_norm_store_ref(
    positions, q_pe, latent, k_pe, norm_weight, eps, cos_sin_cache, cache, slot_mapping, interleaved
):  # fmt: skip
    """positions [T]; q_pe [T, H, P], latent [T, R], k_pe [T, P] (any row strides, e.g. views of one
    projection); norm_weight [R]; cos_sin_cache [max_pos, P] float32; cache [num_blocks, block_size,
    R + P] written at slot_mapping [T] (slot < 0 skipped). Returns the new q_rot [T, H, P]."""
    q_rot, k_rot = mla_rope_ref(positions, q_pe, k_pe, cos_sin_cache, interleaved)
    store_latent_ref(rmsnorm_ref(latent, norm_weight, eps), k_rot, cache, slot_mapping)
    return q_rot


@triton.jit
def _rotate(ptr, offsets, first, second, mask, cos, sin):
    """(x1 * cos - x2 * sin, x2 * cos + x1 * sin) in float32 of the pairs at offsets + first/second."""
    x1 = tl.load(ptr + offsets + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + offsets + second, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _mla_rope_norm_store_kernel(
    positions_ptr, q_ptr, latent_ptr, k_ptr, w_ptr, cs_ptr, cache_ptr, slot_ptr, out_ptr,
    stride_qt, stride_qh, stride_lt, stride_kt, stride_cs, stride_ot, stride_oh, num_heads, eps,
    RANK: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + j, mask=j_mask, other=0.0)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + j, mask=j_mask, other=0.0)
    if INTERLEAVED:
        first, second = 2 * j, 2 * j + 1
    else:
        first, second = j, j + HALF
    heads = tl.arange(0, BLOCK_H)
    q_mask = (heads < num_heads)[:, None] & j_mask[None, :]
    q_rows = t * stride_qt + heads[:, None] * stride_qh
    r1, r2 = _rotate(q_ptr, q_rows, first[None, :], second[None, :], q_mask, cos[None, :], sin[None, :])
    out = out_ptr + t * stride_ot + heads[:, None] * stride_oh + j[None, :]
    tl.store(out, r1.to(out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(out + HALF, r2.to(out_ptr.dtype.element_ty), mask=q_mask)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        cols = tl.arange(0, BLOCK_R)
        c_mask = cols < RANK
        # The weight is loaded up front: loads are not moved across the reduction's barrier.
        w = tl.load(w_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
        c = tl.load(latent_ptr + t * stride_lt + cols, mask=c_mask, other=0.0).to(tl.float32)
        # Rounded to the latent's dtype first, as the reference's rmsnorm does.
        c = rmsnorm_row_weighted(c, w, RANK, eps).to(latent_ptr.dtype.element_ty)
        row = cache_ptr + slot * (RANK + 2 * HALF)
        tl.store(row + cols, c.to(cache_ptr.dtype.element_ty), mask=c_mask)
        k1, k2 = _rotate(k_ptr, t * stride_kt, first, second, j_mask, cos, sin)
        tl.store(row + RANK + j, k1.to(k_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty), mask=j_mask)
        tl.store(
            row + RANK + HALF + j, k2.to(k_ptr.dtype.element_ty).to(cache_ptr.dtype.element_ty), mask=j_mask
        )


def mla_rope_norm_store_triton(
    positions, q_pe, latent, k_pe, norm_weight, eps, cos_sin_cache, cache, slot_mapping, interleaved
):  # fmt: skip
    """Triton mla_rope_norm_store_ref (same shapes and dtypes). The cache must be contiguous. Raises
    ValueError when the widths disagree or a last dim is strided."""
    num_tokens, num_heads, rope = q_pe.shape
    rank = latent.shape[-1]
    if (
        rope % 2
        or k_pe.shape[-1] != rope
        or cos_sin_cache.shape[-1] != rope
        or cache.shape[-1] != rank + rope
    ):
        raise ValueError(
            f"MLA rope widths disagree: q_pe {tuple(q_pe.shape)}, k_pe {tuple(k_pe.shape)}, cos/sin "
            f"{tuple(cos_sin_cache.shape)}, latent {tuple(latent.shape)}, cache {tuple(cache.shape)}"
        )
    if min(t.stride(-1) for t in (q_pe, latent, k_pe, cos_sin_cache)) != 1 or not cache.is_contiguous():
        raise ValueError("mla_rope_norm_store needs contiguous last dims and a contiguous cache")
    out = torch.empty((num_tokens, num_heads, rope), dtype=q_pe.dtype, device=q_pe.device)
    if num_tokens:
        _mla_rope_norm_store_kernel[(num_tokens,)](
            positions, q_pe, latent, k_pe, norm_weight, cos_sin_cache, cache, slot_mapping, out,
            q_pe.stride(0), q_pe.stride(1), latent.stride(0), k_pe.stride(0), cos_sin_cache.stride(0),
            out.stride(0), out.stride(1), num_heads, eps,
            RANK=rank, HALF=rope // 2, INTERLEAVED=interleaved, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_HALF=triton.next_power_of_2(rope // 2), BLOCK_R=triton.next_power_of_2(rank), num_warps=4,
        )  # fmt: skip
    return out
