"""comm-bench on one GPU: virtual ranks (streams of one process) at TP 2 and 4, then 2 processes sharing
the GPU at TP 2 and 4 (CUDA IPC / symmetric memory, time-sliced). Prints each table; JSON under $OUT.

Ranks share one GPU here, so these are kernel latencies under sharing, not link measurements: they
show that the protocol runs and what one rank's kernel costs, not what NVLink would give.
Usage: python benchmarks/comm_single_gpu.py [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

QUICK = "--quick" in sys.argv
FULL_TOKENS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"
RUNS = [
    ("virtual_tp2", ["--virtual-ranks", "2", "--tokens", "1,2,4,8,16,32" if QUICK else FULL_TOKENS]),
    ("virtual_tp4", ["--virtual-ranks", "4", "--tokens", "1,2,4,8,16,32" if QUICK else FULL_TOKENS]),
    # processes time-slice the GPU (ms per call): a short sweep with few calls per graph
    (
        "processes_tp2",
        ["--nproc", "2", "--tokens", "1,8,64", "--hidden", "4096,8192", "--iters", "5", "--repeats", "3"],
    ),
    (
        "processes_tp4",
        ["--nproc", "4", "--tokens", "1,8", "--hidden", "4096", "--iters", "5", "--repeats", "3"],
    ),
]


def main() -> int:
    out_dir = os.environ.get("OUT")
    failures = 0
    for name, extra in RUNS:
        command = [sys.executable, "-m", "tpfuse.cli", "comm-bench", "--json", *extra]
        print(f"== {name}: {' '.join(command[2:])}", flush=True)
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=560)
        if done.returncode != 0:
            failures += 1
            print(f"FAILED ({done.returncode}):\n{done.stderr[-4000:]}", flush=True)
            continue
        result = json.loads(done.stdout)
        if out_dir:
            with open(os.path.join(out_dir, f"comm_{name}.json"), "w") as f:
                json.dump(result, f, indent=1)
        from tpfuse.comm.bench import format_table

        print(format_table(result))
        print(f"({time.monotonic() - started:.0f} s)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
