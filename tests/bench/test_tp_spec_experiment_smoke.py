"""benchmarks/tp_spec_experiment.py (the multi-GPU issue's experiment) runs end to end on CPU at tiny
sizes: servers with TP 2 over gloo, single + sweep per configuration, the compare, experiment.json."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "tp_spec_experiment.py")


def test_experiment_smoke_run_measures_every_configuration_and_writes_the_crossovers(tmp_path):
    args = ["--device", "cpu", "--model", "tiny", "--tp-size", "2", "--force-allreduce", "auto"]
    args += ["--configs", "fused,adaptive", "--concurrency", "1,2", "--single-tokens", "8", "--runs", "1"]
    args += ["--warmups", "1", "--sweep-tokens", "4", "--repeats", "1", "--start-timeout", "120"]
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=400, env=env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads((tmp_path / "tp_spec" / "experiment.json").read_text())
    assert record["tp_size"] == 2 and record["simulated_acceptance_length"] == 3.0
    assert set(record["sweep_tok_s"]) == {"fused", "adaptive"}
    assert all(
        set(points) == {"1", "2"} and min(points.values()) > 0 for points in record["sweep_tok_s"].values()
    )
    assert "adaptive/fused" in record["crossover"]
    assert (tmp_path / "tp_spec" / "single_adaptive" / "summary.json").exists()
