"""`tpfuse serve` on a real model: the SmolLM2-135M-Instruct Q4_1 GGUF (cached by
tests/model/smollm2_gguf.py; tokenizer and chat template from the file) on the CPU in float32,
asked through the official openai client what the capital of France is: the answer names Paris."""

from __future__ import annotations

import openai
import pytest
from tests.model.smollm2_gguf import smollm2_gguf
from tests.server.server_process import start_server

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def gguf_server():
    args = ["serve", "--model", smollm2_gguf(), "--served-model-name", "smollm2", "--device", "cpu"]
    server = start_server("tpfuse", [*args, "--dtype", "float32", "--num-kv-blocks", "64"])
    yield server
    server.stop()
    server.remove_log()


def test_served_gguf_answers_the_capital_of_france_through_the_openai_api(gguf_server):
    client = openai.OpenAI(base_url=gguf_server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    assert "smollm2" in [m.id for m in client.models.list().data]
    result = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    message = result.choices[0].message
    assert message.role == "assistant" and "Paris" in message.content, message.content
    assert 0 < result.usage.completion_tokens <= MAX_TOKENS
    assert result.usage.prompt_tokens > 7  # the file's chat template wrapped the question


@pytest.mark.gpu
def test_served_gguf_answers_in_bfloat16_on_the_gpu_streamed():
    """Device machine: the Q4_1 linears on the group-quantized Triton kernels, CUDA graphs, bf16."""
    args = ["serve", "--model", smollm2_gguf(), "--served-model-name", "smollm2", "--device", "cuda"]
    server = start_server("tpfuse", [*args, "--dtype", "bfloat16", "--mem-fraction-static", "0.3"], 600)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert "Paris" in text, text
    finally:
        server.stop()
        server.remove_log()
