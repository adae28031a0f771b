"""benchmarks/admission_sim.py runs at small sizes and shows what the growth reserve is for: under a
KV budget that holds a third of the clients at full length, admitting what fits preempts and
recomputes more than the reserve does."""

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "admission_sim.py")


def test_the_reserve_preempts_less_than_admitting_what_fits():
    args = ["--concurrency", "24", "--requests", "48", "--input-len", "64", "--output-len", "64",
            "--kv-tokens", "1024", "--prefill-budget", "128", "--max-running", "24"]  # fmt: skip
    run = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = {line.split()[1]: line.split() for line in run.stdout.splitlines() if line.split()[:1] == ["24"]}
    fits, reserve = int(rows["admit-fits"][3]), int(rows["growth-reserve"][3])
    assert fits > 0 and reserve < fits
