"""The OpenAI-compatible API on the embedded tiny model, through the official openai client and httpx."""

import asyncio

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def _completion(url: str, prompt, **fields) -> dict:
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, **fields}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _streamed_text(url: str, path: str, body: dict) -> tuple[str, list[dict]]:
    import json

    chunks = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        chunks.append(json.loads(line[len("data: ") :]))
    key = "delta" if path.endswith("chat/completions") else None
    text = "".join(
        (c["choices"][0]["delta"].get("content") or "") if key else c["choices"][0]["text"]
        for c in chunks
        if c["choices"]
    )
    return text, chunks


def test_openai_client_completion_has_text_and_usage(client):
    result = client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    assert result.choices[0].finish_reason == "length" and isinstance(result.choices[0].text, str)
    assert result.usage.completion_tokens == 6
    assert result.usage.total_tokens == result.usage.prompt_tokens + 6


def test_openai_client_chat_has_an_assistant_message_and_usage(client):
    result = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi!"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant" and result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 5


def test_openai_client_chat_stream_has_role_first_finish_last_and_a_usage_chunk(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi!"}],
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_continuous_usage_stats_puts_the_running_token_count_in_every_chunk(tiny_server):
    body = {
        "model": "tiny",
        "prompt": "count",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    _, chunks = _streamed_text(tiny_server.url, "/v1/completions", body)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(set(counts)) and counts[-1] == 6
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_openai_client_lists_the_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_streamed_completion_text_equals_the_non_streamed_text(tiny_server):
    body = {"model": "tiny", "prompt": "Streaming and not", "max_tokens": 12, "temperature": 0}
    whole = _completion(tiny_server.url, body["prompt"], max_tokens=12)
    text, chunks = _streamed_text(tiny_server.url, "/v1/completions", body)
    assert text == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_streamed_chat_text_equals_the_non_streamed_text(tiny_server):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "same?"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    whole = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=120).json()
    text, _ = _streamed_text(tiny_server.url, "/v1/chat/completions", body)
    assert text == whole["choices"][0]["message"]["content"]


def test_32_concurrent_greedy_requests_equal_their_sequential_outputs(tiny_server):
    prompts = [f"Request number {i}: " + "abc" * (i % 5) for i in range(32)]
    sequential = [_completion(tiny_server.url, p, max_tokens=4)["choices"][0]["text"] for p in prompts]

    async def concurrent():
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=120) as http:
            bodies = [{"model": "tiny", "prompt": p, "max_tokens": 4, "temperature": 0} for p in prompts]
            responses = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
        return [r.json()["choices"][0]["text"] for r in responses]

    assert asyncio.run(concurrent()) == sequential


def test_repeated_prompt_hits_the_prefix_cache_and_gives_the_same_output(tiny_server):
    prompt = "A prompt long enough to fill several KV blocks of sixteen tokens each. " * 2
    first = _completion(tiny_server.url, prompt, max_tokens=4)
    second = _completion(tiny_server.url, prompt, max_tokens=4)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 4
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_seeded_sampling_is_reproducible(tiny_server):
    fields = {
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 50,
        "seed": 1234,
        "ignore_eos": True,
    }
    first = _completion(tiny_server.url, "seeded", **fields)["choices"][0]["text"]
    assert _completion(tiny_server.url, "seeded", **fields)["choices"][0]["text"] == first


def test_min_tokens_and_ignore_eos_are_honoured(tiny_server):
    result = _completion(tiny_server.url, "long", max_tokens=10, min_tokens=10)
    assert result["usage"]["completion_tokens"] == 10
