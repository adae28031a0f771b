"""Prompt-lookup drafting proposes what followed the latest earlier occurrence of the suffix."""

import pytest
import torch

from tpfuse.spec.drafter import DraftInputs
from tpfuse.spec.ngram import NgramDrafter, propose_ngram


def test_tokens_after_the_matching_suffix_are_proposed():
    assert propose_ngram([1, 2, 3, 4, 5, 9, 1, 2, 3], 2) == [4, 5]


def test_longer_suffix_match_wins_over_a_later_shorter_one():
    # suffix (7, 8) occurs at 0; the 1-gram (8) also occurs later at 4, followed by 6.
    assert propose_ngram([7, 8, 1, 2, 8, 6, 7, 8], 1, max_ngram=2) == [1]


def test_among_equal_length_matches_the_latest_is_used():
    assert propose_ngram([5, 1, 5, 2, 5, 3, 5], 1, max_ngram=1) == [3]


def test_proposal_stops_at_the_end_of_the_history():
    assert propose_ngram([4, 5, 6, 4, 5], 3, max_ngram=2) == [6, 4, 5]


def test_no_match_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4], 3) == []


def test_suffixes_shorter_than_min_ngram_are_not_matched():
    assert propose_ngram([1, 2, 9, 2], 2, max_ngram=3, min_ngram=2) == []


def test_drafter_pads_rows_and_reports_per_row_counts():
    histories = [[1, 2, 3, 1, 2], [1, 2, 3], [7, 7]]
    inputs = DraftInputs(
        input_ids=torch.zeros(3, dtype=torch.int64),
        positions=torch.zeros(3, dtype=torch.int64),
        next_token_ids=torch.zeros(3, dtype=torch.int64),
        query_start_loc=torch.arange(4, dtype=torch.int32),
        token_histories=histories,
    )
    proposal = NgramDrafter(max_ngram=3).propose(inputs, 3)
    assert proposal.num_draft_tokens.tolist() == [3, 0, 1]
    assert proposal.token_ids.tolist() == [[3, 1, 2], [0, 0, 0], [7, 0, 0]]


def test_drafter_without_histories_says_the_engine_must_fill_them():
    inputs = DraftInputs(*(torch.zeros(1, dtype=torch.int64),) * 3, query_start_loc=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="token_histories"):
        NgramDrafter().propose(inputs, 2)
