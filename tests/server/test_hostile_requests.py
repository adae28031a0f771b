"""Hostile requests against the tiny model's server: each gets its status (400 naming the field, or a
normal 200 where the engine can represent the value), no answer leaks internals, /health stays 200
and a normal request is served right after each one."""

import json
import re
import socket
import time

import httpx
import pytest

from tpfuse.model.presets import TINY_VOCAB_SIZE

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
BIG = [2**63, -(2**63) - 1, 2**64, 10**30]
INT_FIELDS = ["max_tokens", "top_k", "seed", "min_tokens", "n", "logprobs"]
FLOAT_FIELDS = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e309"]
# internals an answer must not show: tracebacks, source locations, Python's own advice
LEAKS = re.compile(r"Traceback|\.py\b|\.cc:\d+|/project/|sys\.set_int_max_str_digits")


def _raw(fields: str) -> bytes:
    """A body with raw JSON text for fields (NaN, Infinity: what json.dumps would not write)."""
    return ('{"model": "tiny", "prompt": "hi", "max_tokens": 2, ' + fields + "}").encode()


def _completion(**fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}).encode()


def _chat(**fields) -> bytes:
    return json.dumps({"model": "tiny", "messages": USER, "max_tokens": 2, **fields}).encode()


def _nested(depth: int):
    value = {}
    for _ in range(depth):
        value = {"a": value}
    return value


