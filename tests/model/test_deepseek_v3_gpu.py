"""A tiny DeepseekV3ForCausalLM on the GPU through the engine: Triton MLA kernels, fused MoE and
grouped routing, eager and in CUDA graphs (plain decode and n-gram verify), give transformers'
float32 greedy tokens (device machine only). Router groups do not tie here: on CUDA the Triton
router breaks ties to the lower id, torch.topk (transformers on the CPU) its own way."""

from __future__ import annotations

import pytest

from tests.engine.checkpoints import BOS, EOS, VOCAB, hf_greedy, save_byte_tokenizer
from tests.model.test_deepseek_v3 import build_deepseek_checkpoint
from tests.model.test_deepseek_v3_engine import GREEDY, NEW_TOKENS, PROMPTS
from tpfuse.config import SpeculativeConfig
from tpfuse.engine.llm import LLM

pytestmark = pytest.mark.gpu

ENGINE = dict(device="cuda", block_size=16, max_num_batched_tokens=16, mem_fraction_static=0.3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek_v3_gpu")
    hf_model = build_deepseek_checkpoint(
        directory, "q_lora_yarn_tied_groups", tie_groups=False, vocab_size=VOCAB, bos_token_id=BOS,
        eos_token_id=EOS, pad_token_id=EOS,
    )  # fmt: skip
    save_byte_tokenizer(directory)
    return str(directory), [hf_greedy(hf_model, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_greedy_tokens_on_cuda_equal_transformers(checkpoint, enforce_eager):
    directory, expected = checkpoint
    llm = LLM(directory, enforce_eager=enforce_eager, **ENGINE)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    llm.shutdown()


def test_ngram_speculative_greedy_on_cuda_graphs_equals_transformers(checkpoint):
    directory, expected = checkpoint
    spec = SpeculativeConfig(algorithm="ngram", num_steps=3, adaptive=False)
    llm = LLM(directory, speculative=spec, **ENGINE)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    llm.shutdown()
