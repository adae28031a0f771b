"""A real model: SmolLM2-135M-Instruct as a Q4_1 GGUF (Q4_1 linears on the group-quantized path, the
Q8_0 embedding dequantized; tokenizer and chat template from the file's metadata), run once through
`tpfuse generate --chat --json` (float32, CPU): its greedy tokens equal transformers' on the same
file (gguf_file=) from the same prompt ids, and the capital-of-France answer names Paris."""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from tests.model.smollm2_gguf import smollm2_gguf
from tpfuse.cli import main

QUESTIONS = ("What is the capital of France?", "Name one primary color.")
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def generated():
    """(gguf path, one JSON record per question) from `tpfuse generate`."""
    path = smollm2_gguf()
    argv = ["generate", "--model", path, "--chat", "--json", "--max-tokens", str(NEW_TOKENS)]
    argv += ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "32"]
    for question in QUESTIONS:
        argv += ["--prompt", question]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    return path, [json.loads(line) for line in stdout.getvalue().splitlines()]


def test_generate_with_the_files_chat_template_names_paris(generated):
    _, records = generated
    assert len(records) == len(QUESTIONS)
    assert "Paris" in records[0]["text"]


def test_greedy_tokens_equal_transformers_loading_the_same_gguf_file(generated):
    import torch
    from transformers import AutoModelForCausalLM

    path, records = generated
    directory, name = os.path.split(path)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    eos = hf_model.generation_config.eos_token_id
    with torch.no_grad():
        for record in records:
            prompt = record["prompt_token_ids"]
            out = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos
            )
            assert record["token_ids"] == out[0, len(prompt) :].tolist()
