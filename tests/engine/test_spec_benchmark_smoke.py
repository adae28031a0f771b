"""benchmarks/spec_decode.py runs end to end at tiny shapes on CPU and writes its JSON (the GPU run is
one short shot, so the script itself is checked here)."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "spec_decode.py")


def test_spec_decode_benchmark_smoke_run_writes_every_mode_and_the_targets(tmp_path):
    out = tmp_path / "spec_decode.json"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--smoke", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert set(record["results"]) == {"off", "fixed L=3", "adaptive L=3", "spec engine k=0"}
    assert record["results"]["spec engine k=0"]["1"]["mean_k"] == 0.0
    assert set(record["spec_engine_k0_over_off"]) == {"1", "4"}
    assert record["simulated_acceptance"] is True and "SIMULATED" in proc.stdout + proc.stderr
    assert "c1_L3_fixed_over_off" in record["targets"]
    fixed = record["results"]["fixed L=3"]["1"]
    assert fixed["mean_k"] == 3.0 and fixed["acceptance_length"] > 1.0
    assert (
        len(fixed["rounds_tok_s"]) == 5 and fixed["tok_s"] == sorted(fixed["rounds_tok_s"])[2]
    )  # the median
    adaptive_rounds = record["results"]["adaptive L=3"]["1"]["rounds"]
    assert all(len(r["step_ms"]) == r["steps"] for r in adaptive_rounds)
    assert all(r["policy_told"] for r in adaptive_rounds)  # the costs the policy was given, per step
    assert all(not r["policy_told"] for r in record["results"]["fixed L=3"]["1"]["rounds"])
    assert isinstance(record["stalls"], list) and "one-off stalls" in proc.stdout


def test_one_off_stalls_are_found_per_round_and_the_prefill_step_is_not_one():
    sys.path.append(os.path.dirname(SCRIPT))
    from spec_decode import find_stalls

    steady = [90.0] + [6.0] * 50  # the prefill step first: not a stall
    stalled = [90.0] + [6.0] * 20 + [700.0] + [6.0] * 29
    results = {"adaptive L=2": {16: {"rounds": [{"step_ms": steady}, {"step_ms": stalled}]}}}
    assert find_stalls(results) == [{"mode": "adaptive L=2", "C": 16, "round": 1, "step": 21, "ms": 700.0}]
