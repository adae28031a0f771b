"""A tiny DeepseekV3ForCausalLM on the GPU through the engine: Triton MLA kernels, fused MoE and
grouped routing, eager and in CUDA graphs (plain decode and n-gram verify), give transformers'
float32 greedy tokens (device machine only)."""

from __future__ import annotations

import pytest

from tests.model.test_deepseek_v3_engine import GREEDY, PROMPTS
from tests.model.test_deepseek_v3_engine import checkpoint as checkpoint  # noqa: F401  (the fixture)
from tpfuse.config import SpeculativeConfig
from tpfuse.engine.llm import LLM

pytestmark = pytest.mark.gpu

ENGINE = dict(device="cuda", block_size=16, max_num_batched_tokens=16, mem_fraction_static=0.3)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_greedy_tokens_on_cuda_equal_transformers(checkpoint, enforce_eager):  # noqa: F811
    directory, expected = checkpoint
    llm = LLM(directory, enforce_eager=enforce_eager, **ENGINE)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    llm.shutdown()


def test_ngram_speculative_greedy_on_cuda_graphs_equals_transformers(checkpoint):  # noqa: F811
    directory, expected = checkpoint
    spec = SpeculativeConfig(algorithm="ngram", num_steps=3, adaptive=False)
    llm = LLM(directory, speculative=spec, **ENGINE)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    llm.shutdown()
