"""benchmarks/host_step_cost.py runs at tiny sizes and reports each host phase of a planned step."""

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "host_step_cost.py")


def test_host_step_cost_reports_schedule_pack_and_postprocess_per_batch(tmp_path):
    out = tmp_path / "host.json"
    args = ["--batch-sizes", "1,3", "--context", "40", "--steps", "5", "--json", str(out)]
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        parts = r["schedule_following"] + r["pack_step"] + r["postprocess"]
        assert r["pack_step"] > 0 and abs(r["total"] - parts) < 1e-6
