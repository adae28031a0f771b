"""Group-limited top-k routing (DeepSeek-V3, Kimi-K2): sigmoid scores, biased choice, unbiased weights.

Experts form num_groups equal groups. Each token scores every expert (sigmoid of its router logit),
chooses with the scores plus e_score_correction_bias: a group's score is the sum of its two best
biased scores, the topk_groups best groups stay, and the top_k best biased experts inside them are
routed. The weights are the chosen experts' unbiased scores, renormalised to sum to 1 when
norm_topk_prob, times routed_scaling_factor. No host sync and static shapes (CUDA-graph safe).
The reference breaks ties as torch.topk does (so it equals transformers on the same device); the
Triton kernel (one program per token, groups x experts-in-group as one tile) breaks them to the
lower group / expert id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def experts_per_group(num_experts: int, top_k: int, num_groups: int, topk_groups: int) -> int:
    """Experts per group; raises ValueError when E is not num_groups groups of >= 2 or top_k does not fit."""
    if num_groups < 1 or num_experts % num_groups or num_experts // num_groups < 2:
        raise ValueError(
            f"n_routed_experts ({num_experts}) must split into n_group ({num_groups}) groups of >= 2 experts"
        )
    per_group = num_experts // num_groups
    if not 1 <= topk_groups <= num_groups or not 1 <= top_k <= topk_groups * per_group:
        raise ValueError(
            f"num_experts_per_tok ({top_k}) must fit in topk_group ({topk_groups}) of n_group ({num_groups}) "
            f"groups of {per_group} experts"
        )
    return per_group


def grouped_topk_ref(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (float32 math; float64 stays float64); correction_bias [E] or None.
    Returns (weights [T, top_k] float32/float64, expert ids [T, top_k] int32).
    Raises ValueError when E is not num_groups groups of at least 2 or top_k does not fit."""
    num_tokens, num_experts = router_logits.shape
    per_group = experts_per_group(num_experts, top_k, num_groups, topk_groups)
    acc = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    scores = router_logits.to(acc).sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.to(acc)
    if topk_groups < num_groups:
        group_scores = choice.view(num_tokens, num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


@triton.jit
def grouped_topk_of_row(
    row_ptr, bias_ptr, HAS_BIAS: tl.constexpr, NUM_GROUPS: tl.constexpr, PER_GROUP: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, NORM: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """One token's routing from its NUM_GROUPS * PER_GROUP logits at row_ptr (loaded with cache
    modifier CACHE) -> (weights [BLOCK_K] float32 before the scaling factor, ids [BLOCK_K] int32,
    slots = arange(BLOCK_K)); entries past TOP_K are 0. Groups x experts-in-group form one tile."""
    groups = tl.arange(0, BLOCK_G)
    members = tl.arange(0, BLOCK_P)
    valid = (groups < NUM_GROUPS)[:, None] & (members < PER_GROUP)[None, :]
    expert = groups[:, None] * PER_GROUP + members[None, :]
    x = tl.load(row_ptr + expert, mask=valid, other=0.0, cache_modifier=CACHE).to(tl.float32)
    # Padding lanes (PER_GROUP not a power of two) alias the next group's first expert id: zero them.
    score = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    choice = score
    if HAS_BIAS:
        choice += tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    # A NaN score (a broken activation upstream) ranks below every number and above the masked
    # lanes, and group sums stay finite: every pick is a real expert of a kept group.
    choice = tl.where(valid, tl.where(choice == choice, choice, -1.0e30), float("-inf"))
    if TOPK_GROUPS < NUM_GROUPS:
        best = tl.max(choice, axis=1)
        first = tl.min(tl.where(choice == best[:, None], members[None, :], BLOCK_P), axis=1)
        second = tl.max(tl.where(members[None, :] == first[:, None], float("-inf"), choice), axis=1)
        group_score = tl.where(groups < NUM_GROUPS, best + second, float("-inf"))
        kept = groups < 0
        for _ in tl.static_range(TOPK_GROUPS):
            left = tl.where(kept, float("-inf"), group_score)
            top = tl.max(left, axis=0)
            pick = tl.min(tl.where(left == top, groups, BLOCK_G), axis=0)
            kept = kept | (groups == pick)
        choice = tl.where(kept[:, None], choice, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == top, expert, NUM_GROUPS * PER_GROUP), axis=1), axis=0)
        w = tl.sum(tl.sum(tl.where(expert == pick, score, 0.0), axis=1), axis=0)
        weights = tl.where(slots == k, w, weights)
        ids = tl.where(slots == k, pick, ids)
        choice = tl.where(expert == pick, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    return weights, ids, slots


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_t, scaling,
    NUM_GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr,
    NORM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    weights, ids, slots = grouped_topk_of_row(
        logits_ptr + t * stride_t, bias_ptr, HAS_BIAS, NUM_GROUPS, PER_GROUP, TOPK_GROUPS, TOP_K, NORM,
        BLOCK_G, BLOCK_P, BLOCK_K, "",
    )  # fmt: skip
    out = t * TOP_K + slots
    tl.store(weights_ptr + out, weights * scaling, mask=slots < TOP_K)
    tl.store(ids_ptr + out, ids, mask=slots < TOP_K)


def grouped_topk_triton(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton grouped_topk_ref (same shapes; weights float32, ties to the lower id). router_logits
    rows must be contiguous in the expert dim."""
    num_tokens, num_experts = router_logits.shape
    per_group = experts_per_group(num_experts, top_k, num_groups, topk_groups)
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _grouped_topk_kernel[(num_tokens,)](
            router_logits, correction_bias if correction_bias is not None else router_logits, weights, ids,
            router_logits.stride(0), float(routed_scaling_factor),
            NUM_GROUPS=num_groups, PER_GROUP=per_group, TOPK_GROUPS=topk_groups, TOP_K=top_k,
            NORM=norm_topk_prob, HAS_BIAS=correction_bias is not None,
            BLOCK_G=triton.next_power_of_2(num_groups), BLOCK_P=triton.next_power_of_2(per_group),
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=4,
        )  # fmt: skip
    return weights, ids
