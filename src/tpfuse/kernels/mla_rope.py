"""MLA's rotary embedding of q_pe and the shared k_pe, returned in neox order (halves), ready for the
latent cache and the absorbed attention kernels.

DeepSeek-V3 checkpoints lay the rope dims out in interleaved pairs (x0, x1), (x2, x3), ... each rotated
by one frequency (`rope_interleave`); transformers rotates the even and odd slices and concatenates
them, which is neox rotation of the de-interleaved vector. Scores are dot products over the rotated
dims, so any order works as long as q and k agree: both come out here in halves. Torch only, static
shapes (CUDA-graph safe).
"""

from __future__ import annotations

import torch


def mla_rope_ref(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; q_pe [T, H, P], k_pe [T, P] (any strides); cos_sin_cache [max_pos, P] float32
    (rope_cos_sin_cache). Returns new contiguous (q_rot [T, H, P], k_rot [T, P]) of the input dtype:
    first half x1 * cos - x2 * sin, second half x2 * cos + x1 * sin, where (x1, x2) are the even and
    odd dims (interleaved) or the two halves."""
    half = q_pe.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, :half], cs[:, half:]

    def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else (xf[..., :half], xf[..., half:])
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rotate(q_pe, cos[:, None, :], sin[:, None, :]), rotate(k_pe, cos, sin)
