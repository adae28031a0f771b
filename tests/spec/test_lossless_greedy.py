"""Speculative greedy decoding emits exactly the target's greedy tokens, whatever the drafter."""

import pytest

from tpfuse.spec.draft_model import DraftModelDrafter
from tpfuse.spec.eagle3_checkpoint import load_eagle3_head, save_random_eagle3_head
from tpfuse.spec.eagle3_drafter import Eagle3Drafter, target_embedding
from tpfuse.spec.ngram import NgramDrafter

from .fixtures import model_kv_caches, random_model, tiny_target_config
from .spec_loop import greedy_decode, speculative_greedy_decode

PROMPTS = [[3, 14, 15, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [1, 4]]
NUM_TOKENS = 12


def model_kv(model, paged):
    return model_kv_caches(model, paged.num_blocks, paged.block_size)


@pytest.fixture(scope="module")
def setup():
    config = tiny_target_config()
    target = random_model(config, seed=0)
    return config, target, greedy_decode(target, PROMPTS, NUM_TOKENS)


def test_ngram_drafting_is_lossless(setup):
    config, target, expected = setup
    outputs, _, _ = speculative_greedy_decode(target, PROMPTS, NUM_TOKENS, lambda paged: NgramDrafter(3), 3)
    assert outputs == expected


def test_draft_model_identical_to_the_target_accepts_everything_and_is_lossless(setup):
    config, target, expected = setup

    def make(paged):
        return DraftModelDrafter(
            target_copy := random_model(config, seed=0), model_kv(target_copy, paged), 50
        )

    k = 3
    outputs, accepted, _ = speculative_greedy_decode(target, PROMPTS, NUM_TOKENS, make, k)
    assert outputs == expected
    steps = -(-(NUM_TOKENS - 1) // (k + 1))  # the prefill emits one token, each step k + 1
    assert accepted == len(PROMPTS) * steps * k


def test_different_draft_model_is_lossless(setup):
    config, target, expected = setup

    def make(paged):
        draft = random_model(config, seed=5)
        return DraftModelDrafter(draft, model_kv(draft, paged), 50)

    outputs, _, _ = speculative_greedy_decode(target, PROMPTS, NUM_TOKENS, make, 2)
    assert outputs == expected


def test_eagle3_head_drafting_is_lossless(setup, tmp_path):
    config, target, expected = setup
    save_random_eagle3_head(str(tmp_path), config, draft_vocab_size=30, std=0.3)
    head = load_eagle3_head(str(tmp_path), config)
    target.aux_hidden_state_layers = head.config.capture_layers(config.num_layers)

    def make(paged):
        return Eagle3Drafter(head, target_embedding(target), paged.kv_cache(head.kv_cache_shape), 50)

    try:
        outputs, _, _ = speculative_greedy_decode(target, PROMPTS, NUM_TOKENS, make, 3)
    finally:
        target.aux_hidden_state_layers = ()
    assert outputs == expected
