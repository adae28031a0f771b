"""benchmarks/profile_engine_step.py runs end to end at tiny shapes on CPU and writes its per-step
breakdown (the GPU session runs it first, so the script itself is checked here)."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "profile_engine_step.py")


@pytest.mark.parametrize("overlap", [True, False])
def test_profile_engine_step_smoke_run_reports_three_decode_steps_with_phases_and_host_functions(
    tmp_path, overlap
):
    out = tmp_path / "profile.json"
    args = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1", "--steps", "3",
            "--context", "20", "--warmups", "1", "--out", str(out)]  # fmt: skip
    args += [] if overlap else ["--disable-overlap-schedule"]
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["overlap"] is overlap
    result = record["results"]["1"]
    assert len(result["per_step"]) == 3
    for step in result["per_step"]:
        assert step["wall_us"] > 0 and step["gpu_busy_us"] == 0 and step["gpu_idle_us"] == step["wall_us"]
        assert {"schedule", "pack", "execute", "postprocess"} <= set(step["phase_us"])
    assert result["top_host_functions"] and result["top_host_functions"][0]["self_us"] > 0
    assert "GPU idle" in proc.stdout and os.path.exists(result["trace"])


def test_profile_engine_step_times_speculative_steps_with_a_simulated_eagle3_head(tmp_path):
    out = tmp_path / "profile.json"
    args = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1", "--steps", "3",
            "--context", "20", "--warmups", "1", "--eagle3-simulate", "3", "--out", str(out)]  # fmt: skip
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "SIMULATED" in proc.stdout  # every output of the benchmark-only mode says so
    steps = json.loads(out.read_text())["results"]["1"]["per_step"]
    assert len(steps) == 3
    for step in steps:  # each profiled step is a speculative one that ran the verify forward
        assert step["phase_us"]["spec_launch"] > 0 and step["phase_us"]["spec_execute"] > 0


def test_profile_engine_step_mixes_arrivals_into_the_profiled_steps(tmp_path):
    out = tmp_path / "profile.json"
    args = ["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--batch-sizes", "2", "--steps", "3",
            "--context", "20", "--warmups", "1", "--arrivals-per-step", "1", "--out", str(out)]  # fmt: skip
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["arrivals_per_step"] == 1 and len(record["results"]["2"]["per_step"]) == 3
    assert "batch 2 + 1 x 20-token arrivals a step" in proc.stdout
