"""seeded_sample_verify: lossless sampling whose tokens depend on (seed, output index) only, never on
the drafts, k or the batch."""

import torch

from tpfuse.spec.verify import seeded_sample_verify, target_probs

VOCAB, K = 37, 4


def _params(batch, temperature=0.8):
    return dict(
        temperatures=torch.full((batch,), temperature),
        top_ks=torch.full((batch,), -1),
        top_ps=torch.ones(batch),
    )


def test_tokens_depend_only_on_seed_and_output_index_not_on_the_drafts():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, K + 1, VOCAB, generator=gen, dtype=torch.float64).float()
    seeds, first = torch.tensor([5, -9, 2**40]), torch.tensor([0, 7, 100])
    # One position at a time, with no drafts: what a non-speculative run at each index draws.
    one_by_one = torch.stack(
        [
            seeded_sample_verify(
                torch.zeros(3, 0, dtype=torch.int64), logits[:, i : i + 1], **_params(3), seeds=seeds,
                first_output_index=first + i,
            ).token_ids[:, 0]
            for i in range(K + 1)
        ],
        dim=1,
    )  # fmt: skip
    right = seeded_sample_verify(
        one_by_one[:, :K], logits, **_params(3), seeds=seeds, first_output_index=first
    )
    assert right.num_accepted.tolist() == [K] * 3
    assert torch.equal(right.token_ids, one_by_one)
    wrong_drafts = (one_by_one[:, :K] + 1) % VOCAB
    wrong_drafts[:, 0] = one_by_one[:, 0]  # the first draft is right, the second wrong
    partial = seeded_sample_verify(wrong_drafts, logits, **_params(3), seeds=seeds, first_output_index=first)
    assert partial.num_accepted.tolist() == [1] * 3
    assert torch.equal(partial.token_ids[:, :2], one_by_one[:, :2])


def test_emitted_tokens_follow_the_target_distribution():
    rows = 20000
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 1, VOCAB, generator=gen).expand(rows, 1, VOCAB).contiguous()
    draws = seeded_sample_verify(
        torch.zeros(rows, 0, dtype=torch.int64), logits, **_params(rows), seeds=torch.arange(rows),
        first_output_index=torch.zeros(rows, dtype=torch.int64),
    ).token_ids[:, 0]  # fmt: skip
    expected = target_probs(logits[:1], **{k: v[:1] for k, v in _params(rows).items()})[0, 0].double()
    observed = torch.bincount(draws, minlength=VOCAB).double() / rows
    assert (observed - expected).abs().max() < 4 * (expected * (1 - expected) / rows).sqrt().max() + 1e-3


def test_greedy_rows_take_the_argmax():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, VOCAB, generator=gen)
    drafts = logits[:, :2].argmax(-1)
    result = seeded_sample_verify(drafts, logits, **_params(2, 0.0), seeds=torch.tensor([1, 2]),
                                  first_output_index=torch.tensor([0, 0]))  # fmt: skip
    assert result.num_accepted.tolist() == [2, 2]
    assert torch.equal(result.token_ids, logits.argmax(-1))
