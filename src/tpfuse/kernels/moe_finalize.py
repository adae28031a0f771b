"""MoE finalize at TP = 1: the weighted top-k combine fused with the residual add and RMSNorm.

slot_out [T * k, H] holds each token's k weighted expert outputs (kernels/fused_moe.py,
expert_slot_outputs), and shared [T, H], where given, one more output per token (DeepSeek-V3's
shared experts). One program per token sums its k rows, the shared row and the residual in float32,
in that order, rounds once to the activation dtype (the new residual) and norms that rounded row as
kernels/rmsnorm.py does. It replaces the combine kernel plus fused_add_rmsnorm (one [T, H] write and
read and one launch fewer); the plain path rounds the combined sum before adding the residual, this
one rounds once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.rmsnorm import rmsnorm_ref, rmsnorm_row_weighted


def moe_finalize_ref(
    slot_out: torch.Tensor,
    top_k: int,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    shared: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """slot_out [T * k, H], residual [T, H], weight [H], shared [T, H] or None -> (normed,
    new_residual), both new [T, H] of residual.dtype; sums in float32 (float64 for float64 inputs)."""
    compute = torch.float64 if residual.dtype == torch.float64 else torch.float32
    rows = slot_out.view(-1, top_k, slot_out.shape[-1]).to(compute).sum(dim=1)
    if shared is not None:
        rows = rows + shared.to(compute)
    new_residual = (rows + residual.to(compute)).to(residual.dtype)
    return rmsnorm_ref(new_residual, weight, eps), new_residual


@triton.jit
def _moe_finalize_kernel(
    slot_ptr,
    shared_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    hidden,
    eps,
    TOP_K: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # before the wait: no kernel writes it
    pdl.begin(PDL)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(slot_ptr + (row * TOP_K + j) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    acc += tl.load(res_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    s = acc.to(new_res_ptr.dtype.element_ty)
    tl.store(new_res_ptr + row * hidden + cols, s, mask=mask)
    y = rmsnorm_row_weighted(s.to(tl.float32), w, hidden, eps)
    tl.store(out_ptr + row * hidden + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def moe_finalize_triton(
    slot_out: torch.Tensor,
    top_k: int,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    shared: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton moe_finalize_ref (float32 sums). All tensors contiguous; raises ValueError on shapes."""
    num_tokens, hidden = residual.shape
    shared_fits = shared is None or shared.shape == residual.shape
    if slot_out.shape != (num_tokens * top_k, hidden) or weight.shape != (hidden,) or not shared_fits:
        raise ValueError(
            f"moe_finalize: slot_out {list(slot_out.shape)}, residual {list(residual.shape)}, "
            f"weight {list(weight.shape)}, top_k {top_k}"
            + ("" if shared is None else f" and shared {list(shared.shape)}")
            + " disagree"
        )
    residual = residual.contiguous()
    out, new_residual = torch.empty_like(residual), torch.empty_like(residual)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        _moe_finalize_kernel[(num_tokens,)](
            slot_out.contiguous(), residual if shared is None else shared.contiguous(), residual, weight, out,
            new_residual, hidden, eps, TOP_K=top_k, HAS_SHARED=shared is not None, BLOCK_H=block,
            num_warps=min(max(block // 512, 1), 16),
            **pdl.launch(residual.device),
        )  # fmt: skip
    return out, new_residual
