"""Rejection sampling: emitted tokens follow the target distribution exactly, for any drafter.

The toy target has a fixed distribution per verify position (independent of the prefix), so the
token emitted at position i, among rows that reached it, must follow p_i. A chi-square statistic on
VOCAB = 8 bins (7 degrees of freedom) separates a right sampler (about 7) from a wrong one (hundreds);
the threshold 35 sits at a p-value near 1e-5, and the seeds are fixed, so the outcome is stable.
"""

import torch

from tpfuse.spec.verify import rejection_sample_verify, target_probs

VOCAB, K, ROWS = 8, 2, 40_000
CHI2_THRESHOLD = 35.0


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    expected = probs.double() * samples.numel()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def toy_problem(temperature=0.9, top_k=-1, top_p=1.0):
    gen = torch.Generator().manual_seed(1234)
    logits = (2.0 * torch.randn(K + 1, VOCAB, generator=gen)).expand(ROWS, K + 1, VOCAB)
    q = torch.randn(K, VOCAB, generator=gen).mul(2.0).softmax(-1)
    drafts = torch.stack([torch.multinomial(q[i], ROWS, True, generator=gen) for i in range(K)], dim=1)
    params = dict(
        temperatures=torch.full((ROWS,), temperature),
        top_ks=torch.full((ROWS,), top_k),
        top_ps=torch.full((ROWS,), top_p),
        seeds=torch.arange(ROWS, dtype=torch.int64) * 7919 + 17,
    )
    p = target_probs(logits[:1], params["temperatures"][:1], params["top_ks"][:1], params["top_ps"][:1])[0]
    return logits, drafts, q, p, params


def worst_position_chi_square(result, p) -> float:
    worst = 0.0
    for i in range(K + 1):
        reached = result.num_accepted >= i
        worst = max(worst, chi_square(result.token_ids[reached, i], p[i]))
    return worst


def test_sampled_drafts_with_their_probabilities_reproduce_the_target_distribution():
    logits, drafts, q, p, params = toy_problem()
    draft_probs = q.expand(ROWS, K, VOCAB)
    result = rejection_sample_verify(drafts, logits, draft_probs=draft_probs, **params)
    assert worst_position_chi_square(result, p) < CHI2_THRESHOLD


def test_argmax_drafter_without_probabilities_reproduces_the_target_distribution():
    logits, _, q, p, params = toy_problem()
    drafts = q.argmax(-1).expand(ROWS, K).contiguous()
    result = rejection_sample_verify(drafts, logits, **params)
    assert worst_position_chi_square(result, p) < CHI2_THRESHOLD


def test_top_k_and_top_p_filtered_target_distribution_is_reproduced():
    logits, drafts, q, p, params = toy_problem(temperature=1.3, top_k=5, top_p=0.8)
    assert (p == 0).any(), "the filters should remove some tokens in this toy"
    result = rejection_sample_verify(drafts, logits, draft_probs=q.expand(ROWS, K, VOCAB), **params)
    assert worst_position_chi_square(result, p) < CHI2_THRESHOLD


def test_control_misdeclared_draft_probabilities_fail_the_distribution_check():
    logits, drafts, q, p, params = toy_problem()
    uniform_q = torch.full((ROWS, K, VOCAB), 1.0 / VOCAB)  # drafts were drawn from q, not uniform
    result = rejection_sample_verify(drafts, logits, draft_probs=uniform_q, **params)
    assert worst_position_chi_square(result, p) > 10 * CHI2_THRESHOLD


def test_control_emitting_drafts_unverified_fails_the_distribution_check():
    _, drafts, _, p, _ = toy_problem()
    assert chi_square(drafts[:, 0], p[0]) > 10 * CHI2_THRESHOLD


def test_same_seeds_give_the_same_tokens():
    logits, drafts, q, _, params = toy_problem()
    a = rejection_sample_verify(drafts[:500], logits[:500], **{n: v[:500] for n, v in params.items()})
    b = rejection_sample_verify(drafts[:500], logits[:500], **{n: v[:500] for n, v in params.items()})
    assert torch.equal(a.token_ids, b.token_ids)


def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch():
    logits, drafts, q, _, params = toy_problem()
    order = torch.randperm(300, generator=torch.Generator().manual_seed(5))
    whole = rejection_sample_verify(drafts[:300], logits[:300], **{n: v[:300] for n, v in params.items()})
    shuffled = rejection_sample_verify(
        drafts[order], logits[order], **{n: v[:300][order] for n, v in params.items()}
    )
    assert torch.equal(whole.token_ids[order], shuffled.token_ids)


def test_different_seeds_give_different_tokens():
    logits, drafts, q, _, params = toy_problem()
    a = rejection_sample_verify(drafts[:500], logits[:500], **{n: v[:500] for n, v in params.items()})
    params["seeds"] = params["seeds"] + 1
    b = rejection_sample_verify(drafts[:500], logits[:500], **{n: v[:500] for n, v in params.items()})
    assert not torch.equal(a.token_ids, b.token_ids)
