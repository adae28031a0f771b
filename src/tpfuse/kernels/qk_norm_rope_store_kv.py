"""Per-head RMSNorm of q and k (Qwen3's q_norm / k_norm) fused with rotary embedding and the KV-cache
store: one launch per layer instead of three (rmsnorm of q, rmsnorm of k, rope_store_kv).

Numerics are those of the unfused sequence rmsnorm_triton -> rope_store_kv_triton, rounding for
rounding: each head is normalised in float32 over head_dim and rounded once to the activation dtype
(as rmsnorm rounds its output), then rotated in float32 from those rounded values and rounded once
more (as rope_store_kv does), then converted to the cache dtype. Each program normalises one head
with the launch configuration rmsnorm uses for a row of head_dim. Under the interpreter the two paths
agree bit for bit; on an H200 some elements differ by an ulp or two (the compiled variance sums
differ), which tests/kernels/test_decode_step_gpu.py bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.rmsnorm import _launch_config, rmsnorm_ref
from tpfuse.kernels.rope_store_kv import check_rope_store_kv_args, rope_store_kv_ref


def qk_norm_rope_store_kv_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """positions: [T] int; q: [T, Hq, D], normalised and rotated in place and returned; k, v: [T, Hk, D],
    only read; q_norm_weight, k_norm_weight: [D]; cos_sin_cache: [max_pos, D] float32; k_cache,
    v_cache: [num_blocks, block_size, Hk, D], written at slot_mapping ([T] int; negative: skipped)."""
    head_dim = q.shape[-1]
    q.copy_(rmsnorm_ref(q.reshape(-1, head_dim), q_norm_weight, eps).view(q.shape))
    k_normed = rmsnorm_ref(k.reshape(-1, head_dim), k_norm_weight, eps).view(k.shape)
    return rope_store_kv_ref(positions, q, k_normed, v, cos_sin_cache, k_cache, v_cache, slot_mapping)


@triton.jit
def _normed_rotated_head(
    row_ptr, w_ptr, cos, sin, head_dim, eps,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """(first, second) half of one head, RMS-normalised, rounded to the row's dtype and rotated, float32."""
    d = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_HALF)
    half_mask = cols < HALF
    # Every load is issued before the reduction (loads are not moved across its barrier).
    w1 = tl.load(w_ptr + cols, mask=half_mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + cols, mask=half_mask, other=0.0).to(tl.float32)
    x1 = tl.load(row_ptr + cols, mask=half_mask, other=0.0).to(tl.float32)
    x2 = tl.load(row_ptr + HALF + cols, mask=half_mask, other=0.0).to(tl.float32)
    row = tl.load(row_ptr + d, mask=d < head_dim, other=0.0).to(tl.float32)
    # The whole row reduced as one [BLOCK_D] vector, and the factors applied in rmsnorm_row_weighted's
    # order (row * rsqrt(var + eps) * w): the bits of the separate rmsnorm kernel.
    inv_rms = tl.rsqrt(tl.sum(row * row, axis=0) / head_dim + eps)
    dtype = row_ptr.dtype.element_ty
    n1 = (x1 * inv_rms * w1).to(dtype).to(tl.float32)
    n2 = (x2 * inv_rms * w2).to(dtype).to(tl.float32)
    return n1 * cos - n2 * sin, n2 * cos + n1 * sin


@triton.jit
def _qk_norm_rope_store_kv_kernel(
    positions_ptr,
    slot_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    q_norm_ptr,
    k_norm_ptr,
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
    head_dim,
    eps,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    pdl.begin(PDL)
    # grid (T, Hq + Hk): one head per program; heads below num_q_heads are q heads (written in place),
    # the others are KV heads (rotated k and the untouched v written to the token's cache slot).
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_HALF)
    half_mask = cols < HALF
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + cols, mask=half_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + cols, mask=half_mask, other=0.0)
    if head < num_q_heads:
        row = q_ptr + token * stride_qt + head * stride_qh
        r1, r2 = _normed_rotated_head(row, q_norm_ptr, cos, sin, head_dim, eps, HALF, BLOCK_D, BLOCK_HALF)
        tl.store(row + cols, r1.to(q_ptr.dtype.element_ty), mask=half_mask)
        tl.store(row + HALF + cols, r2.to(q_ptr.dtype.element_ty), mask=half_mask)
    else:
        kv_head = head - num_q_heads
        slot = tl.load(slot_ptr + token).to(tl.int64)
        # A negative slot marks a padding token: nothing is stored for it.
        mask = half_mask & ((cols * 0 + slot) >= 0)
        row = k_ptr + token * stride_kt + kv_head * stride_kh
        r1, r2 = _normed_rotated_head(row, k_norm_ptr, cos, sin, head_dim, eps, HALF, BLOCK_D, BLOCK_HALF)
        v_row = v_ptr + token * stride_vt + kv_head * stride_vh
        v1 = tl.load(v_row + cols, mask=mask)
        v2 = tl.load(v_row + HALF + cols, mask=mask)
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_head * stride_ch + cols
        k_dtype = k_ptr.dtype.element_ty
        cache_dtype = k_cache_ptr.dtype.element_ty
        tl.store(k_cache_ptr + dst, r1.to(k_dtype).to(cache_dtype), mask=mask)
        tl.store(k_cache_ptr + dst + HALF, r2.to(k_dtype).to(cache_dtype), mask=mask)
        tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_qk_norm_weights(head_dim: int, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor) -> None:
    """Raises ValueError unless both norm weights are contiguous [head_dim] vectors."""
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight.shape != (head_dim,) or weight.stride(-1) != 1:
            raise ValueError(
                f"the per-head q/k norm needs {name} of shape ({head_dim},) (one weight per head_dim "
                f"column, contiguous); got {tuple(weight.shape)} with strides {weight.stride()}"
            )


def qk_norm_rope_store_kv_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Triton qk_norm_rope_store_kv_ref (same shapes and dtypes). q, k, v may be strided views of a fused
    qkv output with a contiguous last dim; q is normalised and rotated in place and returned, k and v
    are only read, the caches are written at slot_mapping (negative slots skipped).

    Raises ValueError as rope_store_kv does, or when a norm weight is not a contiguous [head_dim]."""
    check_rope_store_kv_args(q, k, v, cos_sin_cache, k_cache, v_cache)
    head_dim = q.shape[-1]
    check_qk_norm_weights(head_dim, q_norm_weight, k_norm_weight)
    if q.shape[0] == 0:
        return q
    half = head_dim // 2
    block_d, num_warps = _launch_config(head_dim)
    _qk_norm_rope_store_kv_kernel[(q.shape[0], q.shape[1] + k.shape[1])](
        positions,
        slot_mapping,
        q,
        k,
        v,
        q_norm_weight,
        k_norm_weight,
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
        head_dim,
        eps,
        HALF=half,
        BLOCK_D=block_d,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=num_warps,
        **pdl.launch(q.device),
    )
    return q
