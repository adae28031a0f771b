"""EAGLE-3 speculation on the tiny Qwen3-MoE checkpoint (three layers: sparse, dense via
mlp_only_layers, sparse) with a random EAGLE-3 head of its shape, through LLMEngine: fixed and
adaptive k give plain greedy tokens token for token while drafts are proposed and steps are chained
(spec_chain.py); with simulated acceptance the chained engine accepts exactly what the synchronous
one does, so multi-token verify steps through the experts are exercised too."""

from __future__ import annotations

import pytest

from tests.engine.checkpoints import build_checkpoint
from tests.engine.spec_helpers import PROMPTS, greedy, spec_config
from tests.engine.test_spec_chain import _count_chained
from tpfuse.config import EngineConfig
from tpfuse.engine.llm import LLM
from tpfuse.model.loader import load_model_config
from tpfuse.spec.eagle3_checkpoint import save_random_eagle3_head

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def moe_with_head(tmp_path_factory) -> tuple[str, str]:
    """(target checkpoint directory, EAGLE-3 head directory)."""
    target = str(tmp_path_factory.mktemp("qwen3_moe_target"))
    build_checkpoint(target, "qwen3_moe")
    config = load_model_config(EngineConfig(model=target))
    assert config.num_experts == 5 and config.num_layers == 3
    head = str(tmp_path_factory.mktemp("qwen3_moe_eagle3"))
    save_random_eagle3_head(head, config, draft_vocab_size=100, aux_layer_ids=(0, 1, 2), std=0.3)
    return target, head


def engine_kw(target: str, **kw) -> dict:
    # Small budget: the long prompt is prefilled in chunks beside speculative decodes.
    return dict(model=target, device="cpu", num_kv_blocks=256, max_num_batched_tokens=20,
                enable_prefix_caching=False, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def plain_tokens(moe_with_head) -> list[list[int]]:
    target, _ = moe_with_head
    return [o.token_ids for o in LLM(**engine_kw(target)).generate(PROMPTS, greedy(NEW_TOKENS))]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
def test_eagle3_on_moe_gives_plain_greedy_tokens_with_chained_steps(moe_with_head, plain_tokens, adaptive):
    target, head = moe_with_head
    spec = spec_config("eagle3", head, adaptive=adaptive)
    llm = LLM(config=EngineConfig(**engine_kw(target), speculative=spec))
    assert llm.engine.steps.chains
    counts = _count_chained(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS))] == plain_tokens
    stats = llm.engine.stats()
    assert stats.spec_num_drafts_total > 0 and stats.spec_num_draft_tokens_total > 0
    assert counts["chained"] > 0, counts
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_eagle3_on_moe_chained_steps_accept_what_synchronous_steps_accept(moe_with_head):
    """Simulated acceptance length 3: drafts are accepted whatever the target says, so rows move by
    0..k tokens per step and the MoE verify runs k + 1 tokens per row through the experts."""
    target, head = moe_with_head
    outputs, counts = {}, {}
    for chain in (False, True):
        spec = spec_config("eagle3", head, adaptive=False, simulate_acceptance_length=3.0)
        kw = engine_kw(target, disable_overlap_schedule=not chain)
        llm = LLM(config=EngineConfig(**kw, speculative=spec))
        counts[chain] = _count_chained(llm)
        outputs[chain] = [o.token_ids for o in llm.generate(PROMPTS, greedy(NEW_TOKENS, seed=11))]
        assert llm.engine.spec_decoder.stats.acceptance_length > 2.0
    assert counts[False]["chained"] == 0 and counts[True]["chained"] > 2, counts
    assert outputs[True] == outputs[False]
    assert [len(t) for t in outputs[True]] == [NEW_TOKENS] * len(PROMPTS)


@pytest.mark.gpu
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
def test_eagle3_on_moe_with_cuda_verify_graphs_gives_plain_greedy_tokens(moe_with_head, adaptive):
    """Device machine: the fused-MoE kernels inside per-(bucket, k) verify graphs, float32."""
    target, head = moe_with_head
    cuda = dict(device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=1024, cuda_graph_max_bs=8)
    kw = {**engine_kw(target), **cuda}
    plain = [o.token_ids for o in LLM(**kw).generate(PROMPTS, greedy(32))]
    llm = LLM(config=EngineConfig(**kw, speculative=spec_config("eagle3", head, adaptive=adaptive)))
    graphs, replayed = llm.engine.executor.graphs, []
    run = graphs.run

    def recording_run(step, num_draft_tokens=0):
        replayed.append(num_draft_tokens)
        return run(step, num_draft_tokens)

    graphs.run = recording_run
    counts = _count_chained(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(32))] == plain
    assert any(k > 0 for k in replayed) and counts["chained"] > 0, (replayed, counts)
