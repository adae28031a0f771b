"""The streaming client against the fake OpenAI-compatible server."""

import asyncio
import time

import pytest

from tpfuse.bench.client import (
    ClientConfig,
    ServerRejected,
    ServerUnreachable,
    StreamingClient,
    build_payload,
)
from tpfuse.bench.load import connect, run_closed_loop
from tpfuse.bench.metrics import request_metrics


def send(url, prompt="hello there", max_tokens=8, tokenizer=None, **config):
    async def go():
        cfg = ClientConfig(url=url, **config)
        async with StreamingClient(cfg, 1, tokenizer) as client:
            await client.wait_until_ready(5.0)
            return await client.send(0, prompt, max_tokens, time.perf_counter(), 0.0)

    return asyncio.run(go())


def test_payload_asks_for_streamed_usage_and_pinned_length():
    body = build_payload(ClientConfig(url="http://x"), "m", [1, 2, 3], 64)
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert (body["ignore_eos"], body["min_tokens"], body["max_tokens"]) == (True, 64, 64)
    assert body["prompt"] == [1, 2, 3]


def test_chat_payload_refuses_token_id_prompts():
    with pytest.raises(ValueError, match="--endpoint completions"):
        build_payload(ClientConfig(url="http://x", endpoint="chat"), "m", [1, 2], 4)


def test_record_takes_tokens_from_usage_and_counts_every_chunk(fake_server):
    r = send(fake_server.url, max_tokens=12)
    assert r.ok, r.error
    assert r.completion_tokens == 12
    assert r.output_tokens == 12
    assert sum(r.chunk_tokens) == 12
    assert r.chunk_tokens_source == "usage_delta"
    assert r.scheduled_s <= r.start_s <= r.first_token_s <= r.end_s


def test_multi_token_chunks_are_counted_from_streamed_usage(fake_server):
    fake_server.behavior.tokens_per_chunk = 3
    fake_server.behavior.token_delay_s = 0.004
    r = send(fake_server.url, max_tokens=10)
    assert r.chunk_tokens == [3.0, 3.0, 3.0, 1.0]
    m = request_metrics(r)
    assert m.itl_weights == [3.0, 3.0, 1.0]
    # Each gap is spread over the tokens of its chunk: together they cover first to last chunk once.
    weighted = sum(v * w for v, w in zip(m.itl_values, m.itl_weights, strict=True))
    assert weighted == pytest.approx(r.chunk_times_s[-1] - r.chunk_times_s[0])


def test_without_streamed_usage_chunk_counts_come_from_the_client_tokenizer(fake_server, word_tokenizer):
    fake_server.behavior.honor_continuous_usage = False
    fake_server.behavior.tokens_per_chunk = 2
    r = send(fake_server.url, max_tokens=6, tokenizer=word_tokenizer)
    assert r.chunk_tokens_source == "client_tokenizer"
    assert r.chunk_tokens == [2.0, 2.0, 2.0]
    assert r.client_completion_tokens == r.completion_tokens == 6


def test_without_usage_deltas_or_tokenizer_chunk_counts_are_scaled_to_usage(fake_server):
    fake_server.behavior.honor_continuous_usage = False
    fake_server.behavior.tokens_per_chunk = 4
    r = send(fake_server.url, max_tokens=8)
    assert r.chunk_tokens_source == "one_per_chunk_scaled_to_usage"
    assert r.chunk_tokens == [4.0, 4.0]


def test_chat_ttft_ignores_the_role_only_first_chunk(fake_server):
    fake_server.behavior.ttft_s = 0.05
    r = send(fake_server.url, endpoint="chat", max_tokens=4)
    assert r.ok, r.error
    assert r.first_token_s >= 0.05
    assert r.completion_tokens == 4 and r.text.split() == ["tok0", "tok1", "tok2", "tok3"]


def test_failed_request_is_recorded_not_raised(fake_server):
    fake_server.behavior.fail_request_numbers = {0}
    r = send(fake_server.url)
    assert not r.ok
    assert r.error.startswith("HTTP 500") and "injected failure" in r.error


def test_unreachable_server_raises_a_clear_error_within_the_timeout():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once the socket closes
    config = ClientConfig(url=f"http://127.0.0.1:{port}")
    start = time.monotonic()
    with pytest.raises(ServerUnreachable, match=rf"127.0.0.1:{port}/v1/models within 1s.*tpfuse serve"):
        asyncio.run(connect(config, "hi", ready_timeout_s=1.0))
    assert time.monotonic() - start < 5.0


def test_model_defaults_to_the_first_id_in_v1_models(fake_server):
    fake_server.behavior.model = "served-name"
    config = ClientConfig(url=fake_server.url + "/v1/")
    asyncio.run(connect(config, "hi", 5.0))
    assert config.model == "served-name"
    assert fake_server.behavior.seen_bodies[-1]["model"] == "served-name"


def test_server_rejecting_nonstandard_fields_gets_them_dropped_with_a_note(fake_server):
    fake_server.behavior.reject_nonstandard_fields = True
    config = ClientConfig(url=fake_server.url)
    notes = asyncio.run(connect(config, "hi", 5.0))
    assert config.length_controls is False
    assert any("rejected ignore_eos" in n for n in notes)
    assert "ignore_eos" not in fake_server.behavior.seen_bodies[-1]


def test_probe_failure_names_the_endpoint_and_the_error(fake_server):
    fake_server.behavior.fail_request_numbers = {0, 1}
    with pytest.raises(ServerRejected, match="v1/completions refused a probe request: HTTP 500"):
        asyncio.run(connect(ClientConfig(url=fake_server.url), "hi", 5.0))


def test_closed_loop_keeps_at_most_c_requests_in_flight_and_sends_each_prompt_once(fake_server):
    fake_server.behavior.token_delay_s = 0.002

    async def go():
        async with StreamingClient(ClientConfig(url=fake_server.url, model="m"), 3) as client:
            return await run_closed_loop(client, [f"p{i}" for i in range(9)], 3, 5)

    records = asyncio.run(go())
    assert [r.request_id for r in records] == list(range(9))
    assert sorted(b["prompt"] for b in fake_server.behavior.seen_bodies) == sorted(f"p{i}" for i in range(9))
    events = sorted([(r.start_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak == 3
    # The first three are due at once; each later one when a slot frees up.
    assert [r.scheduled_s for r in records[:3]] == [0.0, 0.0, 0.0]
    assert all(r.scheduled_s > 0 for r in records[3:])


def test_each_concurrent_stream_gets_its_own_connection_lane_and_lanes_are_reused(fake_server):
    """One one-connection httpx client per concurrent stream (a shared pool re-scans every connection
    on every event): 4 streams at a time over 12 requests open 4 lanes, plus the side-request one."""
    fake_server.behavior.token_delay_s = 0.002

    async def go():
        async with StreamingClient(ClientConfig(url=fake_server.url, model="m"), 4) as client:
            records = await run_closed_loop(client, [f"p{i}" for i in range(12)], 4, 5)
            return records, len(client._lanes)

    records, lanes = asyncio.run(go())
    assert all(r.ok for r in records) and len(records) == 12
    assert lanes == 4 + 1
