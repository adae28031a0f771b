"""The GPU machine has httpx, rich, matplotlib and nvidia-ml-py but no fastapi, pydantic or openai."""

import subprocess
import sys

SCRIPT = """
import sys
import tpfuse.bench.cli, tpfuse.bench.runs, tpfuse.bench.sweep, tpfuse.bench.compare
import tpfuse.bench.outputs, tpfuse.bench.report, tpfuse.bench.telemetry
print(",".join(m for m in ("fastapi", "pydantic", "openai", "uvicorn", "starlette") if m in sys.modules))
"""


def test_bench_never_imports_server_only_packages():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_registering_the_bench_cli_imports_nothing_heavy():
    heavy = "('httpx', 'rich', 'matplotlib')"
    script = f"import sys, tpfuse.bench.cli; print(','.join(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""
