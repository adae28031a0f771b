"""The per-slot GEMV route of the fused-MoE experts (a MoeTile with block_m = 1).

No grouping by expert: program (s, n) takes one (token, slot) row s = t * k + j and streams its
expert's weight tile with multiply-adds into a 2-D float32 accumulator reduced once (the layout of
kernels/gemv.py). Best when few tokens route to distinct experts (decode at small batch), where the
grouped route's sorting launches cost more than they save; start-up timing decides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.fused_moe_tiles import MoeTile
from tpfuse.kernels.moe_routing import slot_expert


@triton.jit
def _slot_gate_up_kernel(
    x_ptr, w13_ptr, act_ptr, ids_ptr, logits_ptr, weights_ptr, hidden, inter, num_experts,
    stride_x, stride_we, stride_wn, stride_act,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):  # fmt: skip
    """Per-slot GEMV: act[s, n] = silu(x[t] . gate_e[n]) * (x[t] . up_e[n]), e = ids[s], t = s // k.
    ROUTE: e comes from token t's router logits instead (kernels/moe_routing.py: slot_expert), and the
    slot's first program stores it to ids[s] and its routing weight to weights[s]."""
    pdl.begin(PDL)
    slot = tl.program_id(0)
    token = (slot // TOP_K).to(tl.int64)
    expert = slot_expert(ids_ptr, logits_ptr, weights_ptr, slot, num_experts, TOP_K, ROUTE, RENORMALIZE,
                         BLOCK_E, BLOCK_TOPK)  # fmt: skip
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
    PDL: tl.constexpr,  # kernels/pdl.py
):  # fmt: skip
    """Per-slot GEMV: out[s, n] = weight[s] * (act[s] . down_e[n]), e = ids[s]."""
    pdl.begin(PDL)
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


def slot_products(x, w13, w2, weights, topk_ids, act, slot_out, tile: MoeTile) -> None:
    """The per-slot GEMV route (tile.block_m == 1) of expert_slot_outputs: gate/up at the tile's
    shape, then down at tile.down_shape()."""
    num_slots, inter = act.shape
    hidden, top_k = x.shape[1], topk_ids.shape[1]
    ids = topk_ids.reshape(-1).contiguous()
    _slot_gate_up_kernel[(num_slots, triton.cdiv(inter, tile.block_n))](
        x, w13, act, ids, None, None, hidden, inter, w13.shape[0],
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, ROUTE=False, RENORMALIZE=False, BLOCK_E=1,
        BLOCK_TOPK=1,
        num_stages=tile.num_stages, num_warps=tile.num_warps, **pdl.launch(x.device),
    )  # fmt: skip
    slot_down(act, w2, slot_out, weights, ids, tile.down_shape(), tile.num_stages)


def routed_slot_products(x, w13, w2, logits, top_k: int, renormalize: bool, act, slot_out, tile: MoeTile):
    """slot_products with the routing inside the gate/up launch: each program picks its slot's expert
    from logits [T, E] float32 (softmax, top_k, renormalised when asked: kernels/moe_routing.py).
    Returns (weights [T * k] float32, ids [T * k] int32), the routing it used."""
    num_slots, inter = act.shape
    hidden, num_experts = x.shape[1], w13.shape[0]
    ids = torch.empty(num_slots, dtype=torch.int32, device=x.device)
    weights = torch.empty(num_slots, dtype=torch.float32, device=x.device)
    _slot_gate_up_kernel[(num_slots, triton.cdiv(inter, tile.block_n))](
        x, w13, act, ids, logits, weights, hidden, inter, num_experts,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, ROUTE=True, RENORMALIZE=renormalize,
        BLOCK_E=max(triton.next_power_of_2(num_experts), 16), BLOCK_TOPK=triton.next_power_of_2(top_k),
        num_stages=tile.num_stages, num_warps=tile.num_warps, **pdl.launch(x.device),
    )  # fmt: skip
    slot_down(act, w2, slot_out, weights, ids, tile.down_shape(), tile.num_stages)
    return weights, ids


def slot_down(act, w2, slot_out, weights, ids, shape: tuple[int, int, int], num_stages: int = 2) -> None:
    """slot_out[s] = weights[s] * (act[s] @ w2[ids[s]].T) for every slot s: act [S, I], w2 [E, H, I],
    weights [S] float32, ids [S] int32; shape (block_n, block_k, num_warps)."""
    block_n, block_k, num_warps = shape
    hidden, inter = w2.shape[1], act.shape[1]
    _slot_down_kernel[(act.shape[0], triton.cdiv(hidden, block_n))](
        act, w2, slot_out, weights, ids, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1),
        slot_out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, num_stages=num_stages, num_warps=num_warps,
        **pdl.launch(act.device),
    )  # fmt: skip
