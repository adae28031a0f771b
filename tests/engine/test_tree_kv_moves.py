"""Tree drafting's accepted-path KV moves, checked on the cache itself.

A tree step stores node i at slot L + i; the next step first copies the accepted path's K/V (and the
EAGLE-3 feature rows) to positions L + 1 .. L + a (SpecWorker.apply_kv_moves). A rigged drafter puts
the target's true continuation on the root's second child, so every step accepts 3 drafts that all
sit at non-path slots. After the last step's moves are applied, the target's cache over the
sequence must equal the cache a plain engine writes when it prefills the same tokens; with the moves
disabled the moved positions must differ (the test's own power check)."""

import pytest
import torch

from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.llm import LLM
from tpfuse.engine.spec_worker import SpecWorker

from .spec_helpers import ENGINE, PROMPTS, greedy, rig_drafter, spec_config, write_eagle3_head

CONFIG = dict(ENGINE, dtype="float32")
NUM_OUTPUT = 20  # tokens to generate before the final step, whose start applies the last moves


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return write_eagle3_head(str(tmp_path_factory.mktemp("eagle3_tree_moves")))


@pytest.fixture(scope="module")
def prompt_and_continuation():
    plain = LLM(config=EngineConfig(**CONFIG))
    prompt = plain.tokenizer.encode(PROMPTS[2])
    return prompt, plain.generate(prompt, greedy(max_tokens=NUM_OUTPUT + 16))[0].token_ids


def cache_rows(engine: LLMEngine, block_table: list[int], positions: int) -> torch.Tensor:
    """[layers, 2, positions, kv_heads, head_dim]: the target's K and V at positions 0 .. positions-1."""
    bs = engine.config.block_size
    slots = torch.tensor([block_table[p // bs] * bs + p % bs for p in range(positions)])
    return torch.stack(
        [torch.stack([c.view(-1, *c.shape[2:])[slots] for c in pair]) for pair in engine.executor.kv_caches]
    ).clone()


def feature_rows(engine: LLMEngine, block_table: list[int], positions: int) -> torch.Tensor:
    bs = engine.config.block_size
    slots = torch.tensor([block_table[p // bs] * bs + p % bs for p in range(positions)])
    return engine.executor.hook.features[slots].clone()


def prefill(engine: LLMEngine, tokens: list[int]):
    """Prefills tokens (chunked under the engine's budget); returns the running sequence."""
    engine.add_request("ref", tokens, greedy(max_tokens=4))
    while True:
        engine.step()
        seq = engine.scheduler.running[0]
        if seq.num_computed_tokens >= len(tokens):
            return seq


def run_tree_then_compare(head_dir, prompt_and_continuation, monkeypatch, moves_on: bool):
    """Returns (spec cache, plain cache, spec features, reference features, moved positions, accepted
    continuation) over the positions whose KV is final after the last step's moves."""
    prompt, continuation = prompt_and_continuation
    rig_drafter(monkeypatch, prompt + continuation + [0] * 8)
    moved_slots: list[int] = []
    real_moves = SpecWorker.apply_kv_moves

    def recording(self, spec, kv_caches):
        moved_slots.extend(spec.kv_move_dst.tolist() if spec.header.num_kv_moves else [])
        if moves_on:
            real_moves(self, spec, kv_caches)

    monkeypatch.setattr(SpecWorker, "apply_kv_moves", recording)
    tree = spec_config("eagle3", head_dir, eagle_topk=2, num_draft_tokens=6, adaptive=False)
    engine = LLMEngine(EngineConfig(**CONFIG, speculative=tree))
    engine.add_request("r", prompt, greedy(max_tokens=NUM_OUTPUT + 12))
    engine.step()
    seq = engine.scheduler.running[0]
    while seq.num_output_tokens < NUM_OUTPUT:
        engine.step()
    final = seq.num_computed_tokens  # positions below this are final once the next step's moves ran
    before = len(moved_slots)
    engine.step()
    assert len(moved_slots) > before, "the last step applied no moves"
    table, bs = list(seq.block_table), engine.config.block_size
    moved = sorted({table.index(s // bs) * bs + s % bs for s in moved_slots})
    spec_kv = cache_rows(engine, table, final)
    spec_features = feature_rows(engine, table, final)
    tokens = seq.token_ids[:final]

    plain = LLMEngine(EngineConfig(**CONFIG))
    plain_kv = cache_rows(plain, list(prefill(plain, tokens).block_table), final)
    # the feature rows' reference: a tree engine that only prefills (no drafts, no moves)
    reference = LLMEngine(EngineConfig(**CONFIG, speculative=tree))
    ref_features = feature_rows(reference, list(prefill(reference, tokens).block_table), final)
    return spec_kv, plain_kv, spec_features, ref_features, moved, seq.output_token_ids


def test_moved_tree_kv_equals_the_plain_prefill_cache(head_dir, prompt_and_continuation, monkeypatch):
    spec_kv, plain_kv, spec_feat, ref_feat, moved, output = run_tree_then_compare(
        head_dir, prompt_and_continuation, monkeypatch, moves_on=True
    )
    prompt, continuation = prompt_and_continuation
    assert output == continuation[: len(output)]
    # at least 4 tree steps accepted the second branch (3 moves each) and every move lands below `final`
    assert len(moved) >= 12 and moved[-1] < spec_kv.shape[2]
    assert spec_kv.dtype == torch.float32
    torch.testing.assert_close(spec_kv, plain_kv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(spec_feat, ref_feat, rtol=1e-5, atol=1e-5)


def test_without_the_moves_the_cache_differs_at_the_moved_positions(
    head_dir, prompt_and_continuation, monkeypatch
):
    spec_kv, plain_kv, spec_feat, ref_feat, moved, _ = run_tree_then_compare(
        head_dir, prompt_and_continuation, monkeypatch, moves_on=False
    )
    assert len(moved) >= 12
    diff = (spec_kv - plain_kv).abs().amax(dim=(0, 1, 3, 4))  # per position
    feature_diff = (spec_feat - ref_feat).abs().amax(dim=1)
    assert bool((diff[moved] > 1e-2).all()), diff[moved]
    assert bool((feature_diff[moved] > 1e-3).all()), feature_diff[moved]
