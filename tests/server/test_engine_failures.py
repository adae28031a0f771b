"""The engine failing under the server (fake engine, faults on request): a failed step ends its own
requests only; a dead or hung engine is reported, its requests end with an error, and it is
restarted (or the server exits non-zero with --no-restart-engine); SIGTERM ends open streams with
an error event."""

import json
import os
import signal
import time

import httpx
import pytest
from tests.server.fake_engine import DIE_IN_STEP, FAIL_STEP, HANG_IN_STEP
from tests.server.server_process import start_server

FAKE = "tests.server.serve_fake"


def _post(url: str, prompt: str, max_tokens: int = 3, **fields) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def _served(url: str) -> bool:
    response = _post(url, "normal")
    return response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


def _wait_health(url: str, status: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == status:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"/health never answered {status}")


def _engine_pid(server_pid: int) -> int:
    """The engine process among the server's children (multiprocessing's resource tracker aside)."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"resource_tracker" not in cmdline:
            return pid
    raise AssertionError(f"no engine process among {children}")


@pytest.fixture(scope="module")
def server():
    server = start_server(
        FAKE, ["--device", "cpu", "--engine-step-timeout", "2", "--shutdown-drain-timeout", "0.2"]
    )
    yield server
    server.stop()
    server.remove_log()


def test_a_failed_step_errors_its_request_and_the_engine_keeps_serving(server):
    response = _post(server.url, f"please {FAIL_STEP} now")
    assert response.status_code == 503 and "failed while running this request" in response.text
    assert "Traceback" not in response.text
    assert _served(server.url)
    assert "a step failed" in server.output()


def test_killed_engine_is_reported_and_restarted(server):
    restarts = server.output().count("the engine is serving again")
    os.kill(_engine_pid(server.proc.pid), signal.SIGKILL)
    # /health answers 200 until the HTTP process has seen the pipe's EOF: wait for the restart itself
    deadline = time.monotonic() + 60
    while server.output().count("the engine is serving again") == restarts and time.monotonic() < deadline:
        time.sleep(0.05)
    _wait_health(server.url, 200)
    assert _served(server.url)
    assert "the engine process died" in server.output() and "restarting it" in server.output()


def test_engine_that_dies_in_a_step_fails_its_request_and_comes_back(server):
    response = _post(server.url, DIE_IN_STEP)
    assert response.status_code == 503 and "died" in response.json()["error"]["message"]
    _wait_health(server.url, 200)
    assert _served(server.url)


def test_hung_engine_is_killed_after_the_step_timeout_and_restarted(server):
    started = time.monotonic()
    response = _post(server.url, HANG_IN_STEP)
    assert response.status_code == 503 and time.monotonic() - started < 20
    _wait_health(server.url, 200)
    assert _served(server.url)
    output = server.output()
    assert "a hung step or rank" in output and "running," in output
    assert "fake_engine.py" in output and "in step" in output  # the hung thread's stack, from faulthandler


def test_sigterm_ends_an_open_stream_with_an_error_event_and_exits_non_zero_after_an_engine_death(server):
    assert "the engine process died" in server.output()  # the tests above killed it
    body = {"prompt": "x", "max_tokens": 240, "stream": True, "ignore_eos": True}
    # 240 tokens at the fake engine's 2 ms per step outlast the 0.2 s drain
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert "shutting down" in json.loads(rest[-2][len("data: ") :])["error"]["message"]
    assert server.proc.wait(20) == 1
    assert "Traceback" not in server.output().split("a step failed")[0]


def test_no_restart_engine_makes_the_server_exit_non_zero_when_the_engine_dies():
    server = start_server(FAKE, ["--device", "cpu", "--no-restart-engine"])
    try:
        assert _post(server.url, DIE_IN_STEP).status_code == 503
        assert server.proc.wait(30) == 1
        assert "--no-restart-engine" in server.output()
        assert server.wait_group_gone(10)
    finally:
        server.stop()
        server.remove_log()
