"""Random quantized expert stacks for GPU kernel tests."""

from __future__ import annotations

import torch


def random_expert_stack(gen: torch.Generator, bits: int, experts: int, n: int, k: int, group=None):
    """A QuantExperts [experts, n, k] on gen's device: 4-bit codes, or FP8 e4m3 with bits 0; float32
    scales per group of k columns (None: one per row)."""
    from tpfuse.kernels import quant_fp8, quant_int, quant_moe

    device, group = gen.device, group or k
    if bits:
        values = torch.randint(0, 16, (experts, n, k), generator=gen, device=device)
        codes = torch.stack([quant_int.pack_int(v, 4) for v in values])
    else:
        codes = torch.randn(experts, n, k, generator=gen, device=device).to(quant_fp8.FP8_DTYPE)
    scales = torch.rand(experts, n, k // group, generator=gen, device=device) * 0.01 + 1e-3
    return quant_moe.QuantExperts(codes, scales, bits, group, k)
