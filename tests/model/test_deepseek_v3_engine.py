"""A tiny DeepseekV3ForCausalLM checkpoint served by the engine on CPU: the latent-cache layout goes
through sizing, allocation, chunked prefill, the prefix cache and speculative verify, and greedy
tokens equal transformers' generate (speculative greedy equals plain greedy)."""

from __future__ import annotations

import pytest

from tests.engine.checkpoints import BOS, EOS, VOCAB, hf_greedy, save_byte_tokenizer
from tests.model.test_deepseek_v3 import build_deepseek_checkpoint
from tpfuse.config import SpeculativeConfig
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
PROMPTS = [[5, 17, 33, 100, 2, 9, 81, 81, 5, 17, 33], [200, 3], list(range(40, 70))]
ENGINE = dict(device="cpu", num_kv_blocks=96, block_size=4, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek_v3")
    hf_model = build_deepseek_checkpoint(
        directory, "q_lora_yarn_tied_groups", vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS,
        pad_token_id=EOS,
    )  # fmt: skip
    save_byte_tokenizer(directory)
    return str(directory), [hf_greedy(hf_model, p, NEW_TOKENS) for p in PROMPTS]


def test_engine_greedy_tokens_equal_transformers_with_chunked_prefill_and_prefix_cache(checkpoint):
    directory, expected = checkpoint
    llm = LLM(directory, **ENGINE)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    again = llm.generate(PROMPTS[2], GREEDY)[0]  # 30-token prompt: its full blocks come from the cache
    assert again.token_ids == expected[2] and again.num_cached_tokens == 28
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    llm.shutdown()


def test_ngram_speculative_greedy_equals_plain_greedy(checkpoint):
    directory, expected = checkpoint
    spec = SpeculativeConfig(algorithm="ngram", num_steps=3, adaptive=False)
    llm = LLM(directory, **ENGINE, speculative=spec)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    llm.shutdown()
