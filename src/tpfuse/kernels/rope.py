"""Rotary position embedding (neox layout: rotate the two halves of each head); llama3 and YaRN scaling."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


def rope_cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict | None = None
) -> torch.Tensor:
    """Returns [max_positions, head_dim] float32: cos in the first half, sin in the second.

    scaling: a Hugging Face `rope_scaling` dict; None, type "default", "llama3" and "yarn" are supported
    (YaRN's attention factor multiplies cos and sin, as transformers applies it).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    attention_factor = 1.0
    if kind == "yarn":
        inv_freq, attention_factor = yarn_inv_freq(head_dim, theta, scaling)
    elif kind == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling.get("low_freq_factor", 1.0)
        high_freq_factor = scaling.get("high_freq_factor", 4.0)
        old_context = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind != "default":
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: default, llama3, yarn")
    t = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor).float()


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float64, attention factor on cos/sin) of YaRN: frequencies between the
    beta_fast and beta_slow rotation counts blend from extrapolated to interpolated (divided by factor)."""
    factor = scaling["factor"]
    old_context = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return extrapolated / factor * ramp + extrapolated * keep, float(attention_factor)


def rope_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int; q: [T, Hq, D]; k: [T, Hk, D]. Rotates q and k in place and returns them."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for t in (q, k):
        x1, x2 = t[..., :half].float(), t[..., half:].float()
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        t[..., :half] = r1.to(t.dtype)
        t[..., half:] = r2.to(t.dtype)
    return q, k


@triton.jit
def _rotate_heads(
    ptr, stride_t, stride_h, num_heads, token, cos, sin,
    HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_HEADS)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (cols < HALF)[None, :]
    first = ptr + token * stride_t + heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + cols, mask=cols < HALF, other=0.0)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + cols, mask=cols < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, num_q_heads, token, cos, sin, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr, stride_kt, stride_kh, num_k_heads, token, cos, sin, HALF, BLOCK_KH, BLOCK_HALF)


def rope_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton rope_ref. positions: [T] int32/int64; q: [T, Hq, D]; k: [T, Hk, D]; cos_sin_cache:
    [max_pos, D] float32 from rope_cos_sin_cache. Rotates q and k in place (neox halves) and returns them.

    q and k may be strided views (e.g. of a fused qkv output) but their last dim must be contiguous.
    Raises ValueError on a layout it cannot write in place."""
    head_dim = q.shape[-1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError(
            "rope_triton rotates in place: q, k and the cache must be contiguous in the last dim"
        )
    if head_dim % 2 or k.shape[-1] != head_dim or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(
            f"rope needs an even head_dim shared by q {tuple(q.shape)}, k {tuple(k.shape)} and the cache "
            f"{tuple(cos_sin_cache.shape)}"
        )
    if q.shape[0] == 0:
        return q, k
    half = head_dim // 2
    _rope_kernel[(q.shape[0],)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        q.shape[1],
        k.shape[1],
        HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_QH=triton.next_power_of_2(q.shape[1]),
        BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
    )
    return q, k
