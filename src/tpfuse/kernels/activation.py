"""SiLU-and-mul, the gated MLP activation: silu(gate) * up; for one row also as the f16x2 INT4 GEMV's
operands (kernels/quant_int_half2.py's Half2X) of the same rounded values."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.quant_int_half2 import Half2X, check_holds, empty_half2x, half2_x, store_half2x


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] (gate then up). Returns a new [T, I] tensor of x.dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def silu_and_mul_half2x_ref(x: torch.Tensor) -> Half2X:
    """silu_and_mul_ref of one row (x [1, 2 * I], I a multiple of 32) as Half2X."""
    return half2_x(silu_and_mul_ref(x))


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, inter, pairs_ptr, stats_ptr, BLOCK: tl.constexpr,
    HALF2X: tl.constexpr,  # one row written as Half2X (pairs_ptr, stats_ptr; BLOCK a multiple of 32)
    PDL: tl.constexpr,
):  # fmt: skip
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    if HALF2X:
        rounded = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        first_vector = tl.program_id(1) * (BLOCK // 32)
        store_half2x(rounded, pairs_ptr, stats_ptr, first_vector, inter // 32, BLOCK)
    else:
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_launch(
    x: torch.Tensor, block: int | None = None, num_warps: int = 4, half2x: bool = False
) -> torch.Tensor | Half2X:
    """silu_and_mul_triton with an explicit tile (columns per program) and num_warps (benchmarks), with
    half2x the one row as Half2X (silu_and_mul_half2x_triton). The default tile, 1024 columns over 4
    warps, gives each thread 8 values: one 16-byte bf16 access."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs [T, 2 * I] (gate then up); got last dim {x.shape[-1]}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    inter = x.shape[-1] // 2
    block = block or min(triton.next_power_of_2(inter), 1024)
    if half2x:
        check_holds(x.shape[0], inter, x.dtype)
        if block % 32:
            raise ValueError(f"SiLU-and-mul writes Half2X a 32-value vector at a time; got {block} columns")
        result = out = empty_half2x(inter, x.dtype, x.device)
        args = (x, x, x.stride(0), 0, inter, out.pairs, out.stats)
    else:
        result = out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
        args = (x, out, x.stride(0), out.stride(0), inter, out, out)
    if x.shape[0] == 0:
        return result
    grid = (x.shape[0], triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](*args, BLOCK=block, HALF2X=half2x, num_warps=num_warps, **pdl.launch(x.device))
    return result


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton silu_and_mul_ref. x: [T, 2 * I] (gate then up, last dim contiguous).
    Returns a new [T, I] tensor of x.dtype. Raises ValueError on an odd last dim."""
    return silu_and_mul_launch(x)


def silu_and_mul_half2x_triton(x: torch.Tensor) -> Half2X:
    """Triton silu_and_mul_half2x_ref, one launch: the operands half2_x makes of silu_and_mul_triton's
    row, bit for bit (the sums to rounding). Raises ValueError for more than one row, I not a multiple
    of 32, or fp32 x."""
    return silu_and_mul_launch(x, half2x=True)
