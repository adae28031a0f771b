"""Tiny DeepseekV3ForCausalLM checkpoints in DeepSeek-V3's FP8 128x128-block layout and Kimi K2's INT4
group-32 experts layout on the GPU through the engine: the quantized Triton linears (W8A16 FP8 and
W4A16 at decode rows, FP8 x FP8 where the GPU has FP8 tensor cores above 64 rows), the quantized
fused MoE, MLA over the kv_b_proj dequantized at load, eager and in CUDA graphs, give transformers'
float32 greedy tokens on the dequantized weights (device machine only)."""

from __future__ import annotations

import pytest

from tests.engine.checkpoints import BOS, EOS, VOCAB, hf_greedy, save_byte_tokenizer
from tests.model.test_deepseek_v3_engine import GREEDY, NEW_TOKENS, PROMPTS
from tests.model.test_deepseek_v3_quantized import FORMATS, write_quantized_deepseek
from tpfuse.engine.llm import LLM

pytestmark = pytest.mark.gpu

ENGINE = dict(device="cuda", block_size=16, max_num_batched_tokens=16, mem_fraction_static=0.3)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, list[list[int]]]]:
    found = {}
    for fmt in FORMATS:
        directory = tmp_path_factory.mktemp(fmt)
        hf_model = write_quantized_deepseek(
            directory, fmt, vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS
        )
        save_byte_tokenizer(directory)
        found[fmt] = (str(directory), [hf_greedy(hf_model, p, NEW_TOKENS) for p in PROMPTS])
    return found


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_greedy_tokens_on_cuda_equal_transformers(checkpoints, fmt, enforce_eager):
    directory, expected = checkpoints[fmt]
    llm = LLM(directory, enforce_eager=enforce_eager, **ENGINE)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    llm.shutdown()
