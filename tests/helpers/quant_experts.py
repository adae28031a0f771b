"""Random quantized expert stacks for GPU kernel tests."""

from __future__ import annotations

import torch


def random_expert_stack(gen: torch.Generator, bits: int, experts: int, n: int, k: int, group=None,
                        row_block=1):
    """A QuantExperts [experts, n, k] on gen's device: 4-bit codes, or FP8 e4m3 with bits 0; float32
    scales per group of k columns (None: one per row), equal in runs of row_block rows."""
    from tpfuse.kernels import quant_fp8, quant_int, quant_moe

    device, group = gen.device, group or k
    if bits:
        values = torch.randint(0, 16, (experts, n, k), generator=gen, device=device)
        codes = torch.stack([quant_int.pack_int(v, 4) for v in values])
    else:
        codes = torch.randn(experts, n, k, generator=gen, device=device).to(quant_fp8.FP8_DTYPE)
    runs = -(-n // row_block)
    scales = torch.rand(experts, runs, k // group, generator=gen, device=device) * 0.01 + 1e-3
    scales = scales.repeat_interleave(row_block, 1)[:, :n].contiguous()
    return quant_moe.QuantExperts(codes, scales, bits, group, k, row_block)
