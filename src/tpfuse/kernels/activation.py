"""SiLU-and-mul, the gated MLP activation: silu(gate) * up."""

from __future__ import annotations

import torch


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] (gate then up). Returns a new [T, I] tensor of x.dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
