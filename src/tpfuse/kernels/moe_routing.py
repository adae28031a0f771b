"""MoE routing: router logits -> softmax -> top-k experts per token (renormalised when asked).

Ties go to the lower expert id, in the kernel and the reference alike. One program per token row
holds its E logits (E <= 1024) and picks the k largest by repeated arg-max, so it needs no sort
and no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl

MAX_EXPERTS = 1024


def moe_topk_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32), weights in
    descending order (ties: lower id first). Softmax in float32 (float64 for float64 logits)."""
    compute = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    probs = torch.softmax(router_logits.to(compute), dim=-1)
    ordered, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = ordered[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(compute if compute == torch.float64 else torch.float32), ids.to(torch.int32)


@triton.jit
def topk_of_row(x, valid, cols, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    """x [BLOCK_E] float32 logits (masked by valid, cols = arange(BLOCK_E)) -> (weights [BLOCK_K]
    float32, ids [BLOCK_K] int32, ks = arange(BLOCK_K)): softmax, then the TOP_K largest by repeated
    arg-max (ties: lower id), renormalised when asked; entries past TOP_K are 0. Ids are always those
    of valid columns (TOP_K <= their count): a NaN probability ranks below every number, the masked
    columns below that, so a row of NaN logits still routes inside the expert stack."""
    e = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
    p = e / tl.sum(e, axis=0)
    remaining = tl.where(valid, tl.where(p == p, p, -1.0), -3.0)  # chosen columns become -2 below
    ks = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_id = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        best_id = tl.min(tl.where(remaining == best, cols, BLOCK_E), axis=0)
        top_w = tl.where(ks == j, best, top_w)
        top_id = tl.where(ks == j, best_id, top_id)
        remaining = tl.where(cols == best_id, -2.0, remaining)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    return top_w, top_id, ks


@triton.jit
def routed_slot(logits_ptr, token, j, num_experts, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """(expert int32, weight float32) of slot j of token's routing, from its float32 logits row at
    logits_ptr + token * num_experts (BLOCK_K = next_power_of_2(TOP_K)): topk_of_row's entry j, so a
    kernel that needs one slot's expert computes it as the top-k kernel would: the same expert, the
    weight to float32 rounding (the softmax sums in the order of the caller's warps)."""
    cols = tl.arange(0, BLOCK_E)
    valid = cols < num_experts
    x = tl.load(logits_ptr + token * num_experts + cols, mask=valid, other=-float("inf"))
    top_w, top_id, ks = topk_of_row(x, valid, cols, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
    return tl.sum(tl.where(ks == j, top_id, 0), axis=0), tl.sum(tl.where(ks == j, top_w, 0.0), axis=0)


@triton.jit
def slot_expert(ids_ptr, logits_ptr, weights_ptr, slot, num_experts, TOP_K: tl.constexpr, ROUTE: tl.constexpr,
                RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The expert (int64) of slot = t * TOP_K + j in a kernel with a program per (slot, column block):
    read from ids, or with ROUTE picked from token t's logits (routed_slot), the slot's first column
    program storing it to ids[slot] and its weight to weights[slot] for the kernels after."""
    if ROUTE:
        token = (slot // TOP_K).to(tl.int64)
        j = slot % TOP_K
        expert, weight = routed_slot(logits_ptr, token, j, num_experts, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
        if tl.program_id(1) == 0:
            tl.store(ids_ptr + slot, expert)
            tl.store(weights_ptr + slot, weight)
    else:
        expert = tl.load(ids_ptr + slot)
    return expert.to(tl.int64)


@triton.jit
def _moe_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, stride_l, num_experts,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):  # fmt: skip
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < num_experts
    x = tl.load(logits_ptr + row * stride_l + cols, mask=valid, other=-float("inf")).to(tl.float32)
    top_w, top_id, ks = topk_of_row(x, valid, cols, TOP_K, RENORMALIZE, BLOCK_E, BLOCK_K)
    tl.store(weights_ptr + row * TOP_K + ks, top_w, mask=ks < TOP_K)
    tl.store(ids_ptr + row * TOP_K + ks, top_id, mask=ks < TOP_K)


def moe_topk_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton moe_topk_ref (float32 softmax): writes new [T, k] float32 weights and int32 ids.
    Raises ValueError unless 1 <= top_k <= E <= MAX_EXPERTS."""
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts or num_experts > MAX_EXPERTS:
        raise ValueError(f"moe_topk needs 1 <= top_k ({top_k}) <= E ({num_experts}) <= {MAX_EXPERTS}")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        block_e = max(triton.next_power_of_2(num_experts), 16)
        _moe_topk_kernel[(num_tokens,)](
            logits, weights, ids, logits.stride(0), num_experts,
            TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=4 if block_e >= 256 else 1,
            **pdl.launch(logits.device),
        )  # fmt: skip
    return weights, ids
