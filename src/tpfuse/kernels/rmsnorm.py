"""RMSNorm and fused residual add + RMSNorm.

Numerics (shared with the fused all-reduce epilogue in tpfuse.comm, so TP and TP=1 agree):
the sum x + residual is formed in float32 and rounded once to the activation dtype; that rounded
value is the new residual, and the norm is computed from it in float32, multiplied by the weight in
float32, and rounded once. This is what transformers' Llama does in float32 and matches it to
rounding in bfloat16. The fused form may write the normed rows as FP8 rows instead
(kernels/fp8_rows.py): the same rounded rows, quantized as the W8A8 product would quantize them; or a
single row as the f16x2 INT4 GEMV's operands (kernels/quant_int_half2.py's Half2X) of the same
rounded row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.fp8_rows import Fp8Rows, store_scales_of_row
from tpfuse.kernels.quant_int_half2 import Half2X, check_holds, empty_half2x, half2_x, store_half2x


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


def fused_add_rmsnorm_fp8_rows_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int
) -> tuple[Fp8Rows, torch.Tensor]:
    """fused_add_rmsnorm_ref with the normed rows then quantized `group` columns a scale
    (kernels/fp8_rows.py): (Fp8Rows [T, H], new_residual [T, H] of x.dtype)."""
    from tpfuse.kernels.quant_fp8_w8a8 import quantize_fp8_rows_ref

    normed, new_residual = fused_add_rmsnorm_ref(x, residual, weight, eps)
    data, scales = quantize_fp8_rows_ref(normed, group)
    return Fp8Rows(data.contiguous(), scales.contiguous(), x.dtype, group), new_residual


def fused_add_rmsnorm_half2x_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Half2X, torch.Tensor]:
    """fused_add_rmsnorm_ref of one row (x, residual [1, H], H a multiple of 32) with the normed row
    as kernels/quant_int_half2.py's Half2X: (Half2X, new_residual [1, H] of x.dtype)."""
    normed, new_residual = fused_add_rmsnorm_ref(x, residual, weight, eps)
    return half2_x(normed), new_residual


@triton.jit
def rmsnorm_row_weighted(row_f32, w_f32, hidden, eps):
    """The norm of one float32 row (masked lanes must hold 0) times the float32 weight, in float32."""
    var = tl.sum(row_f32 * row_f32, axis=0) / hidden
    return row_f32 * tl.rsqrt(var + eps) * w_f32


