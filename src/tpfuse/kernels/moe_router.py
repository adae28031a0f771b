"""MoE router and top-k in one launch: x [T, H] . gate [E, H] -> softmax -> the k largest experts.

For decode-sized steps, where the router GEMV (a few hundred kilobytes) and the top-k kernel are
two launch-bound kernels of a couple of microseconds each. Program (t, b) computes expert rows
b * BLOCK_R .. of token t's logits (multiply-adds in float32, one reduction), rounds them to x's
dtype as the router linear does, and stores them to a float32 scratch row; the last program of the
token to arrive (an arrival counter per token, reset to 0 by it) reads the whole row and picks the
top k exactly as kernels/moe_routing.py does. Same results as moe_topk(x @ gate.T): ties go to the
lower expert id, each logit is summed in a fixed order, so nothing depends on arrival order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.decode_merge import arrival_counters
from tpfuse.kernels.moe_routing import MAX_EXPERTS, moe_topk_ref, topk_of_row

MAX_TOKENS = 64  # beyond this the router is a GEMM: the unfused linear + top-k runs


@dataclass(frozen=True)
class RouteTile:
    """Launch shape: experts per program and warps per program. One warp keeps every reduction of
    the top-k tail (which the last program runs alone) in warp shuffles."""

    rows: int = 1
    num_warps: int = 1

    def label(self) -> str:
        return f"route {self.rows} rows w{self.num_warps}"


ROUTE_TILES = (RouteTile(1, 1), RouteTile(2, 1), RouteTile(2, 4), RouteTile(4, 4))


def moe_route_ref(
    x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], gate [E, H] -> (topk_weights [T, k] float32, topk_ids [T, k] int32): the logits
    x @ gate.T rounded to x.dtype (float64 for float64 inputs), then moe_topk_ref."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = (x.to(compute) @ gate.to(compute).T).to(x.dtype)
    return moe_topk_ref(logits, top_k, renormalize)


@triton.jit
def router_rows(x_ptr, gate_ptr, token, rows, row_ok, hidden, stride_x, stride_g, BLOCK_H: tl.constexpr,
                PDL: tl.constexpr):  # fmt: skip
    """float32 sums [BLOCK_R] of token's x row against the router rows `rows` (masked by row_ok),
    multiply-adds in float32 in a fixed order. The first step's router weights load before the PDL
    wait (no kernel writes them)."""
    hs = tl.arange(0, BLOCK_H)
    gate_rows = gate_ptr + rows[:, None].to(tl.int64) * stride_g
    w = tl.load(gate_rows + hs[None, :], mask=row_ok[:, None] & (hs < hidden)[None, :], other=0.0)
    pdl.begin(PDL)
    xh = tl.load(x_ptr + token * stride_x + hs, mask=hs < hidden, other=0.0).to(tl.float32)
    acc = w.to(tl.float32) * xh[None, :]
    for h0 in range(BLOCK_H, hidden, BLOCK_H):
        h_ok = hs + h0 < hidden
        xh = tl.load(x_ptr + token * stride_x + h0 + hs, mask=h_ok, other=0.0).to(tl.float32)
        w = tl.load(gate_rows + h0 + hs[None, :], mask=row_ok[:, None] & h_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * xh[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def last_to_arrive(counter):
    """Whether this program is the last of its grid row (axis 1) to pass here: every program's stores
    before it are visible to the last one, which must reset the counter to 0 for the next launch."""
    tl.debug_barrier()  # every thread's stores issued before the release below
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    return arrived == tl.num_programs(1) - 1


@triton.jit
def _moe_route_kernel(
    x_ptr, gate_ptr, logits_ptr, counter_ptr, weights_ptr, ids_ptr, hidden, num_experts, stride_x, stride_g,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_experts
    sums = router_rows(x_ptr, gate_ptr, token, rows, row_ok, hidden, stride_x, stride_g, BLOCK_H, PDL)
    logit = sums.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + token * num_experts + rows, logit, mask=row_ok)
    counter = counter_ptr + token
    if last_to_arrive(counter):
        tl.debug_barrier()
        cols = tl.arange(0, BLOCK_E)
        valid = cols < num_experts
        row = tl.load(logits_ptr + token * num_experts + cols, mask=valid, other=-float("inf"),
                      cache_modifier=".cg")  # fmt: skip
        top_w, top_id, ks = topk_of_row(row, valid, cols, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
        tl.store(weights_ptr + token * TOP_K + ks, top_w, mask=ks < TOP_K)
        tl.store(ids_ptr + token * TOP_K + ks, top_id, mask=ks < TOP_K)
        tl.atomic_xchg(counter, 0)


def route_buffers(x: torch.Tensor, num_experts: int, top_k: int):
    """The outputs and scratch of a one-launch router for x [T, H]: new (weights [T, k] float32, ids
    [T, k] int32, logits scratch [T, E] float32, the arrival counters of decode_merge)."""
    num_tokens = x.shape[0]
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    return weights, ids, logits, arrival_counters(x.device, max(num_tokens, 1))


def moe_route_triton(
    x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool, tile: RouteTile = ROUTE_TILES[0]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton moe_route_ref (float32 sums and softmax): new [T, k] float32 weights and int32 ids.
    x [T, H] with unit column stride, gate [E, H] contiguous, same dtype; tile: the launch shape (any
    gives the same result). Raises ValueError on shapes and unless 1 <= top_k <= E <= MAX_EXPERTS."""
    num_tokens, hidden = x.shape
    num_experts = gate.shape[0]
    if gate.dim() != 2 or gate.shape[1] != hidden or gate.dtype != x.dtype:
        raise ValueError(
            f"moe_route: x {list(x.shape)} {x.dtype} and gate {list(gate.shape)} {gate.dtype} disagree"
        )
    if not 1 <= top_k <= num_experts or num_experts > MAX_EXPERTS:
        raise ValueError(f"moe_route needs 1 <= top_k ({top_k}) <= E ({num_experts}) <= {MAX_EXPERTS}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate = gate.contiguous()
    weights, ids, logits, counters = route_buffers(x, num_experts, top_k)
    if num_tokens:
        block_e = max(triton.next_power_of_2(num_experts), 16)
        grid = (num_tokens, triton.cdiv(num_experts, tile.rows))
        _moe_route_kernel[grid](
            x, gate, logits, counters, weights, ids, hidden, num_experts, x.stride(0), gate.stride(0),
            TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_R=tile.rows,
            BLOCK_H=min(triton.next_power_of_2(hidden), 1024), BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=tile.num_warps,
            **pdl.launch(x.device),
        )  # fmt: skip
    return weights, ids
