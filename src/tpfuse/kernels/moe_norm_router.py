"""The post-attention residual add + RMSNorm fused into the MoE router product (decode-sized steps).

At TP = 1 a MoE layer's feed-forward half starts with three small launches: add + RMSNorm, the router
GEMV (E x H, a few hundred kilobytes) and the top-k. Here program (t, b) forms token t's new residual
and its normed row itself (kernels/rmsnorm.py's float32 formula and roundings; the sum of squares in
the order of this launch's warps, so on a GPU the normed row may differ from fused_add_rmsnorm's by a
bf16 ulp, the new residual not at all), writes both from its first expert block, and multiplies the
normed row by router rows b * BLOCK_R ..; the logits are rounded to the activation dtype, as the
router linear's output is. Every program recomputes the norm (two H-long rows from L2), which costs
less than the launch it removes. The top-k then runs inside the experts' first kernel
(kernels/fused_moe_gemv.py, routed slots), so the layer's three launches become one. The whole row
is held in registers: H <= MAX_HIDDEN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.rmsnorm import fused_add_rmsnorm_ref, rmsnorm_row_weighted

MAX_HIDDEN = 8192
MAX_TOKENS = 64  # decode-sized steps only: above it the norm is recomputed by too many programs


@dataclass(frozen=True)
class NormRouterTile:
    """Launch shape: router rows (experts) per program and warps per program."""

    rows: int = 2
    num_warps: int = 4

    def label(self) -> str:
        return f"norm + router {self.rows} rows w{self.num_warps}"


NORM_ROUTER_TILES = (NormRouterTile(2, 4), NormRouterTile(1, 4), NormRouterTile(4, 4), NormRouterTile(4, 8))


def moe_norm_router_ref(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, gate: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual [T, H], norm_weight [H], gate [E, H] -> (normed [T, H], new_residual [T, H], logits
    [T, E] float32): fused_add_rmsnorm_ref, then normed @ gate.T in float32 (float64 for float64 inputs)
    rounded to x.dtype."""
    normed, new_residual = fused_add_rmsnorm_ref(x, residual, norm_weight, eps)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = (normed.to(compute) @ gate.to(compute).T).to(x.dtype).to(compute)
    return normed, new_residual, logits


@triton.jit
def _moe_norm_router_kernel(
    x_ptr, res_ptr, norm_w_ptr, gate_ptr, out_ptr, new_res_ptr, logits_ptr,
    hidden, num_experts, stride_x, stride_res, stride_g, eps,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_experts
    hs = tl.arange(0, BLOCK_H)
    h_ok = hs < hidden
    # Router rows and the norm weight load before the PDL wait: no kernel writes them.
    gate = tl.load(gate_ptr + rows[:, None].to(tl.int64) * stride_g + hs[None, :],
                   mask=row_ok[:, None] & h_ok[None, :], other=0.0)  # fmt: skip
    norm_w = tl.load(norm_w_ptr + hs, mask=h_ok, other=0.0).to(tl.float32)
    pdl.begin(PDL)
    xs = tl.load(x_ptr + token * stride_x + hs, mask=h_ok, other=0.0).to(tl.float32)
    rs = tl.load(res_ptr + token * stride_res + hs, mask=h_ok, other=0.0).to(tl.float32)
    summed = (xs + rs).to(new_res_ptr.dtype.element_ty)  # the rounded sum is the new residual
    normed = rmsnorm_row_weighted(summed.to(tl.float32), norm_w, hidden, eps).to(out_ptr.dtype.element_ty)
    if block == 0:
        tl.store(new_res_ptr + token * hidden + hs, summed, mask=h_ok)
        tl.store(out_ptr + token * hidden + hs, normed, mask=h_ok)
    logit = tl.sum(gate.to(tl.float32) * normed.to(tl.float32)[None, :], axis=1)
    logit = logit.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + token * num_experts + rows, logit, mask=row_ok)


def moe_norm_router_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    gate: torch.Tensor,
    eps: float,
    tile: NormRouterTile = NORM_ROUTER_TILES[0],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton moe_norm_router_ref (float32 sums): new normed and new_residual [T, H] of x.dtype and
    logits [T, E] float32. x, residual [T, H] with unit column stride; gate [E, H]; tile: the launch
    shape (any gives the same result). Raises ValueError on shapes or dtypes that disagree, or
    H > MAX_HIDDEN."""
    num_tokens, hidden = x.shape
    if (
        residual.shape != x.shape
        or norm_weight.shape != (hidden,)
        or gate.dim() != 2
        or gate.shape[1] != hidden
        or gate.dtype != x.dtype
    ):
        raise ValueError(
            f"moe_norm_router: x {list(x.shape)} {x.dtype}, residual {list(residual.shape)}, norm weight "
            f"{list(norm_weight.shape)} and gate {list(gate.shape)} {gate.dtype} disagree"
        )
    if hidden > MAX_HIDDEN:
        raise ValueError(f"moe_norm_router holds a row in registers: hidden {hidden} > {MAX_HIDDEN}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    gate = gate.contiguous()
    normed = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(normed)
    logits = torch.empty(num_tokens, gate.shape[0], dtype=torch.float32, device=x.device)
    if num_tokens:
        _moe_norm_router_kernel[(num_tokens, triton.cdiv(gate.shape[0], tile.rows))](
            x, residual, norm_weight, gate, normed, new_residual, logits,
            hidden, gate.shape[0], x.stride(0), residual.stride(0), gate.stride(0), eps,
            BLOCK_R=tile.rows, BLOCK_H=triton.next_power_of_2(hidden), num_warps=tile.num_warps,
            **pdl.launch(x.device),
        )  # fmt: skip
    return normed, new_residual, logits
