"""Process lifecycle, auth and stop strings, on the fake engine (fast to start, emits letters):
readiness, failed start, signals, API key."""

import contextlib
import signal
import time

import httpx
import pytest
from tests.server.conftest import API_KEY
from tests.server.server_process import start_server

from tpfuse.server.launcher import ServerSubprocess

FAKE = "tests.server.serve_fake"


def _complete(url, headers=None):
    return httpx.post(
        url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers, timeout=10
    )


def test_missing_api_key_is_401_with_an_openai_error_body(fake_server):
    response = _complete(fake_server.url)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_wrong_api_key_is_401(fake_server):
    assert _complete(fake_server.url, {"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(fake_server.url + "/v1/models", timeout=10).status_code == 401


def test_stop_string_cuts_the_text_before_it_and_finishes_with_stop(fake_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "Find a stop string in", "max_tokens": 40, "temperature": 0}
    url = fake_server.url + "/v1/completions"
    text = httpx.post(url, json=body, headers=headers, timeout=10).json()["choices"][0]["text"]
    stop = text[20:23]
    result = httpx.post(url, json={**body, "stop": ["zzzz", stop]}, headers=headers, timeout=10).json()
    assert result["choices"][0]["text"] == text[: text.index(stop)]
    assert result["choices"][0]["finish_reason"] == "stop"


def test_right_api_key_is_served_after_refusals(fake_server):
    _complete(fake_server.url)
    response = _complete(fake_server.url, {"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_health_needs_no_key(fake_server):
    assert httpx.get(fake_server.url + "/health", timeout=10).status_code == 200


def test_health_is_503_until_the_engine_is_ready_then_200():
    server = ServerSubprocess(["--slow-start", "--device", "cpu"], module=FAKE)
    try:
        codes = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and 200 not in codes:
            with contextlib.suppress(httpx.HTTPError):
                codes.append(httpx.get(server.url + "/health", timeout=2).status_code)
            time.sleep(0.05)
        assert 503 in codes and codes[-1] == 200
        assert "ready at " + server.url in server.output()
    finally:
        server.stop()
        server.remove_log()


def test_engine_that_fails_to_start_ends_the_server_with_its_reason():
    server = ServerSubprocess(["--fail-at-start", "--device", "cpu"], module=FAKE)
    try:
        code = server.proc.wait(60)
        assert code == 1
        assert "checkpoint missing" in server.output()
        assert server.wait_group_gone(10), "the engine process outlived the server"
    finally:
        server.stop()
        server.remove_log()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_server_and_engine(sig):
    server = start_server(FAKE, ["--device", "cpu"])
    code = server.stop(sig, timeout=20)
    try:
        assert code == 0, server.output()
        assert not server.group_alive()
    finally:
        server.remove_log()
