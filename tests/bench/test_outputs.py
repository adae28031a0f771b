"""Files written by single / sweep / compare: strict JSON, CSV and PNG that read back."""

import csv
import json
import math

import matplotlib.image

from tpfuse.bench.client import ClientConfig
from tpfuse.bench.compare import find_crossover, throughputs_from_points
from tpfuse.bench.outputs import clean_json, write_compare, write_single, write_sweep
from tpfuse.bench.runs import SingleConfig, run_single
from tpfuse.bench.session import BenchOptions
from tpfuse.bench.sweep import SweepConfig, run_sweep
from tpfuse.bench.telemetry import GpuSample


def options(url, label=None):
    return BenchOptions(ClientConfig(url=url), gpu_telemetry="off", label=label)


def strict_json(path):
    def refuse(name):
        raise AssertionError(f"{path} holds {name}, which strict JSON parsers reject")

    return json.loads(path.read_text(), parse_constant=refuse)


def assert_png(path):
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_clean_json_turns_nan_and_infinity_into_null():
    assert clean_json({"a": [math.nan, 1.0, -math.inf], "b": (2, math.inf)}) == {
        "a": [None, 1.0, None],
        "b": [2, None],
    }


def test_single_writes_summary_requests_csv_and_plots(fake_server, tmp_path):
    result = run_single(options(fake_server.url), SingleConfig(1, 3, 8))
    result.samples = [GpuSample(0.1 * i, 0, 300.0 + i, 1980.0, 90.0, 1000.0) for i in range(5)]
    write_single(result, tmp_path)
    summary = strict_json(tmp_path / "summary.json")
    assert summary["mode"] == "single" and len(summary["runs"]) == 3
    assert summary["tok_s"]["mean"] == result.tok_s.mean
    assert {"tpfuse", "python", "httpx"} <= summary["environment"].keys()
    assert summary["config"] == {"warmups": 1, "runs": 3, "max_tokens": 8}
    assert summary["options"]["prompts"]["seed"] == 0
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [r["completion_tokens"] for r in records] == [8, 8, 8]
    rows = list(csv.DictReader((tmp_path / "runs.csv").open()))
    assert [float(r["tok_s"]) for r in rows] == [r.tok_s for r in result.runs]
    assert_png(tmp_path / "runs.png")
    assert_png(tmp_path / "power.png")


def test_sweep_writes_summary_requests_csv_and_plots(fake_server, tmp_path):
    result = run_sweep(options(fake_server.url), SweepConfig(concurrencies=(1, 2), repeats=2, max_tokens=4))
    write_sweep(result, tmp_path)
    summary = strict_json(tmp_path / "summary.json")
    assert [p["concurrency"] for p in summary["points"]] == [1, 2]
    assert summary["points"][1]["output_tok_s_repeats"] == [r.output_tok_s for r in result.points[1].repeats]
    assert sum(1 for _ in (tmp_path / "requests.jsonl").open()) == 2 * (5 + 10)
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert [int(r["concurrency"]) for r in rows] == [1, 2]
    assert float(rows[0]["ttft_p50_ms"]) == result.points[0].pooled.ttft_s["p50"] * 1e3
    assert_png(tmp_path / "throughput.png")
    assert_png(tmp_path / "latency.png")
    assert not (tmp_path / "power.png").exists()  # no telemetry, no power plot


def test_compare_writes_crossover_csv_and_plots(fake_server, tmp_path):
    a = run_sweep(options(fake_server.url, "A"), SweepConfig(concurrencies=(1, 2), repeats=2, max_tokens=4))
    b = run_sweep(options(fake_server.url, "B"), SweepConfig(concurrencies=(1, 2), repeats=2, max_tokens=4))
    crossover = find_crossover(throughputs_from_points(a.points), throughputs_from_points(b.points))
    summary = {"a": a.summary_dict(), "b": b.summary_dict()}
    write_compare(summary, crossover, {"A": a.points, "B": b.points}, a.records, tmp_path)
    saved = strict_json(tmp_path / "summary.json")
    assert saved["mode"] == "compare"
    assert [r["concurrency"] for r in saved["crossover"]["rows"]] == [1, 2]
    rows = list(csv.DictReader((tmp_path / "compare.csv").open()))
    assert float(rows[0]["ratio"]) == crossover.rows[0].ratio
    for name in ("throughput.png", "ratio.png", "latency.png"):
        assert_png(tmp_path / name)
