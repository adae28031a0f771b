"""Kernel latency of every all-reduce schedule with virtual ranks on one GPU (fused residual + RMSNorm,
bf16, hidden 6144), and the link probe run over those virtual ranks.

ALL RANKS SHARE ONE GPU'S MEMORY: these are kernel latencies of the protocol (launch, flag rounds, the
reduction and epilogue), NOT link figures; on PCIe the links dominate (docs/PCIE.md has the model).
Usage: python benchmarks/comm_schedules.py [--quick]; JSON to $OUT/comm_schedules.json when OUT is set.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial

import torch

from tpfuse.comm import launch
from tpfuse.comm.bench import time_virtual
from tpfuse.comm.hybrid import programs_per_rank
from tpfuse.comm.link_probe import probe_virtual
from tpfuse.comm.schedules import ALGORITHMS
from tpfuse.comm.workspace import create_virtual_workspaces

QUICK = "--quick" in sys.argv
HIDDEN = 6144
TOKENS = (1, 8, 32) if QUICK else (1, 8, 32, 128, 256)
ISLANDS = {2: ((0,), (1,)), 4: ((0, 1), (2, 3)), 8: ((0, 1, 2, 3), (4, 5, 6, 7))}
WARNING = "virtual ranks share one GPU: kernel latency, NOT a link figure"


def bench(world_size: int) -> list[dict]:
    programs = programs_per_rank(torch.device("cuda"), world_size)
    wss = create_virtual_workspaces(world_size, "cuda:0", max(TOKENS) * HIDDEN * 4, programs, 30.0)
    for ws in wss:
        ws.set_islands(ISLANDS[world_size])
    rows = []
    for tokens in TOKENS:
        g = torch.Generator(device="cpu").manual_seed(tokens)
        xs = [(torch.randn(tokens, HIDDEN, generator=g) * 0.1).bfloat16().cuda() for _ in range(world_size)]
        residual = torch.randn(tokens, HIDDEN, generator=g).bfloat16().cuda()
        weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device="cuda")
        row = {"tp": world_size, "tokens": tokens, "bytes": tokens * HIDDEN * 2}
        for name in ALGORITHMS:
            calls = [partial(launch.fused_add_rmsnorm, wss[r], xs[r], residual, weight, 1e-6, name)
                     for r in range(world_size)]  # fmt: skip
            row[name] = round(time_virtual(calls, iters=20 if QUICK else 50, repeats=5), 2)
        for ws in wss:
            ws.check()
        rows.append(row)
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    result = {
        "warning": WARNING,
        "gpu": torch.cuda.get_device_name(0),
        "hidden": HIDDEN,
        "rows": [],
        "probe": {},
    }
    print(
        f"== {WARNING.upper()} ({result['gpu']}, fused residual + RMSNorm, bf16, hidden {HIDDEN}, "
        "us per call)"
    )
    header = ["tp", "tokens", "bytes", *ALGORITHMS]
    print("  ".join(f"{h:>12}" for h in header))
    for world_size in (2, 4, 8):
        for row in bench(world_size):
            result["rows"].append(row)
            print("  ".join(f"{row[h]:>12}" for h in header), flush=True)
    wss = create_virtual_workspaces(4, "cuda:0", 1 << 20, 4, 30.0)
    links = probe_virtual(wss)
    result["probe"] = links.to_json()
    print(f"== link probe over 4 virtual ranks ({WARNING}): GB/s write / read, us write / read latency")
    print(f"  pair 0->1: {links.write_gbps[0][1]:.1f} / {links.read_gbps[0][1]:.1f} GB/s, "
          f"{links.write_latency_us[0][1]:.2f} / {links.read_latency_us[0][1]:.2f} us; fan-out write "
          f"{links.fanout_write_gbps[0]:.1f} GB/s, read {links.fanout_read_gbps[0]:.1f} GB/s; "
          f"pinned host write "
          f"{links.host_write_gbps[0]:.1f} GB/s, {links.host_write_latency_us[0]:.2f} us")  # fmt: skip
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "comm_schedules.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
