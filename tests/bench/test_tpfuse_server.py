"""The bench against the real `tpfuse serve --device cpu --model tiny` (the embedded default)."""

import csv
import json

import pytest

from tpfuse.bench.client import ClientConfig
from tpfuse.bench.outputs import write_single, write_sweep
from tpfuse.bench.prompts import PromptConfig
from tpfuse.bench.runs import SingleConfig, run_single
from tpfuse.bench.session import BenchOptions
from tpfuse.bench.sweep import SweepConfig, run_sweep


@pytest.fixture(scope="module")
def tpfuse_server():
    from tpfuse.server.launcher import ServerSubprocess

    with ServerSubprocess(["--device", "cpu", "--model", "tiny"], start_timeout=180) as server:
        yield server


def options(url, **kw):
    return BenchOptions(ClientConfig(url=url), gpu_telemetry="off", **kw)


def test_single_against_tpfuse_counts_tokens_from_usage_and_writes_files(tpfuse_server, tmp_path):
    result = run_single(options(tpfuse_server.url), SingleConfig(warmups=1, runs=2, max_tokens=8))
    assert result.valid, [r.error for r in result.runs]
    # tpfuse accepts ignore_eos / min_tokens, so every run is exactly max_tokens long.
    assert [rec.completion_tokens for rec in result.records] == [8, 8]
    assert [run.output_tokens for run in result.runs] == [8, 8]
    assert all(rec.client_completion_tokens is not None for rec in result.records)  # tiny's tokenizer
    # Per-chunk counts (for ITL per token) add up to usage, however the server grouped tokens.
    assert all(sum(rec.chunk_tokens) == pytest.approx(rec.completion_tokens) for rec in result.records)
    assert result.window.output_tokens == sum(rec.completion_tokens for rec in result.records)
    write_single(result, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [run["output_tokens"] for run in summary["runs"]] == [8, 8]
    assert len(list(csv.DictReader((tmp_path / "runs.csv").open()))) == 2


def test_sweep_against_tpfuse_reaches_each_level_and_writes_files(tpfuse_server, tmp_path):
    prompts = PromptConfig("random", input_len=8)
    config = SweepConfig(concurrencies=(1, 2), repeats=1, max_tokens=3)
    result = run_sweep(options(tpfuse_server.url, prompts=prompts), config)
    assert [p.valid for p in result.points] == [True, True]
    assert all(r["completion_tokens"] == 3 and r["prompt_tokens"] == 8 for r in result.records)
    assert result.points[1].pooled.output_tokens == 10 * 3
    write_sweep(result, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [p["concurrency"] for p in summary["points"]] == [1, 2]
    assert (tmp_path / "throughput.png").stat().st_size > 0
