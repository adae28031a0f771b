"""EAGLE-3 tree drafting through the engine (--speculative-eagle-topk > 1): greedy output equals plain
greedy token for token at batch 1, in mixed batches with a late arrival, and at TP=2 over gloo."""

import pytest

from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.llm import LLM

from .spec_helpers import (
    ENGINE,
    PROMPTS,
    greedy,
    rig_drafter,
    run_with_late_arrival,
    spec_config,
    write_eagle3_head,
)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return write_eagle3_head(str(tmp_path_factory.mktemp("eagle3_tree")))


@pytest.fixture(scope="module")
def plain_tokens():
    return run_with_late_arrival(LLMEngine(EngineConfig(**ENGINE)), greedy(14))


def tree_config(head_dir, topk, nodes, **kw):
    return spec_config("eagle3", head_dir, eagle_topk=topk, num_draft_tokens=nodes, adaptive=False, **kw)


@pytest.mark.parametrize("topk,nodes", [(2, 6), (3, 8), (4, 10)])
def test_tree_greedy_equals_plain_greedy_at_batch_one(head_dir, topk, nodes):
    prompt = LLM(config=EngineConfig(**ENGINE)).tokenizer.encode(PROMPTS[2])
    expected = LLM(config=EngineConfig(**ENGINE)).generate(prompt, greedy(max_tokens=17))[0].token_ids
    llm = LLM(config=EngineConfig(**ENGINE, speculative=tree_config(head_dir, topk, nodes)))
    assert llm.generate(prompt, greedy(max_tokens=17))[0].token_ids == expected
    assert llm.engine.stats().spec_num_drafts_total > 0


@pytest.mark.parametrize("topk,nodes", [(2, 6), (4, 9)])
def test_tree_greedy_equals_plain_greedy_in_mixed_batches_with_a_late_arrival(
    plain_tokens, head_dir, topk, nodes
):
    engine = LLMEngine(EngineConfig(**ENGINE, speculative=tree_config(head_dir, topk, nodes)))
    assert run_with_late_arrival(engine, greedy(14)) == plain_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_tree_greedy_at_tp2_equals_plain_greedy_at_tp1(plain_tokens, head_dir):
    engine = LLMEngine(EngineConfig(**ENGINE, tp_size=2, speculative=tree_config(head_dir, 3, 7)))
    try:
        assert run_with_late_arrival(engine, greedy(14)) == plain_tokens
        assert engine.stats().spec_num_drafts_total > 0
    finally:
        engine.shutdown()


def test_tree_accepting_a_non_first_branch_moves_its_kv_and_stays_lossless(head_dir, monkeypatch):
    """A rigged drafter puts the target's true continuation on the second child of the root (decoys on
    first children): every step accepts 3 drafts whose KV sits at non-path slots and must be moved."""

    plain = LLM(config=EngineConfig(**ENGINE))
    prompt = plain.tokenizer.encode(PROMPTS[2])
    expected = plain.generate(prompt, greedy(max_tokens=17))[0].token_ids
    full = prompt + expected + [0] * 8
    rig_drafter(monkeypatch, full)
    llm = LLM(config=EngineConfig(**ENGINE, speculative=tree_config(head_dir, 2, 6)))
    assert llm.generate(prompt, greedy(max_tokens=17))[0].token_ids == expected
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens_total >= 3 * (stats.spec_num_drafts_total - 1)


def test_tree_drafting_turns_prefix_caching_off():
    # accepted-path KV is moved lazily (next step), so blocks of a sequence that ends first must
    # never be shared through the prefix cache
    from tpfuse.config import EngineConfig, SpeculativeConfig

    spec = SpeculativeConfig(algorithm="eagle3", num_steps=3, eagle_topk=2, num_draft_tokens=6)
    assert EngineConfig(speculative=spec).enable_prefix_caching is False
    chain = SpeculativeConfig(algorithm="eagle3", num_steps=3)
    assert EngineConfig(speculative=chain).enable_prefix_caching is True
