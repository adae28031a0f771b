"""Rotary position embedding (neox layout: rotate the two halves of each head), with llama3 scaling."""

from __future__ import annotations

import math

import torch


def rope_cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, scaling: dict | None = None
) -> torch.Tensor:
    """Returns [max_positions, head_dim] float32: cos in the first half, sin in the second.

    scaling: a Hugging Face `rope_scaling` dict; None, type "default" and type "llama3" are supported.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "llama3":
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
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: default, llama3")
    t = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


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
