"""DeepSeek-V3's router and group-limited top-k in one launch: float32 logits x @ gate.T (gate float32
[E, H], as the checkpoint stores it) -> kernels/grouped_topk.py's routing.

For decode-sized steps, where the unfused route is three launch-bound kernels (x cast to float32,
the float32 router GEMM, the grouped top-k). Program (t, b) computes expert rows b * BLOCK_R .. of
token t's logits (kernels/moe_router.router_rows: float32 multiply-adds in a fixed order) into a
float32 scratch row; the token's last program to arrive routes the whole row with the grouped top-k
kernel's own grouped_topk_of_row, so ids and weights are that kernel's on the same logits. The
logits are float32 sums in another order than the cuBLAS GEMM's, so a near-tie may route
differently from the unfused path, as two GEMMs' results may; every rank runs the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.grouped_topk import experts_per_group, grouped_topk_of_row, grouped_topk_ref
from tpfuse.kernels.moe_router import (
    MAX_EXPERTS,
    ROUTE_TILES,
    RouteTile,
    last_to_arrive,
    route_buffers,
    router_rows,
)


def grouped_route_ref(x, gate, bias, top_k, num_groups, topk_groups, norm_topk_prob, scaling):
    """x [T, H], gate [E, H], bias [E] or None -> (weights [T, k], ids [T, k] int32): grouped_topk_ref
    of the logits x @ gate.T in float32 (float64 for float64 inputs)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = x.to(compute) @ gate.to(compute).T
    return grouped_topk_ref(logits, bias, top_k, num_groups, topk_groups, norm_topk_prob, scaling)


@triton.jit
def _grouped_route_kernel(
    x_ptr, gate_ptr, bias_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr, hidden, stride_x, stride_g,
    scaling,
    NUM_GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr,
    NORM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):  # fmt: skip
    num_experts: tl.constexpr = NUM_GROUPS * PER_GROUP
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_experts
    logits = router_rows(x_ptr, gate_ptr, token, rows, row_ok, hidden, stride_x, stride_g, BLOCK_H, PDL)
    tl.store(logits_ptr + token * num_experts + rows, logits, mask=row_ok)
    counter = counter_ptr + token
    if last_to_arrive(counter):
        tl.debug_barrier()
        weights, ids, slots = grouped_topk_of_row(
            logits_ptr + token * num_experts, bias_ptr, HAS_BIAS, NUM_GROUPS, PER_GROUP, TOPK_GROUPS, TOP_K,
            NORM, BLOCK_G, BLOCK_P, BLOCK_K, ".cg",
        )  # fmt: skip
        tl.store(weights_ptr + token * TOP_K + slots, weights * scaling, mask=slots < TOP_K)
        tl.store(ids_ptr + token * TOP_K + slots, ids, mask=slots < TOP_K)
        tl.atomic_xchg(counter, 0)


def grouped_route_triton(
    x: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    norm_topk_prob: bool,
    scaling: float,
    tile: RouteTile = ROUTE_TILES[0],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton grouped_route_ref: new [T, k] float32 weights and int32 ids. x [T, H] with unit column
    stride (any float dtype), gate [E, H] float32, bias [E] float32 or None; tile: the launch shape
    (any gives the same result). Raises ValueError on shapes, on a group split grouped_topk refuses,
    and for E > MAX_EXPERTS."""
    num_tokens, hidden = x.shape
    num_experts = gate.shape[0]
    if gate.dim() != 2 or gate.shape[1] != hidden or gate.dtype != torch.float32:
        raise ValueError(
            f"grouped_route: x {list(x.shape)} and gate {list(gate.shape)} {gate.dtype} disagree "
            "(the gate must be float32 [E, H])"
        )
    if bias is not None and (bias.shape != (num_experts,) or bias.dtype != torch.float32):
        raise ValueError(
            f"grouped_route: bias {list(bias.shape)} {bias.dtype} must be float32 [{num_experts}]"
        )
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"grouped_route needs E ({num_experts}) <= {MAX_EXPERTS}")
    per_group = experts_per_group(num_experts, top_k, num_groups, topk_groups)
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate = gate.contiguous()
    weights, ids, logits, counters = route_buffers(x, num_experts, top_k)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(num_experts, tile.rows))
        _grouped_route_kernel[grid](
            x, gate, bias if bias is not None else gate, logits, counters, weights, ids, hidden, x.stride(0),
            gate.stride(0), float(scaling),
            NUM_GROUPS=num_groups, PER_GROUP=per_group, TOPK_GROUPS=topk_groups, TOP_K=top_k,
            NORM=norm_topk_prob, HAS_BIAS=bias is not None, BLOCK_R=tile.rows,
            BLOCK_H=min(triton.next_power_of_2(hidden), 1024), BLOCK_G=triton.next_power_of_2(num_groups),
            BLOCK_P=triton.next_power_of_2(per_group), BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=tile.num_warps, **pdl.launch(x.device),
        )  # fmt: skip
    return weights, ids
