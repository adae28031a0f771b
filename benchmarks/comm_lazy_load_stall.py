"""Issue 25 on one GPU: an unloaded counting kernel between the virtual ranks' launches stalls them.

Each case runs in a fresh process (a kernel loaded once stays loaded), 4 virtual ranks, two-shot or
one-shot, 4 x 4096 bf16: four calls to build the expected outputs, then the counting preload, then
`--calls` back-to-back calls with the per-rank counting of tests/comm/virtual_ranks.py. Cases:

- rank0:        the old preload (rank 0's slice of the counter only), lazy module loading;
- every-rank:   load_counting_kernels (every rank's slice), lazy loading: the fix;
- rank0-eager:  the old preload under CUDA_MODULE_LOADING=EAGER (nothing loads during the loop).

Expected if the stall is the cause: rank0 shows ranks 0 and 1 naming ranks 2 and 3 in their error
words, mismatches [a, a, b, b] and about 2 x timeout (two-shot) of wall time; the other two: all 0.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/comm_lazy_load_stall.py     # one H200, about 30 s
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CASES = {"rank0": ("rank0", "LAZY"), "every-rank": ("every", "LAZY"), "rank0-eager": ("rank0", "EAGER")}


def one_case(preload: str, algorithm: str, calls: int, timeout_s: float) -> dict:
    import torch
    from tests.comm.reference import EPS
    from tests.comm.test_gpu_schedules import forced_plan
    from tests.comm.virtual_ranks import (
        add_mismatches,
        calls_on_streams,
        cuda_randn,
        load_counting_kernels,
        on_streams,
    )

    from tpfuse.comm.hybrid import create_virtual_communicators

    world, tokens, hidden = 4, 4, 4096
    comms = create_virtual_communicators(world, "cuda", 64, hidden, torch.bfloat16, timeout_s=timeout_s)
    for comm in comms:
        comm.plan = forced_plan(algorithm, hidden * 2, 64)
    sets = [[cuda_randn(tokens, hidden, dtype=torch.bfloat16) for _ in range(world)] for _ in range(4)]
    residual = cuda_randn(tokens, hidden, dtype=torch.bfloat16)
    weight = cuda_randn(hidden, dtype=torch.bfloat16)

    def call(r, xs):
        return comms[r].fused_add_rmsnorm_all_reduce(xs[r], residual, weight, EPS)

    expected = [on_streams(world, lambda r, xs=xs: call(r, xs))[0] for xs in sets]
    mismatches = torch.zeros(world, dtype=torch.int64, device="cuda")
    if preload == "every":
        load_counting_kernels(mismatches, expected)
    else:
        add_mismatches(mismatches, 0, expected[0], expected[0])
        torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(world)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    started = time.monotonic()
    calls_on_streams(comms, streams, sets, residual, weight, expected, mismatches, calls=calls)
    return {
        "mismatches": mismatches.tolist(),
        "error_masks": [c.workspace.error_mask() for c in comms],
        "wall_s": round(time.monotonic() - started, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithm", default="two_shot")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--timeout-s", type=float, default=3.0)
    ap.add_argument("--case", choices=sorted(CASES), help="run one case in this process (internal)")
    args = ap.parse_args()
    if args.case:
        preload, _ = CASES[args.case]
        print(json.dumps(one_case(preload, args.algorithm, args.calls, args.timeout_s)))
        return
    print(f"{'case':12s} {'module loading':15s} {'mismatches per rank':28s} {'error masks':16s} wall s")
    for case, (_, loading) in CASES.items():
        env = dict(os.environ, CUDA_MODULE_LOADING=loading)
        cmd = [sys.executable, __file__, "--case", case, "--algorithm", args.algorithm,
               "--calls", str(args.calls), "--timeout-s", str(args.timeout_s)]  # fmt: skip
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode:
            print(f"{case:12s} {loading:15s} failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        counts, masks = str(r["mismatches"]), str(r["error_masks"])
        print(f"{case:12s} {loading:15s} {counts:28s} {masks:16s} {r['wall_s']}")


if __name__ == "__main__":
    main()
