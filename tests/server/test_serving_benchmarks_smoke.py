"""benchmarks/server_path.py and benchmarks/long_context.py run end to end on the CPU at small sizes
(the device session runs long_context.py on the 8B preset, so the script itself is checked here)."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _run(args: list[str], tmp_path) -> str:
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_server_path_reports_every_token_of_the_stream_with_its_latency_and_costs(tmp_path):
    out = _run(["-m", "benchmarks.server_path", "--cadence-us", "2000", "--tokens", "40"], tmp_path)
    row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert row["cadence_us"] == 2000 and row["tok_s"] > 0 and row["engine_tok_s"] > 0
    assert 0 < row["added_p50_us"] <= row["added_p99_us"]
    assert row["http_switches_per_token"] > 0 and row["tokens_per_chunk"] >= 1


def test_long_context_reports_ttft_and_decode_rate_per_prompt_length(tmp_path):
    _run(
        ["benchmarks/long_context.py", "--device", "cpu", "--model", "tiny", "--lengths", "100,300",
         "--new-tokens", "6"],
        tmp_path,
    )  # fmt: skip
    rows = json.loads((tmp_path / "long_context.json").read_text())["rows"]
    assert [r["prompt_tokens"] for r in rows] == [100, 300]
    for r in rows:
        assert r["usage"]["completion_tokens"] == 6 and r["ttft_s"] > 0 and r["decode_tok_s"] > 0