CASES = [
    # the engine-killers of the issue
    (COMPLETIONS, _completion(top_k=2**63), 400, "top_k"),
    (COMPLETIONS, _completion(stop_token_ids=[300], min_tokens=1), 400, "stop_token_ids"),
    (COMPLETIONS, _completion(stop_token_ids=[TINY_VOCAB_SIZE], min_tokens=1), 400, "stop_token_ids"),
    (CHAT, _chat(stop_token_ids=[2**63 - 1], min_tokens=1), 400, "stop_token_ids"),
    (COMPLETIONS, _raw('"temperature": NaN'), 400, None),
    (COMPLETIONS, b'{"model": "tiny", "prompt": "\\ud800 lone"}', 400, "prompt"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages[0].content"),
    (COMPLETIONS, b"[" * 100_000, 400, None),
    (COMPLETIONS, _completion(user=_nested(40)), 400, None),
    # values the engine can represent are served
    (COMPLETIONS, _completion(top_k=2**63 - 1, temperature=1.0, seed=5), 200, None),
    (COMPLETIONS, _completion(stop_token_ids=[TINY_VOCAB_SIZE - 1], min_tokens=1), 200, None),
    (COMPLETIONS, _completion(seed=-(2**63), temperature=0.7), 200, None),
    (COMPLETIONS, _completion(seed=2**63 - 1, temperature=0.7), 200, None),
    (COMPLETIONS, _completion(temperature=1e-30), 200, None),
    (COMPLETIONS, _completion(temperature=100.0, top_p=1e-300), 200, None),
    (COMPLETIONS, _completion(prompt=[0, TINY_VOCAB_SIZE - 1]), 200, None),
    (CHAT, _chat(messages=[{"role": "user", "content": "\u2028\u0085\u2029 \x00"}]), 200, None),
    # wrong types, oversized lists, unknown fields, bad bodies
    (COMPLETIONS, _completion(prompt="x" * 70_000), 400, "prompt"),  # tokenized in a thread
    (COMPLETIONS, _completion(prompt=[1, 2.5]), 400, "prompt"),
    (COMPLETIONS, _completion(prompt=[TINY_VOCAB_SIZE]), 400, "prompt"),
    (COMPLETIONS, _completion(prompt=[[1], [2]]), 400, "prompt"),
    (COMPLETIONS, _completion(prompt={"text": "hi"}), 400, "prompt"),
    (COMPLETIONS, _completion(stop=["x"] * 17), 400, "stop"),
    (COMPLETIONS, _completion(stop="x" * 5000), 400, "stop"),
    (COMPLETIONS, _completion(stop_token_ids=list(range(257))), 400, "stop_token_ids"),
    (COMPLETIONS, _completion(stop_token_ids="1"), 400, "stop_token_ids"),
    (CHAT, _chat(messages=USER * 5000), 400, "messages"),
    (CHAT, _chat(messages=[{"role": "user"}] * 2 + [{"role": 5, "content": "x"}]), 400, "messages[2].role"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image"}]}]), 400, "messages[0].content"),
    (COMPLETIONS, _completion(logit_bias={str(i): 1 for i in range(1025)}), 400, "logit_bias"),
    (COMPLETIONS, _completion(frobnicate=1), 400, "frobnicate"),
    (COMPLETIONS, _completion(stream_options={"include_usage": True, "x": 1}), 400, "stream_options.x"),
    (COMPLETIONS, _completion(max_tokens=True), 400, "max_tokens"),
    (COMPLETIONS, _completion(model=["tiny"]), 400, "model"),
    (COMPLETIONS, b"\xff\xfe{}", 400, None),
    (COMPLETIONS, b'"just a string"', 400, None),
    (COMPLETIONS, b"null", 400, None),
    (COMPLETIONS, b"{" + b" " * (33 << 20) + b"}", 413, None),
    # found by an adversarial run: keys that int() or UTF-8 cannot take, huge numbers, long stops
    (COMPLETIONS, _completion(logit_bias={"\u00b2": 5}), 400, "logit_bias"),  # a digit, not decimal
    (COMPLETIONS, _completion(logit_bias={"\u0661": 5}), 400, "logit_bias"),  # Arabic-Indic one
    (COMPLETIONS, _completion(logit_bias={"1" * 5000: 1}), 400, "logit_bias"),
    (COMPLETIONS, _completion(logit_bias={"12\n": 1}), 400, "logit_bias"),
    (COMPLETIONS, b'{"\\ud800": 1}', 400, None),
    (COMPLETIONS, b'{"prompt": "hi", "logit_bias": {"\\ud800": 1}}', 400, None),
    (COMPLETIONS, _raw('"seed": ' + "1" * 5000), 400, None),
    (COMPLETIONS, _completion(stop="a" * 17), 200, None),
    (COMPLETIONS, _completion(stop="a" * 1024), 200, None),
    (COMPLETIONS, _completion(stop="a" * 1025), 400, "stop"),
]
CASES += [(COMPLETIONS, _completion(**{name: value}), 400, name) for name in INT_FIELDS for value in BIG]
CASES += [(COMPLETIONS, _raw(f'"{name}": {v}'), 400, None) for name in FLOAT_FIELDS for v in NON_FINITE]
CASES += [(COMPLETIONS, _completion(**{name: "1"}), 400, name) for name in INT_FIELDS + FLOAT_FIELDS]
CASES += [(CHAT, _chat(max_completion_tokens=value), 400, "max_completion_tokens") for value in BIG + [0]]


def _id(case) -> str:
    path, body, status, _ = case
    return f"{path.rsplit('/', 1)[1]}-{status}-{body[:60].decode('utf-8', 'replace')}"


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=120) as client:
        yield client


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_hostile_request_gets_its_status_and_the_server_keeps_serving(http, case):
    path, body, status, param = case
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text[:500]
    assert not LEAKS.search(response.text), response.text[:500]
    if status != 200:
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param, error
    assert http.get("/health").status_code == 200
    normal = http.post(COMPLETIONS, json={"prompt": "ok?", "max_tokens": 2, "ignore_eos": True})
    assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 2


def _errors_500(http) -> float:
    lines = http.get("/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if 'status_code="500"' in line)


def test_a_client_that_leaves_during_its_upload_is_no_server_error(http, tiny_server):
    before = _errors_500(http)
    host, port = tiny_server.url.rsplit("/", 1)[1].split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')  # fmt: skip
    time.sleep(1.0)
    assert _errors_500(http) == before
    assert http.post(COMPLETIONS, json={"prompt": "ok?", "max_tokens": 2}).status_code == 200
