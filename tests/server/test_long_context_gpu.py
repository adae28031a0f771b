"""Long contexts end to end on the GPU: the llama-3.1-8b preset (dummy weights, 131072 positions with
Llama 3's rope scaling) serves a 32,000-token and a 128,000-token prompt through `tpfuse serve`,
prefilled in chunks beside nothing else, and streams every requested token.
Run: pytest -m gpu tests/server/test_long_context_gpu.py"""

import json
import random

import httpx
import pytest
from tests.server.server_process import start_server

from tpfuse.model.presets import PRESETS

pytestmark = pytest.mark.gpu

MODEL = "llama-3.1-8b"
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def server_8b():
    server = start_server(
        "tpfuse.server", ["--device", "cuda", "--model", MODEL, "--load-format", "dummy"], start_timeout=900
    )
    yield server
    server.stop()
    server.remove_log()


def _stream(url: str, prompt: list[int], max_tokens: int) -> tuple[dict, str | None, int]:
    """One streamed completion of token ids; returns (the last usage, finish reason, chunks with text)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage, reason, chunks = {}, None, 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                reason = choice["finish_reason"] or reason
                chunks += bool(choice["text"])
    return usage, reason, chunks


@pytest.mark.parametrize("prompt_tokens", [32_000, 128_000])
def test_a_long_prompt_is_served_end_to_end_with_every_token(server_8b, prompt_tokens):
    config = PRESETS[MODEL]
    assert config["max_position_embeddings"] >= prompt_tokens + NEW_TOKENS
    assert config["rope_scaling"]["rope_type"] == "llama3"
    rng = random.Random(prompt_tokens)
    prompt = [rng.randrange(1000, config["vocab_size"]) for _ in range(prompt_tokens)]
    usage, reason, chunks = _stream(server_8b.url, prompt, NEW_TOKENS)
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == NEW_TOKENS
    assert reason == "length"
    assert chunks >= 1
    assert httpx.get(server_8b.url + "/health", timeout=10).status_code == 200
