"""Fused MoE experts: tokens grouped by expert -> gate/up GEMM + SiLU-and-mul -> down GEMM -> combine.

x [T, H]; w13 [E, 2I, H] (gate rows then up rows of each expert); w2 [E, H, I]; topk_ids / topk_weights
[T, k] from kernels/moe_routing.py. Output [T, H] = sum_j topk_weights[t, j] * expert_{ids[t, j]}(x[t]),
this rank's partial sum when I is a tensor-parallel slice. Two routes, by the tile
(kernels/fused_moe_tiles.py): grouped GEMMs on tensor cores over tokens sorted by expert
(kernels/moe_align.py), or per-slot GEMVs for a few tokens (kernels/fused_moe_gemv.py), which may also
take the router logits and pick each slot's expert themselves (routed_slot_outputs: no top-k launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.fused_moe_gemv import routed_slot_products, slot_products
from tpfuse.kernels.fused_moe_tiles import MoeTile, default_tile, tile_for
from tpfuse.kernels.moe_align import moe_align_triton
from tpfuse.kernels.moe_routing import MAX_EXPERTS, moe_topk_ref


def fused_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    combine: bool = True,
) -> torch.Tensor:
    """The reference: per expert, its tokens' GEMMs in float32 (float64 for float64 inputs), the
    SiLU-and-mul product and each weighted slot output rounded to x.dtype as the kernel stores them,
    the sum over k in float32 rounded once. combine=False returns the weighted slot outputs
    [T, k, H] of x.dtype instead (for an epilogue that sums them)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1).long()
    out = torch.zeros(num_tokens * top_k, x.shape[1], dtype=compute, device=x.device)
    xs = x.to(compute)
    for expert in torch.unique(flat_ids).tolist():
        rows = (flat_ids == expert).nonzero().squeeze(1)
        h = xs[rows // top_k] @ w13[expert].to(compute).T
        act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype).to(compute)
        out[rows] = act @ w2[expert].to(compute).T
    out = (out.view(num_tokens, top_k, -1) * topk_weights.to(compute).unsqueeze(-1)).to(x.dtype)
    if not combine:
        return out
    return out.to(compute).sum(dim=1).to(x.dtype)


GROUP_M = 8  # row blocks that sweep the column tiles together (grouped launch order)


