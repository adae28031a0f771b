"""Clients that go away free their KV blocks; a bounded load loses nothing; /metrics tells the story."""

import asyncio
import time

import httpx


def _metrics(url: str) -> dict[str, float]:
    series = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            series[name] = float(value)
    return series


def _wait_until_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _metrics(url)
        if m["tpfuse_num_requests_running"] == 0 and m["tpfuse_kv_cache_usage_ratio"] == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"engine still busy after {timeout} s: {m}")


def _aborts(url: str) -> float:
    return sum(v for k, v in _metrics(url).items() if k.startswith("tpfuse_requests_total") and "abort" in k)


def _long_body(stream: bool) -> dict:
    return {"model": "tiny", "prompt": "never mind", "max_tokens": 1500, "ignore_eos": True, "stream": stream}


def test_client_that_disconnects_mid_stream_is_aborted_and_kv_usage_returns_to_zero(tiny_server):
    before = _aborts(tiny_server.url)
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=_long_body(True), timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ") or True
        assert _metrics(tiny_server.url)["tpfuse_kv_cache_usage_ratio"] > 0
    _wait_until_idle(tiny_server.url)
    assert _aborts(tiny_server.url) == before + 1


def test_client_that_gives_up_on_a_non_streamed_request_is_aborted(tiny_server):
    before = _aborts(tiny_server.url)
    try:
        httpx.post(tiny_server.url + "/v1/completions", json=_long_body(False), timeout=1.0)
        raise AssertionError("1500 tokens on CPU should take longer than the 1 s client timeout")
    except httpx.TimeoutException:
        pass
    _wait_until_idle(tiny_server.url)
    assert _aborts(tiny_server.url) == before + 1


def test_200_requests_at_concurrency_32_all_complete(tiny_server):
    num_requests, concurrency, max_tokens = 200, 32, 4
    before = _metrics(tiny_server.url)

    async def run():
        limit = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=120) as http:

            async def one(i):
                body = {"model": "tiny", "prompt": f"load {i}", "max_tokens": max_tokens, "ignore_eos": True,
                        "temperature": 0.7, "seed": i, "stream": i % 2 == 0}  # fmt: skip
                async with limit:
                    return await http.post("/v1/completions", json=body)

            return await asyncio.gather(*(one(i) for i in range(num_requests)))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * num_requests
    assert all(r.text.endswith("data: [DONE]\n\n") for r in responses[::2])
    assert all(r.json()["usage"]["completion_tokens"] == max_tokens for r in responses[1::2])
    after = _wait_until_idle(tiny_server.url)
    generated = after["tpfuse_generation_tokens_total"] - before["tpfuse_generation_tokens_total"]
    assert generated == num_requests * max_tokens


def test_metrics_expose_latency_histograms_and_engine_state(tiny_server):
    httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "m", "max_tokens": 3}, timeout=60)
    m = _metrics(tiny_server.url)
    for name in ("tpfuse_time_to_first_token_seconds_count", "tpfuse_inter_token_latency_seconds_count",
                 "tpfuse_e2e_request_latency_seconds_count"):  # fmt: skip
        assert m[name] > 0
    for name in (
        "tpfuse_num_requests_waiting",
        "tpfuse_prefix_cache_hit_rate",
        "tpfuse_engine_num_kv_blocks",
    ):
        assert name in m
