"""Group-limited top-k routing (DeepSeek-V3, Kimi-K2): sigmoid scores, biased choice, unbiased weights.

Experts form num_groups equal groups. Each token scores every expert (sigmoid of its router logit),
chooses with the scores plus e_score_correction_bias: a group's score is the sum of its two best
biased scores, the topk_groups best groups stay, and the top_k best biased experts inside them are
routed. The weights are the chosen experts' unbiased scores, renormalised to sum to 1 when
norm_topk_prob, times routed_scaling_factor. Torch only, no host sync and static shapes (CUDA-graph
safe). Ties are broken as torch.topk breaks them (so equal to transformers on the same device).
"""

from __future__ import annotations

import torch


def grouped_topk(
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