@triton.jit
def _block_ids(num_blocks, num_cols, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program on a 1-D grid, GROUP_M row blocks at a time sweeping
    every column tile, so a group's token rows and its experts' weight tiles are reused from L2."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(num_cols, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _block_slots(block_expert_ptr, sorted_ptr, pid_m, num_slots, BLOCK_M: tl.constexpr):
    """(expert as int64, slots [BLOCK_M], row_ok [BLOCK_M]) of row block pid_m of the expert-sorted
    slot order; row_ok is False on the padding that rounds each expert's rows up to BLOCK_M."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + rows)
    return expert, slots, slots < num_slots


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_slots, num_blocks, hidden, inter, stride_x, stride_we, stride_wn, stride_act,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """act[s, n] = silu(x[t] . gate_e[n]) * (x[t] . up_e[n]) for the block's slots s = t * k + j."""
    pid_m, pid_n = _block_ids(num_blocks, inter, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, slots, row_ok = _block_slots(block_expert_ptr, sorted_ptr, pid_m, num_slots, BLOCK_M)
    tokens = tl.where(row_ok, slots // TOP_K, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_x + ks[None, :]
    w_base = w13_ptr + expert * stride_we + ks[:, None]
    g_ptrs = w_base + cols[None, :].to(tl.int64) * stride_wn
    u_ptrs = w_base + (cols[None, :] + inter).to(tl.int64) * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (ks + k0) < hidden
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        acc_g = tl.dot(a, tl.load(g_ptrs + k0, mask=w_mask, other=0.0), acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, tl.load(u_ptrs + k0, mask=w_mask, other=0.0), acc_u, input_precision=DOT_PRECISION)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out = act_ptr + slots[:, None].to(tl.int64) * stride_act + cols[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w2_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_slots, num_blocks, hidden, inter, stride_act, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """out[s, n] = weight[s] * (act[s] . down_e[n]), rounded to out's dtype."""
    pid_m, pid_n = _block_ids(num_blocks, hidden, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, slots, row_ok = _block_slots(block_expert_ptr, sorted_ptr, pid_m, num_slots, BLOCK_M)
    safe = tl.where(row_ok, slots, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + safe[:, None] * stride_act + ks[None, :]
    w_ptrs = w2_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = (ks + k0) < inter
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    weight = tl.load(weights_ptr + safe, mask=row_ok, other=0.0)
    out = out_ptr + safe[:, None] * stride_out + cols[None, :]
    tl.store(
        out, (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :]
    )


@triton.jit
def _combine_kernel(slot_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = sum_j slot_out[t * k + j], summed in float32 in slot order."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(slot_ptr + (t * TOP_K + j) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def expert_slot_outputs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tile: MoeTile | None = None,
) -> torch.Tensor:
    """The two grouped GEMMs: [T * k, H] of x.dtype, row t * k + j = topk_weights[t, j] * expert(x[t])
    for expert topk_ids[t, j] (float32 accumulation, the SiLU-and-mul product stored in x.dtype)."""
    num_tokens, top_k = topk_ids.shape
    _check_expert_shapes(x, w13, w2)
    hidden, inter = x.shape[1], w2.shape[2]
    num_slots = num_tokens * top_k
    tile = tile or default_tile(num_slots)
    slot_out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    if num_slots == 0:
        return slot_out
    x = x if x.stride(-1) == 1 else x.contiguous()
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    if tile.block_m == 1:
        slot_products(x, w13, w2, weights, topk_ids, act, slot_out, tile)
        return slot_out
    sorted_slots, block_expert, num_padded = moe_align_triton(
        topk_ids.contiguous(), w13.shape[0], tile.block_m
    )
    nb = block_expert.shape[0]
    common = dict(
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=GROUP_M,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32: no TF32 rounding
        num_stages=tile.num_stages, num_warps=tile.num_warps,
    )  # fmt: skip
    _gate_up_kernel[(nb * triton.cdiv(inter, tile.block_n),)](
        x, w13, act, sorted_slots, block_expert, num_padded,
        num_slots, nb, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, **common,
    )  # fmt: skip
    _down_kernel[(nb * triton.cdiv(hidden, tile.block_n),)](
        act, w2, slot_out, weights, sorted_slots, block_expert, num_padded,
        num_slots, nb, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), slot_out.stride(0),
        **common,
    )  # fmt: skip
    return slot_out


def _check_expert_shapes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    num_experts, two_inter, hidden = w13.shape
    if w2.shape != (num_experts, hidden, two_inter // 2) or x.shape[1] != hidden:
        raise ValueError(
            f"fused_experts: x {list(x.shape)}, w13 {list(w13.shape)}, w2 {list(w2.shape)} disagree"
        )


def routed_slot_outputs_ref(x, w13, w2, logits, top_k: int, renormalize: bool):
    """routed_slot_outputs_triton in torch: moe_topk_ref(logits), then fused_experts_ref's weighted
    slot outputs. -> (slot_out [T * k, H] of x.dtype, topk_weights [T, k] float32, topk_ids [T, k] int32)."""
    weights, ids = moe_topk_ref(logits, top_k, renormalize)
    slot_out = fused_experts_ref(x, w13, w2, weights, ids, combine=False).flatten(0, 1)
    return slot_out, weights, ids


def routed_slot_outputs_triton(x, w13, w2, logits, top_k: int, renormalize: bool, tile: MoeTile):
    """expert_slot_outputs with the top-k inside the per-slot gate/up launch (tile.block_m == 1): the
    router logits [T, E] float32 in, and the routing it chose out: (slot_out [T * k, H] of x.dtype,
    topk_weights [T, k] float32, topk_ids [T, k] int32), as moe_topk_triton(logits) would give them.
    Raises ValueError on shapes that disagree or a grouped tile."""
    _check_expert_shapes(x, w13, w2)
    num_tokens, (num_experts, two_inter, hidden) = x.shape[0], w13.shape
    if tile.block_m != 1 or logits.shape != (num_tokens, num_experts) or logits.dtype != torch.float32:
        raise ValueError(
            f"routed slots need a per-slot tile (got {tile.label()}) and float32 logits [{num_tokens}, "
            f"{num_experts}] (got {list(logits.shape)} {logits.dtype})"
        )
    if not 1 <= top_k <= num_experts or num_experts > MAX_EXPERTS:
        raise ValueError(f"routed slots need 1 <= top_k ({top_k}) <= E ({num_experts}) <= {MAX_EXPERTS}")
    num_slots = num_tokens * top_k
    slot_out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    act = torch.empty(num_slots, two_inter // 2, dtype=x.dtype, device=x.device)
    if num_slots == 0:
        empty = torch.empty(0, top_k, device=x.device)
        return slot_out, empty, empty.to(torch.int32)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weights, ids = routed_slot_products(
        x, w13, w2, logits.contiguous(), top_k, renormalize, act, slot_out, tile
    )
    return slot_out, weights.view(num_tokens, top_k), ids.view(num_tokens, top_k)


def combine_slots_ref(slot_out: torch.Tensor, top_k: int) -> torch.Tensor:
    """combine_slots_triton in torch: [T * k, H] -> [T, H], float32 sum (float64 for float64) rounded once."""
    compute = torch.float64 if slot_out.dtype == torch.float64 else torch.float32
    return slot_out.view(-1, top_k, slot_out.shape[-1]).to(compute).sum(dim=1).to(slot_out.dtype)


def combine_slots_triton(slot_out: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T * k, H] -> [T, H]: each token's k rows summed in float32 (slot order), rounded once."""
    num_slots, hidden = slot_out.shape
    out = torch.empty(num_slots // top_k, hidden, dtype=slot_out.dtype, device=slot_out.device)
    if num_slots:
        block = min(triton.next_power_of_2(hidden), 1024)
        _combine_kernel[(num_slots // top_k, triton.cdiv(hidden, block))](
            slot_out, out, hidden, TOP_K=top_k, BLOCK=block
        )
    return out


def fused_slots_triton(x, w13, w2, topk_weights, topk_ids, tile: MoeTile | None = None) -> torch.Tensor:
    """expert_slot_outputs at the measured (or default) tile: [T * k, H] of x.dtype."""
    return expert_slot_outputs(x, w13, w2, topk_weights, topk_ids, tile or tile_for(w13, topk_ids.numel()))


def fused_experts_triton(x, w13, w2, topk_weights, topk_ids, tile: MoeTile | None = None) -> torch.Tensor:
    """Triton fused_experts_ref: grouped gate/up GEMM + SiLU-and-mul, grouped down GEMM with the routing
    weight, then the combine. x [T, H] bf16/fp16/fp32, w13 [E, 2I, H], w2 [E, H, I] contiguous along
    their last dim; returns a new [T, H] of x.dtype. tile: None takes the measured or default tile."""
    if tile is None:
        tile = tile_for(w13, topk_ids.numel())
    slot_out = expert_slot_outputs(x, w13, w2, topk_weights, topk_ids, tile)
    return combine_slots_triton(slot_out, topk_ids.shape[1])
