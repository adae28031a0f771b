"""SiLU-and-mul, the gated MLP activation: silu(gate) * up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] (gate then up). Returns a new [T, I] tensor of x.dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_launch(x: torch.Tensor, block: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """silu_and_mul_triton with an explicit tile (columns per program) and num_warps (benchmarks).
    The default tile, 1024 columns over 4 warps, gives each thread 8 values: one 16-byte bf16 access."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs [T, 2 * I] (gate then up); got last dim {x.shape[-1]}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    inter = x.shape[-1] // 2
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block = block or min(triton.next_power_of_2(inter), 1024)
    grid = (x.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=num_warps, **pdl.launch(x.device)
    )
    return out


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton silu_and_mul_ref. x: [T, 2 * I] (gate then up, last dim contiguous).
    Returns a new [T, I] tensor of x.dtype. Raises ValueError on an odd last dim."""
    return silu_and_mul_launch(x)
