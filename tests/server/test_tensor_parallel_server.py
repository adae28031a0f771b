"""`tpfuse serve --tp-size 2` on CPU (gloo): the engine process spawns the worker rank; the output
equals TP=1's, and SIGTERM leaves no process behind."""

import signal

import httpx
from tests.server.server_process import start_server


def _greedy(url: str) -> str:
    body = {
        "model": "tiny",
        "prompt": "tensor parallel",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]


def test_tp2_server_matches_tp1_and_stops_every_rank_on_sigterm(tiny_server):
    server = start_server("tpfuse", ["serve", "--device", "cpu", "--model", "tiny", "--tp-size", "2"])
    try:
        assert _greedy(server.url) == _greedy(tiny_server.url)
        assert server.stop(signal.SIGTERM, timeout=30) == 0
        assert not server.group_alive()
    finally:
        server.stop(signal.SIGKILL, timeout=1)
        server.remove_log()
