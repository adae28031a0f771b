"""benchmarks/suite_summary.py: the short table at the end of a GPU suite run, built from the files the
suite's scripts write (the same keys), with a verdict wherever an issue sets a target."""

import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "suite_summary.py")
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="{failures}" skipped="1" tests="12" time="9.0">
</testsuite></testsuites>"""


@pytest.fixture(scope="module")
def summary():
    spec = importlib.util.spec_from_file_location("suite_summary", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(folder, name, value):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value if isinstance(value, str) else json.dumps(value))


def _results(folder, failures=0, batch1_fraction=0.776, near_tie=True):
    _write(folder, "gpu_tests.xml", JUNIT.format(failures=failures))
    _write(folder, "decode.json", {
        "model": "llama-3.1-8b", "roofline_tok_s": 282.7, "batch1_tok_s_median": 282.7 * batch1_fraction,
        "batch1_fraction_of_roofline": batch1_fraction, "transformers_tok_s": 15.0,
        "step_ms": {"1": 4.538, "64": 5.062},
    })  # fmt: skip
    _write(folder, "bf16_parity.json", [
        {"architecture": "llama", "match_rate": 1.0, "early_mismatches": []},
        {"architecture": "qwen3", "match_rate": 0.53, "early_mismatches": [
            {"position": 1, "fp32_gap": 0.003, "logit_scale": 1.3, "near_tie": near_tie}]},
    ])  # fmt: skip
    _write(folder, "spec_decode.json", {
        "targets": {"c1_L3_fixed_over_off": 2.04, "adaptive_vs_best_min_ratio L=2": 0.994,
                    "adaptive_vs_best_min_ratio L=3": 0.915},
        "crossover_fixed": {"2": 64, "3": None},
    })  # fmt: skip
    _write(folder, "mixed_steps.json", {"cases": [
        {"batch": 1, "prompt": 64, "on": 7.69, "off": 14.26, "bucket": 96},
        {"batch": 64, "prompt": 400, "on": 15.5, "off": 14.77, "bucket": 512},
    ]})  # fmt: skip
    _write(folder, "serve_bench/single_a/summary.json", {
        "tok_s": {"mean": 212.6, "cv": 0.0122}, "energy": {"j_per_token": 2.21},
    })  # fmt: skip
    _write(folder, "serve_bench/sweep_a/sweep.csv",
           "concurrency,valid,output_tok_s_mean\n1,True,205.1\n256,True,12607.9\n")  # fmt: skip


def _row(rows, start):
    [row] = [r for r in rows if r[0].startswith(start)]
    return row


def test_every_result_gets_its_figures_and_verdicts(summary, tmp_path):
    _results(tmp_path)
    rows = summary.summarize(str(tmp_path))
    assert _row(rows, "GPU tests") == ("GPU tests", "11 passed, 0 failed, 1 skipped", "met (all pass)")
    decode = _row(rows, "decode llama-3.1-8b batch 1")
    assert "219.4 tok/s = 77.6% of 282.7" in decode[1] and decode[2].startswith("NOT MET")
    assert _row(rows, "decode step batch 64")[1:] == ("5.062 ms / 4.538 ms = 1.12x", "met (<= 1.25x)")
    assert _row(rows, "bf16")[1] == "llama 1.000, qwen3 0.530" and _row(rows, "bf16")[2].startswith("met")
    assert _row(rows, "EAGLE-3 C=1")[1:] == ("2.04x", "met (>= 2.0x)")
    assert _row(rows, "adaptive vs best of off / fixed, L=2")[2].startswith("met")
    assert _row(rows, "adaptive vs best of off / fixed, L=3")[2].startswith("NOT MET")
    assert _row(rows, "crossover")[1] == "L=2: C=64, L=3: beyond the largest C"
    assert _row(rows, "mixed step 1 decodes")[1:] == (
        "graphs 7.69 ms, eager 14.26 ms: 1.85x", "met (graphs within 3 % of eager or faster)"
    )
    assert _row(rows, "mixed step 64 decodes")[2].startswith("NOT MET")
    assert _row(rows, "server single stream")[1] == "212.6 tok/s, CV 1.2%, 2.21 J/token"
    assert _row(rows, "server sweep")[1:] == ("C=1: 205, C=256: 12608", "met (every point valid)")
    table = summary.format_rows(rows)
    assert table.splitlines()[0].split() == ["result", "figures", "target"]
    assert len(table.splitlines()) == len(rows) + 2


def test_failed_tests_and_a_real_mismatch_are_not_met(summary, tmp_path):
    _results(tmp_path, failures=2, near_tie=False)
    rows = summary.summarize(str(tmp_path))
    assert _row(rows, "GPU tests")[1:] == ("9 passed, 2 failed, 1 skipped", "NOT MET (all pass)")
    assert _row(rows, "bf16")[2].startswith("NOT MET")


def test_missing_results_are_left_out_and_a_broken_one_says_why(summary, tmp_path):
    _write(tmp_path, "decode.json", "{not json")
    rows = summary.summarize(str(tmp_path))
    assert len(rows) == 1 and rows[0][0] == "decode" and rows[0][1].startswith("unreadable: JSONDecodeError")


def test_an_empty_folder_is_an_error(summary, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["suite_summary.py", str(tmp_path)])
    assert summary.main() == 1
    assert "no results" in capsys.readouterr().err
