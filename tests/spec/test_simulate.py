"""Benchmark-only simulated acceptance: mean acceptance length L, drafts forced into the output."""

import pytest
import torch

from tpfuse.spec.simulate import (
    acceptance_rate_for_length,
    expected_acceptance_length,
    simulate_acceptance,
)

ROWS = 20_000


@pytest.mark.parametrize(("length", "max_drafts"), [(1.0, 3), (2.5, 3), (3.7, 5), (4.0, 3)])
def test_acceptance_rate_is_solved_for_the_requested_length(length, max_drafts):
    rate = acceptance_rate_for_length(length, max_drafts)
    assert expected_acceptance_length(rate, max_drafts) == pytest.approx(length, abs=1e-9)


def test_length_outside_one_to_k_plus_one_is_rejected_with_the_valid_range():
    with pytest.raises(ValueError, match=r"\[1, 4\]"):
        acceptance_rate_for_length(4.5, 3)


def test_simulated_mean_acceptance_length_matches_the_requested_length():
    k, length = 4, 2.8
    drafts = torch.randint(0, 100, (ROWS, k))
    targets = torch.randint(0, 100, (ROWS, k + 1))
    rate = acceptance_rate_for_length(length, k)
    result = simulate_acceptance(
        drafts, targets, rate, torch.arange(ROWS), torch.zeros(ROWS, dtype=torch.int64)
    )
    assert result.num_emitted.double().mean().item() == pytest.approx(length, abs=0.03)


def test_simulated_output_is_the_accepted_drafts_then_the_target_token():
    drafts = torch.tensor([[10, 11, 12]] * 64)
    targets = torch.tensor([[20, 21, 22, 23]] * 64)
    result = simulate_acceptance(drafts, targets, 0.5, torch.arange(64), torch.full((64,), 7))
    for n, row in zip(result.num_accepted.tolist(), result.emitted_token_ids(), strict=True):
        assert row == [10, 11, 12][:n] + [20 + n]
    assert len(set(result.num_accepted.tolist())) > 1


def test_simulation_never_accepts_padding_drafts():
    drafts = torch.zeros(ROWS // 10, 3, dtype=torch.int64)
    targets = torch.zeros(ROWS // 10, 4, dtype=torch.int64)
    limit = torch.tensor([0, 1, 2, 3]).repeat(ROWS // 40)
    result = simulate_acceptance(
        drafts, targets, 1.0, torch.arange(ROWS // 10), torch.zeros(ROWS // 10, dtype=torch.int64), limit
    )
    assert torch.equal(result.num_accepted, limit)


def test_draws_depend_on_the_request_seed_and_output_index_only():
    """A row's acceptance is a function of (request seed, output index): the same row in another
    batch draws the same, and consecutive steps of one request (indices k + 1 apart at most) draw
    independently of each other."""
    k, rate = 3, 0.6
    drafts = torch.randint(0, 100, (ROWS, k))
    targets = torch.randint(0, 100, (ROWS, k + 1))
    seeds, index = torch.randint(0, 1 << 62, (ROWS,)), torch.randint(0, 4096, (ROWS,))
    whole = simulate_acceptance(drafts, targets, rate, seeds, index).num_accepted
    order = torch.randperm(ROWS)
    shuffled = simulate_acceptance(drafts[order], targets[order], rate, seeds[order], index[order])
    assert torch.equal(shuffled.num_accepted, whole[order])
    following = simulate_acceptance(drafts, targets, rate, seeds, index + 1).num_accepted
    both_full = ((whole == k) & (following == k)).double().mean().item()
    assert both_full == pytest.approx(rate ** (2 * k), abs=0.02)  # independent steps


def test_more_drafts_than_the_counter_layout_allows_is_rejected():
    drafts, targets = torch.zeros(1, 65, dtype=torch.int64), torch.zeros(1, 66, dtype=torch.int64)
    with pytest.raises(ValueError, match="at most 64 drafts"):
        simulate_acceptance(
            drafts, targets, 0.5, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        )
