"""Greedy verification: the longest prefix equal to the target's argmax, then one target token."""

import pytest
import torch

from tpfuse.spec.verify import greedy_verify, rejection_sample_verify

VOCAB = 11


def logits_preferring(token_rows: list[list[int]]) -> torch.Tensor:
    """[B, P, V] random logits whose argmax at [b, i] is token_rows[b][i]."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(token_rows), len(token_rows[0]), VOCAB, generator=gen)
    for b, row in enumerate(token_rows):
        for i, t in enumerate(row):
            logits[b, i, t] = logits[b, i].max() + 1.0
    return logits


def test_all_drafts_accepted_emits_them_and_the_bonus_token():
    result = greedy_verify(torch.tensor([[3, 5, 7]]), logits_preferring([[3, 5, 7, 9]]))
    assert result.num_accepted.tolist() == [3]
    assert result.token_ids.tolist() == [[3, 5, 7, 9]]


def test_first_draft_rejected_emits_the_target_correction_only():
    result = greedy_verify(torch.tensor([[4, 5, 7]]), logits_preferring([[3, 5, 7, 9]]))
    assert result.num_accepted.tolist() == [0]
    assert result.token_ids.tolist() == [[3, -1, -1, -1]]


def test_mismatch_in_the_middle_stops_acceptance_even_if_later_drafts_match():
    result = greedy_verify(torch.tensor([[3, 6, 7]]), logits_preferring([[3, 5, 7, 9]]))
    assert result.num_accepted.tolist() == [1]
    assert result.emitted_token_ids() == [[3, 5]]


def test_rows_of_a_batch_are_verified_independently():
    drafts = torch.tensor([[1, 2], [1, 2], [0, 0]])
    logits = logits_preferring([[1, 2, 3], [1, 4, 3], [5, 0, 0]])
    result = greedy_verify(drafts, logits)
    assert result.num_accepted.tolist() == [2, 1, 0]
    assert result.emitted_token_ids() == [[1, 2, 3], [1, 4], [5]]


def test_padded_drafts_beyond_a_rows_draft_count_are_never_accepted():
    logits = logits_preferring([[1, 2, 3], [1, 2, 3]])
    result = greedy_verify(torch.tensor([[1, 2], [1, 2]]), logits, num_draft_tokens=torch.tensor([1, 0]))
    assert result.emitted_token_ids() == [[1, 2], [1]]


def test_zero_drafts_is_plain_greedy_decoding():
    logits = logits_preferring([[6], [2]])
    result = greedy_verify(torch.empty(2, 0, dtype=torch.int64), logits)
    assert result.emitted_token_ids() == [[6], [2]]


def test_mismatched_logit_positions_raise_a_clear_error():
    with pytest.raises(ValueError, match=r"one more position than there are drafts"):
        greedy_verify(torch.tensor([[1, 2]]), torch.zeros(1, 2, VOCAB))


def test_zero_temperature_rows_of_rejection_sampling_verify_greedily():
    drafts = torch.tensor([[3, 6, 7], [3, 5, 7]])
    logits = logits_preferring([[3, 5, 7, 9], [3, 5, 7, 9]])
    result = rejection_sample_verify(
        drafts,
        logits,
        temperatures=torch.zeros(2),
        top_ks=torch.full((2,), -1),
        top_ps=torch.ones(2),
        seeds=torch.tensor([1, 2]),
    )
    assert result.emitted_token_ids() == [[3, 5], [3, 5, 7, 9]]
