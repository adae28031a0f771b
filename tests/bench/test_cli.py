"""`tpfuse bench single | sweep | compare` as a user runs them."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bench.cli_entry import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sweep", "--concurrency", "0,2"], "--concurrency levels must be >= 1"),
        (["sweep", "--max-tokens", "-3"], "--max-tokens must be >= 1"),
        (["single", "--max-tokens", "-1"], "--max-tokens must be >= 1"),
        (["single", "--runs", "0"], "--runs must be >= 1"),
    ],
)
def test_invalid_options_are_refused_with_a_message(argv, message, capsys):
    assert main(["bench", *argv, "--url", "http://127.0.0.1:9"]) == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_fails_fast_with_a_clear_message(capsys):
    start = time.monotonic()
    code = main(["bench", "single", "--url", "http://127.0.0.1:9", "--ready-timeout", "0.5"])
    assert code == 1
    assert time.monotonic() - start < 5
    assert "no OpenAI-compatible server answered at http://127.0.0.1:9" in capsys.readouterr().err


def test_single_prints_each_run_and_the_statistics(fake_server, tmp_path, capsys):
    argv = ["bench", "single", "--url", fake_server.url, "--warmups", "1", "--runs", "2", "--max-tokens", "8",
            "--output-dir", str(tmp_path), "--gpu-telemetry", "off"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Run 1/2: 8 tokens in " in out and "Run 2/2: 8 tokens in " in out
    assert "mean " in out and "stdev" in out and "CV" in out
    assert {"summary.json", "requests.jsonl", "runs.csv", "runs.png"} <= {p.name for p in tmp_path.iterdir()}


def test_sweep_then_compare_of_two_saved_sweeps(fake_server, tmp_path, capsys):
    for name in ("a", "b"):
        argv = ["bench", "sweep", "--url", fake_server.url, "--concurrency", "1,2", "--repeats", "2",
                "--max-tokens", "4", "--output-dir", str(tmp_path / name), "--label", name]  # fmt: skip
        assert main(argv) == 0
    assert {"summary.json", "requests.jsonl", "sweep.csv", "throughput.png", "latency.png"} <= {
        p.name for p in (tmp_path / "a").iterdir()
    }
    code = main(["bench", "compare", "--a", str(tmp_path / "a"), "--b", str(tmp_path / "b"),
                 "--output-dir", str(tmp_path / "cmp")])  # fmt: skip
    assert code == 0
    assert "b / a: output tok/s ratio" in capsys.readouterr().out
    assert json.loads((tmp_path / "cmp" / "summary.json").read_text())["mode"] == "compare"


def test_compare_without_two_sources_explains_both_forms(capsys):
    assert main(["bench", "compare", "--url", "http://127.0.0.1:9"]) == 2
    assert "--url-b" in capsys.readouterr().err


def test_ctrl_c_keeps_and_writes_the_levels_already_finished(fake_server, tmp_path):
    fake_server.behavior.token_delay_s = 0.01
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "tests.bench.cli_entry", "bench", "sweep", "--url", fake_server.url,
           "--concurrency", "1,2,4,8,16", "--repeats", "1", "--max-tokens", "10", "--output-dir", str(out),
           "--tokenizer", "none"]  # fmt: skip
    env = os.environ | {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # A job started in the background by a shell without job control ignores SIGINT, and its children
    # inherit that (Python then installs no KeyboardInterrupt handler): restore the default first.
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (out / "summary.json").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the first level never finished"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    levels = [p["concurrency"] for p in summary["points"]]
    assert levels and levels == [1, 2, 4, 8, 16][: len(levels)] and len(levels) < 5
    assert (out / "sweep.csv").exists()


@pytest.mark.parametrize("kind", ["single", "sweep"])
def test_a_bad_dataset_path_is_a_message_not_a_traceback(fake_server, tmp_path, kind, capsys):
    bad = tmp_path / "chats.json"
    bad.write_text("{not json")
    argv = ["bench", kind, "--url", fake_server.url, "--dataset", "sharegpt", "--dataset-path", str(bad),
            "--output-dir", str(tmp_path / "out"), "--gpu-telemetry", "off"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"ShareGPT file {bad} is not valid JSON" in err and "Traceback" not in err
