"""A real model: SmolLM2-135M-Instruct as a Q4_1 GGUF (Q4_1 linears run by the group-quantized
path, the Q8_0 embedding dequantized; tokenizer and chat template from the file's metadata).
tpfuse's greedy tokens equal transformers' on the same file (float32, CPU), and a chat answer
names Paris."""

from __future__ import annotations

import pytest

from tests.model.smollm2_gguf import smollm2_gguf
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def llm(gguf_path):
    engine = LLM(gguf_path, device="cpu", dtype="float32", num_kv_blocks=32, block_size=16)
    yield engine
    engine.shutdown()


def test_greedy_tokens_equal_transformers_on_the_same_gguf_file(gguf_path, llm):
    import os

    import torch
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(gguf_path)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    prompts = [[1, 504, 3575, 282, 4649, 314], [1, 1370, 2390, 253, 1345]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs, strict=True):
            expected = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS
            )[0, len(prompt) :].tolist()
            assert out.token_ids == expected


def test_the_chat_template_from_the_file_answers_the_capital_of_france(llm):
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
    assert "Paris" in out.text
