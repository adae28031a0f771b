"""The server on the GPU (device machine): the same API on CUDA, batching invariance with CUDA graphs,
aborts, and a real-shape model. Run: pytest -m gpu tests/server"""

import asyncio
import json
import time

import httpx
import openai
import pytest
from tests.server.server_process import start_server

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_server():
    # a small KV share: the llama-3.1-8b test below starts its own server while this one is up
    server = start_server(
        "tpfuse.server",
        ["--device", "cuda", "--model", "tiny", "--mem-fraction-static", "0.2"],
        start_timeout=600,
    )
    yield server
    server.stop()
    server.remove_log()


def _texts(url: str, prompts: list[str], max_tokens: int, concurrent: bool) -> list[str]:
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            bodies = [
                {"model": "tiny", "prompt": p, "max_tokens": max_tokens, "temperature": 0} for p in prompts
            ]
            if concurrent:
                responses = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
            else:
                responses = [await http.post("/v1/completions", json=b) for b in bodies]
        return [r.json()["choices"][0]["text"] for r in responses]

    return asyncio.run(run())


def test_gpu_server_answers_completion_chat_and_stream(gpu_server):
    client = openai.OpenAI(base_url=gpu_server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    completion = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    assert list(stream)[-1].usage.completion_tokens == 8


def test_gpu_48_concurrent_greedy_requests_equal_their_sequential_outputs(gpu_server):
    prompts = [f"Prompt {i}: " + "xyz" * (i % 7) for i in range(48)]
    sequential = _texts(gpu_server.url, prompts, 32, concurrent=False)
    assert _texts(gpu_server.url, prompts, 32, concurrent=True) == sequential


def test_gpu_client_that_disconnects_frees_its_kv_blocks(gpu_server):
    body = {"model": "tiny", "prompt": "go", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", gpu_server.url + "/v1/completions", json=body, timeout=60) as response:
        next(response.iter_lines())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        metrics = httpx.get(gpu_server.url + "/metrics", timeout=10).text
        if "tpfuse_kv_cache_usage_ratio 0.0" in metrics and "tpfuse_num_requests_running 0.0" in metrics:
            return
        time.sleep(0.1)
    raise AssertionError("KV blocks still in use 20 s after the client left")


def test_gpu_server_serves_llama_8b_shapes_with_dummy_weights():
    server = start_server(
        "tpfuse.server",
        ["--device", "cuda", "--model", "llama-3.1-8b", "--load-format", "dummy"],
        start_timeout=900,
    )
    try:
        body = {
            "model": "llama-3.1-8b",
            "prompt": [1000 + i for i in range(64)],
            "max_tokens": 64,
            "ignore_eos": True,
        }
        result = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()
        assert result["usage"]["completion_tokens"] == 64
    finally:
        server.stop()
        server.remove_log()


def test_requests_that_once_killed_the_engine_are_400_on_cuda_and_features_run_on_graphs(gpu_server):
    """On CUDA an out-of-vocabulary id reaching the sampler is a device-side assert that ends the
    process, so these must stop in the HTTP process; logprobs, a grammar and n run beside plain
    requests on graph steps."""
    url = gpu_server.url + "/v1/completions"
    for body in (
        {"prompt": "x", "top_k": 2**63},
        {"prompt": "x", "stop_token_ids": [300], "min_tokens": 1},
        {"prompt": "x", "logit_bias": {"300": 5}},
        {"prompt": [1, 300]},
    ):
        assert httpx.post(url, json={"max_tokens": 2, **body}, timeout=60).status_code == 400
    assert httpx.get(gpu_server.url + "/health", timeout=10).status_code == 200
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
    }
    fancy = {
        "prompt": "JSON:",
        "max_tokens": 32,
        "temperature": 0,
        "logprobs": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    }
    plain = {"prompt": "plain", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "n": 3, "seed": 1}

    async def both():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(http.post(url, json=fancy), http.post(url, json=plain))

    constrained, batch = asyncio.run(both())
    choice = constrained.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and 0 <= json.loads(choice["text"])["n"] <= 9
    assert len(choice["logprobs"]["tokens"]) == constrained.json()["usage"]["completion_tokens"]
    assert [c["index"] for c in batch.json()["choices"]] == [0, 1, 2]
