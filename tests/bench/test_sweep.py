"""`run_sweep` and paired sweeps: closed-loop levels, warm-ups, repeats, validity, interleaving."""

import pytest

from tpfuse.bench.client import ClientConfig
from tpfuse.bench.session import BenchOptions
from tpfuse.bench.sweep import SweepConfig, run_paired_sweeps, run_sweep


def options(url, **kw):
    return BenchOptions(ClientConfig(url=url), gpu_telemetry="off", **kw)


@pytest.mark.parametrize("field, value", [("concurrencies", (0, 2)), ("max_tokens", -1), ("repeats", 0)])
def test_invalid_sweep_options_are_refused_naming_the_flag(field, value):
    with pytest.raises(ValueError, match="must be >= 1"):
        SweepConfig(**{field: value})


def test_each_level_sends_at_least_five_requests_per_slot_per_repeat_after_its_warmup(fake_server):
    config = SweepConfig(concurrencies=(2, 1), requests_per_level=3, repeats=2, max_tokens=4)
    result = run_sweep(options(fake_server.url), config)
    assert [p.concurrency for p in result.points] == [1, 2]
    assert [[r.num_requests for r in p.repeats] for p in result.points] == [[5, 5], [10, 10]]
    # probe + per level: C warm-ups + repeats x requests
    assert fake_server.counters.requests == 1 + (1 + 10) + (2 + 20)
    assert len(result.records) == 30 and all(r["error"] is None for r in result.records)


def test_point_reports_latencies_throughput_and_the_concurrency_achieved(fake_server):
    fake_server.behavior.ttft_s = 0.01
    fake_server.behavior.token_delay_s = 0.003
    result = run_sweep(options(fake_server.url), SweepConfig(concurrencies=(4,), repeats=2, max_tokens=8))
    p = result.points[0]
    assert p.valid and p.tput.n == 2
    assert p.pooled.ttft_s["p50"] >= 0.01
    assert 0.0025 <= p.pooled.itl_s["p50"] < 0.05  # the server sleeps 3 ms per token
    assert p.pooled.output_tokens == 2 * 20 * 8
    assert 1.0 < p.pooled.achieved_concurrency <= 4.0 + 1e-9
    assert p.tput.mean == pytest.approx(sum(r.output_tok_s for r in p.repeats) / 2)


def test_a_level_with_a_failed_request_is_marked_invalid_and_the_sweep_goes_on(fake_server):
    fake_server.behavior.fail_request_numbers = {5}  # inside the first level's measured requests
    result = run_sweep(options(fake_server.url), SweepConfig(concurrencies=(1, 2), repeats=1, max_tokens=4))
    assert [p.valid for p in result.points] == [False, True]
    assert result.points[0].pooled.num_failed == 1


def test_partial_results_are_handed_out_after_every_level(fake_server):
    seen = []
    run_sweep(
        options(fake_server.url), SweepConfig(concurrencies=(1, 2), repeats=1, max_tokens=2),
        on_point=lambda partial: seen.append([p.concurrency for p in partial.points]),
    )  # fmt: skip
    assert seen == [[1], [1, 2]]


def test_paired_sweeps_send_identical_prompts_to_both_servers():
    from tests.bench.fake_server import FakeBehavior, FakeServer

    with (
        FakeServer(FakeBehavior(model="base")) as a,
        FakeServer(FakeBehavior(model="spec", tokens_per_chunk=3)) as b,
    ):
        config = SweepConfig(concurrencies=(1, 2), repeats=2, max_tokens=6)
        result_a, result_b, interrupted = run_paired_sweeps(options(a.url), options(b.url), config)
        prompts_a = [body["prompt"] for body in a.behavior.seen_bodies]
        prompts_b = [body["prompt"] for body in b.behavior.seen_bodies]
    assert not interrupted
    assert sorted(prompts_a) == sorted(prompts_b)  # arrival order varies with two workers
    assert (result_a.label, result_b.label) == ("base", "spec")
    assert [p.concurrency for p in result_b.points] == [1, 2]
    assert "acceptance_length" in result_b.points[0].spec
