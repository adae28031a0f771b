"""`run_single`: warm-ups, N measured runs, per-run tok/s and their statistics."""

import statistics

import pytest

from tpfuse.bench.client import ClientConfig
from tpfuse.bench.report import format_run_line
from tpfuse.bench.runs import SingleConfig, run_single
from tpfuse.bench.session import BenchOptions


def options(url, **kw):
    return BenchOptions(ClientConfig(url=url), gpu_telemetry="off", **kw)


def test_single_runs_warmups_then_measured_runs_of_exactly_max_tokens(fake_server):
    lines = []
    result = run_single(
        options(fake_server.url), SingleConfig(warmups=2, runs=3, max_tokens=20),
        on_run=lambda run, total: lines.append(format_run_line(run, total)),
    )  # fmt: skip
    # probe + 2 warm-ups + 3 runs reach the server
    assert fake_server.counters.requests == 1 + 2 + 3
    assert [r.output_tokens for r in result.runs] == [20, 20, 20]
    assert [r.output_tokens for r in result.runs] == [rec.completion_tokens for rec in result.records]
    assert lines[0].startswith("Run 1/3: 20 tokens in ") and lines[0].endswith(" tok/s")
    assert result.valid


def test_per_run_tok_s_is_tokens_over_end_to_end_seconds(fake_server):
    fake_server.behavior.ttft_s = 0.02
    result = run_single(options(fake_server.url), SingleConfig(0, 2, 10))
    for run, record in zip(result.runs, result.records, strict=True):
        assert run.seconds == pytest.approx(record.end_s - record.scheduled_s)
        assert run.tok_s == pytest.approx(10 / run.seconds)
        assert run.ttft_s >= 0.02
        assert run.decode_tok_s > run.tok_s  # the first token's wait excluded


def test_summary_is_mean_stdev_cv_of_run_tok_s(fake_server):
    result = run_single(options(fake_server.url), SingleConfig(0, 4, 8))
    rates = [r.tok_s for r in result.runs]
    assert result.tok_s.n == 4
    assert result.tok_s.mean == pytest.approx(statistics.fmean(rates))
    assert result.tok_s.stdev == pytest.approx(statistics.stdev(rates))
    assert result.tok_s.cv == pytest.approx(statistics.stdev(rates) / statistics.fmean(rates))


def test_a_failed_run_is_recorded_and_left_out_of_the_statistics(fake_server):
    fake_server.behavior.fail_request_numbers = {2}  # probe, run 1, then run 2 fails
    result = run_single(options(fake_server.url), SingleConfig(0, 3, 8))
    assert [r.ok for r in result.runs] == [True, False, True]
    assert "HTTP 500" in result.runs[1].error
    assert result.tok_s.n == 2
    assert not result.valid
    assert format_run_line(result.runs[1], 3).startswith("Run 2/3: failed: HTTP 500")


def test_speculative_counters_are_taken_as_deltas_over_the_measured_runs(fake_server):
    fake_server.behavior.tokens_per_chunk = 4
    result = run_single(options(fake_server.url), SingleConfig(warmups=1, runs=2, max_tokens=16))
    # Per request: 4 chunks of 4 -> 3 drafts, each accepting 3 of 3 drafted tokens.
    assert result.spec["fake:spec_decode_num_drafts_total"] == 2 * 3
    assert result.spec["acceptance_length"] == pytest.approx(4.0)
    assert result.spec["acceptance_rate"] == pytest.approx(1.0)


def test_client_token_counts_sit_beside_usage_with_a_warning_on_mismatch(fake_server, monkeypatch):
    from tests.bench.conftest import WordTokenizer

    monkeypatch.setattr("tpfuse.bench.session.load_client_tokenizer", lambda name: (WordTokenizer(), "words"))
    fake_server.behavior.usage_offset = 1
    result = run_single(options(fake_server.url), SingleConfig(0, 2, 6))
    assert [r.completion_tokens for r in result.records] == [7, 7]
    assert [r.client_completion_tokens for r in result.records] == [6, 6]
    assert any(n.startswith("warning: token count mismatch in 2/2") for n in result.notes)
