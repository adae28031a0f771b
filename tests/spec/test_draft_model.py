"""A small draft model behind the Drafter interface proposes its own greedy continuation."""

import pytest
import torch

from tpfuse.spec.draft_model import DraftModelDrafter
from tpfuse.spec.drafter import DraftInputs
from tpfuse.spec.paged import metadata_for_positions

from .eagle3_reference import PagedSequences
from .fixtures import model_kv_caches, random_model

K = 3


@pytest.fixture
def draft_model(target_config):
    return random_model(target_config, seed=0)


def kv_caches(model, paged):
    return model_kv_caches(model, paged.num_blocks, paged.block_size)


@torch.inference_mode()
def greedy_continuation(model, tokens, k):
    """The model's own greedy continuation, recomputed from scratch with a fresh cache each token."""
    tokens = list(tokens)
    for _ in range(k):
        paged = PagedSequences(1, len(tokens) + 1)
        positions = torch.arange(len(tokens))
        loc = torch.tensor([0, len(tokens)], dtype=torch.int32)
        attn = metadata_for_positions(paged.block_tables, paged.block_size, positions, loc)
        hidden, _ = model(torch.tensor(tokens), positions, attn, kv_caches(model, paged))
        tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return tokens[-k:]


def step_inputs(paged, verified, starts):
    """verified[b]: the tokens at positions starts[b].. followed by the newest token."""
    input_ids = torch.cat([torch.tensor(v[:-1]) for v in verified])
    next_ids = torch.cat([torch.tensor(v[1:]) for v in verified])
    positions = torch.cat([torch.arange(s, s + len(v) - 1) for s, v in zip(starts, verified, strict=True)])
    loc = torch.tensor(
        [0, *torch.tensor([len(v) - 1 for v in verified]).cumsum(0).tolist()], dtype=torch.int32
    )
    return DraftInputs(input_ids, positions, next_ids, loc, paged.block_tables, paged.block_size)


def test_proposals_for_a_batch_of_prompts_are_the_models_greedy_continuations(draft_model, target_config):
    prompts = [[3, 14, 15, 9, 2, 6], [5, 3], [8, 9, 7, 9, 3, 2, 3, 8, 4]]
    paged = PagedSequences(len(prompts), 24)
    drafter = DraftModelDrafter(draft_model, kv_caches(draft_model, paged), target_config.vocab_size)
    proposal = drafter.propose(step_inputs(paged, prompts, [0, 0, 0]), K)
    assert proposal.token_ids.tolist() == [greedy_continuation(draft_model, p, K) for p in prompts]


def test_proposals_after_a_partly_accepted_step_continue_the_full_history(draft_model, target_config):
    prompt = [3, 14, 15, 9, 2, 6]
    paged = PagedSequences(1, 24)
    drafter = DraftModelDrafter(draft_model, kv_caches(draft_model, paged), target_config.vocab_size)
    first = drafter.propose(step_inputs(paged, [prompt], [0]), K).token_ids[0].tolist()
    # The target accepted the first draft and emitted token 11 as its correction.
    verified = [prompt[-1], first[0], 11]
    proposal = drafter.propose(step_inputs(paged, [verified], [len(prompt) - 1]), K)
    assert proposal.token_ids[0].tolist() == greedy_continuation(draft_model, [*prompt, first[0], 11], K)


def test_zero_draft_tokens_keeps_the_draft_cache_current(draft_model, target_config):
    prompt = [4, 8, 15, 16, 23]
    paged = PagedSequences(1, 24)
    drafter = DraftModelDrafter(draft_model, kv_caches(draft_model, paged), target_config.vocab_size)
    assert drafter.propose(step_inputs(paged, [prompt], [0]), 0).token_ids.shape == (1, 0)
    proposal = drafter.propose(step_inputs(paged, [[prompt[-1], 42]], [len(prompt) - 1]), K)
    assert proposal.token_ids[0].tolist() == greedy_continuation(draft_model, [*prompt, 42], K)


def test_sampled_drafts_carry_their_distributions(draft_model, target_config):
    prompts = [[1, 2, 3], [4, 5, 6]]
    paged = PagedSequences(2, 24)
    drafter = DraftModelDrafter(draft_model, kv_caches(draft_model, paged), target_config.vocab_size)
    inputs = step_inputs(paged, prompts, [0, 0])
    inputs.temperatures, inputs.seeds = torch.tensor([0.8, 1.2]), torch.tensor([1, 2])
    proposal = drafter.propose(inputs, K)
    assert proposal.probs.shape == (2, K, target_config.vocab_size)
    torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(2, K))
    assert (proposal.probs.gather(2, proposal.token_ids[..., None]) > 0).all()
