"""Group-limited sigmoid routing against a float64 brute-force check and transformers' router."""

import pytest
import torch

from tpfuse.kernels.grouped_topk import grouped_topk_ref as grouped_topk
from tpfuse.kernels.grouped_topk import grouped_topk_triton


def _check_group_limited_choice(logits, bias, ids, weights, top_k, groups, topk_groups, norm, factor):
    """Every row: the chosen groups are a best set by top-2 biased score, the chosen experts a best set
    inside them, weights the unbiased sigmoid scores (renormalised) times factor. Ties may go either way."""
    scores = logits.double().sigmoid()
    choice = scores + bias.double()
    per_group = logits.shape[1] // groups
    for t in range(logits.shape[0]):
        row_ids = ids[t].long()
        assert len(set(row_ids.tolist())) == top_k
        group_score = choice[t].view(groups, per_group).topk(2).values.sum(-1)
        used_groups = set((row_ids // per_group).tolist())
        assert len(used_groups) <= topk_groups
        kth_best_group = group_score.sort(descending=True).values[topk_groups - 1]
        assert all(group_score[g] >= kth_best_group for g in used_groups)
        allowed = torch.zeros(logits.shape[1], dtype=torch.bool)
        best_groups = (group_score >= kth_best_group).nonzero().flatten().tolist()
        for g in best_groups:
            allowed[g * per_group : (g + 1) * per_group] = True
        # no unchosen expert of an eligible group beats a chosen one
        worst_chosen = choice[t, row_ids].min()
        unchosen = allowed.clone()
        unchosen[row_ids] = False
        if len(best_groups) == topk_groups:  # eligible groups are exactly the chosen ones
            assert (choice[t, unchosen] <= worst_chosen).all()
        w = scores[t, row_ids]
        if norm:
            w = w / w.sum()
        tol = 1e-12 if weights.dtype == torch.float64 else 1e-6
        torch.testing.assert_close(weights[t].double(), w * factor, rtol=tol, atol=tol)


@pytest.mark.parametrize("norm", [True, False])
def test_grouped_topk_in_float64_picks_a_group_limited_best_set(norm):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 24, generator=gen, dtype=torch.float64)
    bias = torch.randn(24, generator=gen, dtype=torch.float64) * 0.1
    weights, ids = grouped_topk(logits, bias, 5, 6, 3, norm, 2.5)
    assert weights.dtype == torch.float64 and ids.dtype == torch.int32
    _check_group_limited_choice(logits, bias, ids, weights, 5, 6, 3, norm, 2.5)


def test_grouped_topk_with_tied_groups_stays_group_limited():
    gen = torch.Generator().manual_seed(1)
    half = torch.randn(9, 8, generator=gen, dtype=torch.float64)
    logits = torch.cat([half, half, half.flip(-1)], dim=1)  # groups 0-1 equal 2-3, groups 4-5 a permutation
    bias = torch.zeros(24, dtype=torch.float64)
    weights, ids = grouped_topk(logits, bias, 4, 6, 2, True, 1.0)
    _check_group_limited_choice(logits, bias, ids, weights, 4, 6, 2, True, 1.0)


def test_grouped_topk_matches_transformers_router_with_tied_groups():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                              topk_group=2, norm_topk_prob=True, routed_scaling_factor=1.7)  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 16, generator=gen))
        router.weight[4:8] = router.weight[0:4]  # groups 0 and 1 always tie
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.05)
        router.e_score_correction_bias[4:8] = router.e_score_correction_bias[0:4]
    hidden = torch.randn(50, 16, generator=gen)
    logits, hf_weights, hf_ids = router(hidden)
    weights, ids = grouped_topk(logits, router.e_score_correction_bias, 3, 4, 2, True, 1.7)
    assert torch.equal(ids.long().sort(-1).values, hf_ids.sort(-1).values)
    order, hf_order = ids.long().argsort(-1), hf_ids.argsort(-1)
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=0, atol=0)


def test_grouped_topk_names_the_bad_group_split():
    with pytest.raises(ValueError, match="n_group"):
        grouped_topk(torch.zeros(2, 10), None, 2, 4, 2, True)


def _sorted_by_id(weights, ids):
    order = ids.long().argsort(-1)
    return weights.gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize(
    "experts,top_k,groups,topk_groups,norm,bias",
    [
        (24, 5, 6, 3, True, True),
        (16, 3, 1, 1, False, True),
        (12, 4, 4, 2, True, False),
        (256, 8, 8, 4, True, True),
    ],
    ids=["limited", "one-group", "no-bias", "deepseek-v3"],
)
def test_grouped_topk_triton_matches_the_reference(experts, top_k, groups, topk_groups, norm, bias):
    gen = torch.Generator().manual_seed(experts + top_k)
    logits = torch.randn(19, experts, generator=gen)
    correction = torch.randn(experts, generator=gen) * 0.1 if bias else None
    want = _sorted_by_id(*grouped_topk(logits, correction, top_k, groups, topk_groups, norm, 2.5))
    got = _sorted_by_id(*grouped_topk_triton(logits, correction, top_k, groups, topk_groups, norm, 2.5))
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_grouped_topk_triton_breaks_ties_to_the_lower_group_and_expert():
    gen = torch.Generator().manual_seed(3)
    half = torch.randn(9, 8, generator=gen)
    logits = torch.cat([half, half, half.flip(-1)], dim=1)  # groups 0-1 equal 2-3 (4 experts a group)
    bias = torch.zeros(24)
    weights, ids = grouped_topk_triton(logits, bias, 4, 6, 2, True, 1.0)
    _check_group_limited_choice(logits, bias, ids, weights, 4, 6, 2, True, 1.0)
    tied = torch.zeros(2, 8)  # every expert and group ties: the lowest ids win
    _, ids = grouped_topk_triton(tied, None, 3, 4, 2, False, 1.0)
    assert ids.sort(-1).values.tolist() == [[0, 1, 2]] * 2


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaNs, on purpose
def test_nan_logits_still_pick_distinct_experts_of_kept_groups():
    """A NaN row must not send the expert kernels past the stack (that would take the engine down)."""
    logits = torch.randn(3, 24, generator=torch.Generator().manual_seed(5))
    logits[0] = float("nan")
    logits[1, ::3] = float("nan")
    clean = logits[2:].clone()
    for bias in (None, torch.zeros(24)):
        weights, ids = grouped_topk_triton(logits, bias, 4, 6, 2, True, 1.0)
        assert ((ids >= 0) & (ids < 24)).all(), ids
        assert all(len(set(row.tolist())) == 4 for row in ids)
        assert len({i // 4 for i in ids[0].tolist()}) <= 2  # still at most topk_group groups
        assert torch.equal(ids[2], grouped_topk_triton(clean, bias, 4, 6, 2, True, 1.0)[1][0])
