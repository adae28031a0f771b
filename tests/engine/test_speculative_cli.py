"""`tpfuse generate` with speculation: acceptance in the logs; the simulate mode says so everywhere."""

import json
import subprocess
import sys

BASE = [sys.executable, "-m", "tpfuse", "generate", "--model", "tiny", "--device", "cpu"]
BASE += ["--num-kv-blocks", "64", "--speculative-algorithm", "ngram"]


def test_simulated_acceptance_is_announced_in_the_logs_and_in_every_json_record():
    args = ["--prompt", "abab abab", "--prompt", "xy", "--max-tokens", "8", "--ignore-eos", "--json"]
    proc = subprocess.run(
        [*BASE, *args, "--speculative-simulate-acceptance-length", "2.5"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "SIMULATED" in proc.stderr and "mean acceptance length" in proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(records) == 2 and all(r["simulated_acceptance"] is True for r in records)
