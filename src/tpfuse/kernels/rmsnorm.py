"""RMSNorm and fused residual add + RMSNorm.

Numerics (shared with the fused all-reduce epilogue in tpfuse.comm, so TP and TP=1 agree):
the sum x + residual is formed in float32 and rounded once to the activation dtype; that rounded
value is the new residual, and the norm is computed from it in float32, multiplied by the weight in
float32, and rounded once. This is what transformers' Llama does in float32 and matches it to
rounding in bfloat16.
"""

from __future__ import annotations

import torch


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H]; weight: [H]. Returns a new [T, H] tensor of x.dtype."""
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps) * weight.float()).to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H]; weight: [H]. Returns (normed, new_residual), both new tensors."""
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_ref(new_residual, weight, eps), new_residual