@triton.jit
def rmsnorm_row(row_f32, w_ptr, cols, mask, hidden, eps):
    """rmsnorm_row_weighted with the weight loaded here.

    Shared with the fused all-reduce epilogue (tpfuse.comm) so that TP and TP=1 give the same bits."""
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return rmsnorm_row_weighted(row_f32, w, hidden, eps)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, hidden, eps, BLOCK_H: tl.constexpr,
                    PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    # The weight is loaded up front: loads are not moved across the reduction's barrier.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl.begin(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = rmsnorm_row_weighted(x, w, hidden, eps)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    scales_ptr,
    pairs_ptr,
    stride_x,
    stride_res,
    stride_out,
    hidden,
    eps,
    BLOCK_H: tl.constexpr,
    FP8_GROUP: tl.constexpr,  # > 0: out e4m3, scales_ptr [T, cdiv(hidden, FP8_GROUP)] (kernels/fp8_rows.py)
    HALF2X: tl.constexpr,  # one row written as Half2X (pairs_ptr, scales_ptr its stats), not out
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    # The weight is loaded up front: loads are not moved across the reduction's barrier.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl.begin(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    # The rounded sum is the new residual; the norm is taken from the rounded value, not the fp32 sum.
    s = (x + r).to(new_res_ptr.dtype.element_ty)
    tl.store(new_res_ptr + row * stride_out + cols, s, mask=mask)
    y = rmsnorm_row_weighted(s.to(tl.float32), w, hidden, eps)
    if HALF2X:  # the row rounded to the activation dtype, as half2_x would read it
        rounded = y.to(new_res_ptr.dtype.element_ty).to(tl.float32)
        store_half2x(rounded, pairs_ptr, scales_ptr, 0, hidden // 32, BLOCK_H)
    else:
        if FP8_GROUP:  # the row rounded to the activation dtype, as quantize_fp8_rows would read it
            rounded = y.to(new_res_ptr.dtype.element_ty).to(tl.float32)
            y = store_scales_of_row(rounded, scales_ptr, row, hidden, FP8_GROUP)
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"rmsnorm expects x [T, H] and weight [H]; got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch_config(hidden: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps): one program per row; 8 bf16 (16 bytes) or more per thread and access."""
    block = triton.next_power_of_2(hidden)
    return block, min(max(block // 512, 1), 16)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton rmsnorm_ref. x: [T, H] (last dim contiguous); weight: [H]. Returns a new [T, H] of x.dtype.

    Raises ValueError when the shapes do not match."""
    x = _check_rows(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block, warps = _launch_config(x.shape[1])
    _rmsnorm_kernel[(x.shape[0],)](
        x,
        weight,
        out,
        x.stride(0),
        out.stride(0),
        x.shape[1],
        eps,
        BLOCK_H=block,
        num_warps=warps,
        **pdl.launch(x.device),
    )
    return out


def fused_add_rmsnorm_launch(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    num_warps: int | None = None,
    fp8_group: int | None = None,
    half2x: bool = False,
) -> tuple[torch.Tensor | Fp8Rows | Half2X, torch.Tensor]:
    """fused_add_rmsnorm_triton with an explicit num_warps (benchmarks; None takes the default), with
    fp8_group the normed rows as Fp8Rows of that group (fused_add_rmsnorm_fp8_rows_triton), with half2x
    the one normed row as Half2X (fused_add_rmsnorm_half2x_triton)."""
    x = _check_rows(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must have the shape of x {tuple(x.shape)}")
    residual = _check_rows(residual, weight)
    num_rows, hidden = x.shape
    block, warps = _launch_config(hidden)
    kernel_group = 0 if fp8_group is None else fp8_kernel_group(fp8_group, hidden, block)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if half2x:
        check_holds(num_rows, hidden, x.dtype)
        normed = out = empty_half2x(hidden, x.dtype, x.device)
        scales, pairs = out.stats, out.pairs
    else:
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn if fp8_group else x.dtype, device=x.device)
        scales = pairs = new_residual
        normed = out
    if fp8_group is not None:
        scales = torch.empty((num_rows, -(-hidden // fp8_group)), dtype=torch.float32, device=x.device)
        normed = Fp8Rows(out, scales, x.dtype, fp8_group)
    if num_rows == 0:
        return normed, new_residual
    _fused_add_rmsnorm_kernel[(num_rows,)](
        x,
        residual,
        weight,
        new_residual if half2x else out,
        new_residual,
        scales,
        pairs,
        x.stride(0),
        residual.stride(0),
        new_residual.stride(0),
        hidden,
        eps,
        BLOCK_H=block,
        FP8_GROUP=kernel_group,
        HALF2X=half2x,
        num_warps=num_warps or warps,
        **pdl.launch(x.device),
    )
    return normed, new_residual


def fp8_kernel_group(group: int, hidden: int, block: int) -> int:
    """The in-kernel group (a power of two dividing the row's block) of FP8 rows of `group` columns:
    the whole block where the group spans the row. Raises ValueError for a group that is neither."""
    if group >= hidden:
        return block
    if group & (group - 1) or block % group:
        raise ValueError(f"FP8 rows take one scale a row or a power-of-two group of columns; got {group}")
    return group


def fused_add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton fused_add_rmsnorm_ref. x, residual: [T, H]; weight: [H].

    Returns (normed, new_residual), both new [T, H] tensors of x.dtype; inputs are not modified.
    Raises ValueError when the shapes do not match."""
    return fused_add_rmsnorm_launch(x, residual, weight, eps)


def fused_add_rmsnorm_fp8_rows_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int
) -> tuple[Fp8Rows, torch.Tensor]:
    """Triton fused_add_rmsnorm_fp8_rows_ref, one launch: (Fp8Rows [T, H], new_residual [T, H]), new
    tensors; the same bits as fused_add_rmsnorm_triton followed by quantize_fp8_rows_triton on a GPU."""
    return fused_add_rmsnorm_launch(x, residual, weight, eps, fp8_group=group)


def fused_add_rmsnorm_half2x_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Half2X, torch.Tensor]:
    """Triton fused_add_rmsnorm_half2x_ref, one launch: (Half2X, new_residual [1, H]); the operands
    half2_x makes of fused_add_rmsnorm_triton's normed row, bit for bit (the sums to rounding). Raises
    ValueError for more than one row, H not a multiple of 32, or fp32 x."""
    return fused_add_rmsnorm_launch(x, residual, weight, eps, half2x=True)
