"""Greedy generation equals transformers' generate token for token, for every architecture."""

import random

import pytest

from tests.engine.checkpoints import ARCHITECTURES, build_checkpoint, hf_greedy
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def engine_and_reference(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = build_checkpoint(directory, request.param)
    llm = LLM(str(directory), device="cpu", num_kv_blocks=256, block_size=4)
    yield llm, hf_model
    llm.shutdown()


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(256) for _ in range(length)]


def test_single_prompt_greedy_tokens_equal_transformers_generate(engine_and_reference):
    llm, hf_model = engine_and_reference
    prompt = random_prompt(random.Random(1), 11)
    [out] = llm.generate([prompt], GREEDY)
    assert out.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)


def test_batch_of_prompts_of_different_lengths_equals_transformers_per_prompt(engine_and_reference):
    llm, hf_model = engine_and_reference
    rng = random.Random(2)
    prompts = [random_prompt(rng, n) for n in (3, 17, 9, 30)]
    outputs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)
