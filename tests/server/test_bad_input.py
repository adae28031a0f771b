"""Every bad input gets its status code and an OpenAI-style error body naming the field, and the
server answers a normal request right after."""

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
TOO_LONG_PROMPT = "x" * 5000  # the tiny model's context is 2048 tokens; one byte is one token


def _normal_request_is_served(url: str) -> None:
    body = {"model": "tiny", "prompt": "still there?", "max_tokens": 2, "ignore_eos": True}
    response = httpx.post(url + COMPLETIONS, json=body, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "path, body, param",
    [
        (COMPLETIONS, {"model": "tiny", "prompt": 3}, "prompt"),
        (COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        (COMPLETIONS, {"model": "tiny", "prompt": "hi", "temperature": "hot"}, "temperature"),
        (CHAT, {"model": "tiny", "messages": USER, "stream": "yes"}, "stream"),
        (COMPLETIONS, {"model": "gpt-4", "prompt": "hi"}, "model"),
        (CHAT, {"model": "no-such-model", "messages": USER}, "model"),
        (COMPLETIONS, {"model": "tiny", "prompt": ""}, "prompt"),
        (CHAT, {"model": "tiny", "messages": []}, "messages"),
        (COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens"),
        (COMPLETIONS, {"model": "tiny", "prompt": "hi", "max_tokens": 4096}, "max_tokens"),
        (CHAT, {"model": "tiny", "messages": USER, "max_tokens": 4096}, "max_tokens"),
        (COMPLETIONS, {"model": "tiny", "prompt": TOO_LONG_PROMPT}, "prompt"),
        (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": TOO_LONG_PROMPT}]}, "messages"),
        (COMPLETIONS, {"model": "tiny", "prompt": [1, 2, 10**9]}, "prompt"),
    ],
)
def test_bad_field_is_400_naming_it_and_the_server_keeps_serving(tiny_server, path, body, param):
    response = httpx.post(tiny_server.url + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    _normal_request_is_served(tiny_server.url)


@pytest.mark.parametrize("content", [b"{not json", b"", '{"prompt": "\xff"}'.encode("latin-1"), b"[1, 2]"])
def test_malformed_body_is_400_and_the_server_keeps_serving(tiny_server, content):
    response = httpx.post(
        tiny_server.url + COMPLETIONS,
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    _normal_request_is_served(tiny_server.url)


def test_unknown_path_is_404_with_an_error_body(tiny_server):
    response = httpx.get(tiny_server.url + "/v1/nothing", timeout=10)
    assert response.status_code == 404 and "error" in response.json()
