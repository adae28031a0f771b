"""Fused MoE experts: tokens grouped by expert -> gate/up GEMM + SiLU-and-mul -> down GEMM -> combine.

x [T, H]; w13 [E, 2I, H] (gate rows then up rows of each expert); w2 [E, H, I]; topk_ids / topk_weights
[T, k] from kernels/moe_routing.py. Output [T, H] = sum_j topk_weights[t, j] * expert_{ids[t, j]}(x[t]),
this rank's partial sum when I is a tensor-parallel slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.moe_align import moe_align_triton


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


@dataclass(frozen=True)
class MoeTile:
    """Launch configuration of both expert products: block_m rows of one expert per program (16:
    decode, the MMA minimum; 64-128: prefill), block_n output and block_k reduction columns.
    block_m = 1 is the per-slot GEMV route: no grouping, one (token, slot) row per program, its
    expert's weight tile streamed with multiply-adds (few tokens, each slot a distinct expert)."""

    block_m: int
    block_n: int
    block_k: int
    num_stages: int = 3
    num_warps: int = 4

    def label(self) -> str:
        kind = "slot gemv " if self.block_m == 1 else f"moe {self.block_m}x"
        return f"{kind}{self.block_n}x{self.block_k} s{self.num_stages} w{self.num_warps}"


DEFAULT_DECODE_TILE = MoeTile(16, 64, 128, 4, 4)
DEFAULT_PREFILL_TILE = MoeTile(64, 128, 64, 3, 4)
GROUP_M = 8  # row blocks that sweep the column tiles together (grouped launch order)
DECODE_MAX_SLOTS = 64 * 8  # up to 64 tokens of top-8: the decode tiles, unless measured otherwise
# What model/moe_choice.py times at start-up (the defaults first): decode tiles stream each routed
# expert's weights once with few rows; prefill tiles are tensor-core GEMM tiles.
DECODE_TILES = (
    DEFAULT_DECODE_TILE,
    MoeTile(1, 32, 256, 2, 4),
    MoeTile(1, 16, 512, 2, 4),
    MoeTile(1, 64, 128, 2, 4),
    MoeTile(16, 32, 128, 4, 4),
    MoeTile(16, 128, 64, 4, 4),
    MoeTile(16, 64, 256, 3, 8),
    MoeTile(32, 64, 128, 3, 4),
)
PREFILL_TILES = (
    DEFAULT_PREFILL_TILE,
    MoeTile(64, 64, 64, 4, 4),
    MoeTile(128, 128, 64, 3, 8),
    MoeTile(128, 64, 64, 4, 4),
    MoeTile(64, 128, 128, 2, 8),
)
CANDIDATE_TILES = DECODE_TILES + PREFILL_TILES[1:]


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
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + rows)
    row_ok = slots < num_slots
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
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + rows)
    row_ok = slots < num_slots
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
def _slot_gate_up_kernel(
    x_ptr, w13_ptr, act_ptr, ids_ptr, hidden, inter, stride_x, stride_we, stride_wn, stride_act,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Per-slot GEMV: act[s, n] = silu(x[t] . gate_e[n]) * (x[t] . up_e[n]), e = ids[s], t = s // k."""
    slot = tl.program_id(0)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    token = (slot // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    g_ptrs = w13_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (ks + k0) < hidden
        xk = tl.load(x_ptr + token * stride_x + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        mask = col_ok[:, None] & k_ok[None, :]
        acc_g += tl.load(g_ptrs + k0, mask=mask, other=0.0).to(tl.float32) * xk[None, :]
        acc_u += tl.load(u_ptrs + k0, mask=mask, other=0.0).to(tl.float32) * xk[None, :]
    g, u = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + slot.to(tl.int64) * stride_act + cols, act.to(act_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _slot_down_kernel(
    act_ptr, w2_ptr, out_ptr, weights_ptr, ids_ptr, hidden, inter,
    stride_act, stride_we, stride_wn, stride_out, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Per-slot GEMV: out[s, n] = weight[s] * (act[s] . down_e[n]), e = ids[s]."""
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w2_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = (ks + k0) < inter
        a = tl.load(act_ptr + slot * stride_act + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * a[None, :]
    y = tl.sum(acc, axis=1) * tl.load(weights_ptr + slot)
    tl.store(out_ptr + slot * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=col_ok)


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


def default_tile(num_slots: int) -> MoeTile:
    return DEFAULT_DECODE_TILE if num_slots <= DECODE_MAX_SLOTS else DEFAULT_PREFILL_TILE


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
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if w2.shape != (num_experts, hidden, inter) or x.shape[1] != hidden:
        raise ValueError(
            f"fused_experts: x {list(x.shape)}, w13 {list(w13.shape)}, w2 {list(w2.shape)} disagree"
        )
    num_slots = num_tokens * top_k
    tile = tile or default_tile(num_slots)
    slot_out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    if num_slots == 0:
        return slot_out
    x = x if x.stride(-1) == 1 else x.contiguous()
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    if tile.block_m == 1:
        _slot_products(x, w13, w2, weights, topk_ids, act, slot_out, tile)
        return slot_out
    sorted_slots, block_expert, num_padded = moe_align_triton(
        topk_ids.contiguous(), num_experts, tile.block_m
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


def _slot_products(x, w13, w2, weights, topk_ids, act, slot_out, tile: MoeTile) -> None:
    """The per-slot GEMV route (tile.block_m == 1) of expert_slot_outputs."""
    num_slots, inter = act.shape
    hidden, top_k = x.shape[1], topk_ids.shape[1]
    ids = topk_ids.reshape(-1).contiguous()
    opts = dict(
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_stages=tile.num_stages, num_warps=tile.num_warps
    )
    _slot_gate_up_kernel[(num_slots, triton.cdiv(inter, tile.block_n))](
        x, w13, act, ids, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, **opts,
    )  # fmt: skip
    _slot_down_kernel[(num_slots, triton.cdiv(hidden, tile.block_n))](
        act, w2, slot_out, weights, ids, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1),
        slot_out.stride(0), **opts,
    )  # fmt: skip


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


_CHOSEN_TILES: dict[tuple, MoeTile] = {}


def set_tile(w13: torch.Tensor, slots_bucket: int, tile: MoeTile) -> None:
    """Records the measured tile of an expert weight shape at a slot-count bucket (model/moe_choice.py)."""
    _CHOSEN_TILES[(tuple(w13.shape), w13.dtype, w13.device, slots_bucket)] = tile


def slots_bucket(num_slots: int) -> int:
    """Power-of-two bucket of T * k: the key of a measured tile."""
    return triton.next_power_of_2(max(num_slots, 1))


def tile_for(w13: torch.Tensor, num_slots: int) -> MoeTile:
    key = (tuple(w13.shape), w13.dtype, w13.device, slots_bucket(num_slots))
    return _CHOSEN_TILES.get(key) or default_tile(num_slots)
