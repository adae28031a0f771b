"""The tiny Qwen3-MoE checkpoint through LLMEngine: greedy tokens equal transformers', and n-gram
speculation (chunked prefill in mixed batches, a late arrival) equals plain greedy token for token."""

from __future__ import annotations

import pytest

from tests.engine.checkpoints import build_checkpoint, hf_greedy
from tests.engine.spec_helpers import greedy, run_with_late_arrival, spec_config
from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_moe_engine")
    hf_model = build_checkpoint(directory, "qwen3_moe")
    return str(directory), hf_model


def engine_config(directory: str, **kw) -> EngineConfig:
    return EngineConfig(model=directory, device="cpu", num_kv_blocks=256, max_num_batched_tokens=20, **kw)


def test_moe_engine_greedy_equals_transformers(checkpoint):
    directory, hf_model = checkpoint
    prompt = [5, 17, 33, 100, 2, 9, 81, 44, 250, 3, 3]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    [out] = LLM(config=engine_config(directory)).generate([prompt], params)
    assert out.token_ids == hf_greedy(hf_model, prompt, 12)


def test_moe_ngram_speculation_equals_plain_greedy(checkpoint):
    directory, _ = checkpoint
    plain = run_with_late_arrival(LLMEngine(engine_config(directory)), greedy(max_tokens=12))
    speculative = LLMEngine(engine_config(directory, speculative=spec_config("ngram", adaptive=False)))
    assert run_with_late_arrival(speculative, greedy(max_tokens=12)) == plain
    assert speculative.stats().spec_num_accepted_tokens_total > 0
    assert speculative.block_manager.num_free_blocks == speculative.block_manager.num_blocks
