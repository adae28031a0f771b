"""Triton GEMV (kernels/gemv.py) vs cuBLAS at the llama-3.1-8b projections, one row (batch-1 decode).

Each case is timed by CUDA-graph replay (launches captured back to back, as the decode step replays
them) over enough weight copies to exceed the 60 MB L2, as 32 layers' weights do. Reports us per
call and the weight bytes streamed per second against the measured copy bandwidth (bytes read +
written / time of a 1 GiB eager copy, as benchmarks/decode.py measures it), whether repeated GEMV
calls are bit-identical, and the largest error against float64 as a fraction of the GPU test's
allowance. A tile sweep (rows per program, K per step, warps) runs at every shape while its time
budget lasts; the default tile is the one kernels/gemv.py ships. Ends with the per-step estimate:
32 layers plus lm_head, cuBLAS vs the faster of the two per projection (what model/linear_choice.py
picks at start-up).

Usage (device machine, repo root): python benchmarks/gemv.py [--sweep-seconds 120]   # JSON to $OUT/gemv.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch
import triton

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # last: benchmarks/kernels.py shadows no package
from roofline import copy_tbps  # noqa: E402
from tpfuse import gpu_timing  # noqa: E402
from tpfuse.kernels import gemv  # noqa: E402

SHAPES = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
PER_STEP = {"qkv": 32, "o_proj": 32, "gate_up": 32, "down": 32, "lm_head": 1}
TILES = [  # (block_n, block_k, num_warps)
    (bn, bk, warps)
    for bn in (2, 4, 8, 16)
    for bk in (512, 1024, 2048)
    for warps in (4, 8)
    if bn * bk <= 16384
]
SWEEP_BUDGET_S = 120.0
L2_DEFEAT_BYTES = 192 << 20
DEVICE = "cuda"  # tests/kernels/test_gemv.py runs this file on CPU at tiny shapes
DTYPE = torch.bfloat16
ROWS: list[dict] = []


graph_us = functools.partial(gpu_timing.graph_us, replays=5, samples=3)


def record(name: str, impl: str, us: float, weight_bytes: int, copy_bw: float, **extra) -> dict:
    tbps = weight_bytes / us / 1e6
    row = dict(shape=name, M=1, impl=impl, us=round(us, 2), TBps=round(tbps, 3),
               of_copy=round(tbps / copy_bw, 3), **extra)  # fmt: skip
    ROWS.append(row)
    note = " ".join(f"{k}={v}" for k, v in extra.items())
    print(f"{name:8s} {impl:30s} {us:9.2f} us {tbps:6.2f} TB/s {tbps / copy_bw:6.1%}  {note}", flush=True)
    return row


class Case:
    """x [1, K], enough copies of weight [N, K] to defeat the L2, one output per copy."""

    def __init__(self, num_cols: int, hidden: int):
        self.weight_bytes = num_cols * hidden * 2
        copies = max(1, triton.cdiv(L2_DEFEAT_BYTES, self.weight_bytes))
        self.weights = [torch.randn(num_cols, hidden, device=DEVICE).to(DTYPE) for _ in range(copies)]
        self.x = torch.randn(1, hidden, device=DEVICE).to(DTYPE)
        self.outs = [torch.empty(1, num_cols, device=DEVICE, dtype=DTYPE) for _ in range(copies)]
        self.launches = 8 if self.weight_bytes > (256 << 20) else 32

    def cublas_calls(self):
        return [
            lambda w=w, o=o: torch.matmul(self.x, w.t(), out=o)
            for w, o in zip(self.weights, self.outs, strict=True)
        ]

    def gemv_calls(self, **tile):
        return [
            lambda w=w, o=o: gemv.gemv_triton(self.x, w, None, o, **tile)
            for w, o in zip(self.weights, self.outs, strict=True)
        ]

    def check(self) -> dict:
        """Bit-identity of three calls, and the largest error vs float64 as a fraction of the GPU
        test's allowance (<= 1 passes): one rounding, eps * |exact|, plus fp32 accumulation,
        sqrt(K) * 2^-24 * sum_k |x_k w_k|."""
        w = self.weights[0]
        first = gemv.gemv_triton(self.x, w).clone()
        identical = all(torch.equal(gemv.gemv_triton(self.x, w), first) for _ in range(2))
        x64, w64 = self.x.double(), w.double()
        exact = x64 @ w64.T
        allowed = torch.finfo(DTYPE).eps * exact.abs() + w.shape[1] ** 0.5 * 2.0**-24 * (
            x64.abs() @ w64.abs().T
        )
        of_allowed = ((first.double() - exact).abs() / allowed).max().item()
        return dict(bit_identical=identical, err_of_allowed=round(of_allowed, 3))


def bench_shape(name: str, copy_bw: float, sweep_until: float) -> dict:
    case = Case(*SHAPES[name])
    cublas = graph_us(case.cublas_calls(), case.launches)
    record(name, "torch.matmul (cuBLAS)", cublas, case.weight_bytes, copy_bw)
    default = graph_us(case.gemv_calls(), case.launches)
    record(name, "gemv_triton (default tile)", default, case.weight_bytes, copy_bw,
           vs_cublas=round(cublas / default, 3), **case.check())  # fmt: skip
    best = {"label": "default", "us": default}
    for block_n, block_k, warps in TILES:
        if time.perf_counter() > sweep_until:
            break
        label = f"n={block_n} k={block_k} w={warps}"
        us = graph_us(case.gemv_calls(block_n=block_n, block_k=block_k, num_warps=warps), case.launches)
        record(name, f"gemv_triton {label}", us, case.weight_bytes, copy_bw)
        if us < best["us"]:
            best = {"label": label, "us": us}
    return dict(cublas_us=cublas, gemv_us=default, best=best)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep-seconds", type=float, default=SWEEP_BUDGET_S, help="time for the tile sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/gemv.py needs a CUDA GPU")
        return 1
    props = torch.cuda.get_device_properties(0)
    versions = f"torch {torch.__version__} triton {triton.__version__}"
    print(f"{props.name} sms={props.multi_processor_count} {versions}")
    started = time.perf_counter()
    copy_bw = copy_tbps()
    print(f"copy bandwidth (read + write): {copy_bw:.2f} TB/s")
    results = {}
    sweep_until = started + args.sweep_seconds
    for name in SHAPES:
        results[name] = bench_shape(name, copy_bw, sweep_until)
        print(f"({time.perf_counter() - started:.0f} s)", flush=True)
    cublas = sum(PER_STEP[n] * r["cublas_us"] for n, r in results.items())
    chosen = sum(PER_STEP[n] * min(r["cublas_us"], r["gemv_us"]) for n, r in results.items())
    steps = [dict(M=1, cublas_step_us=round(cublas, 1), best_step_us=round(chosen, 1))]
    print(f"projections per step, one row: cuBLAS {cublas:.1f} us, faster of cuBLAS / default GEMV "
          f"{chosen:.1f} us ({cublas / chosen:.3f}x)")  # fmt: skip
    for name, r in results.items():
        print(f"  best tile at {name}: {r['best']['label']} {r['best']['us']:.2f} us")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        meta = {
            "gpu": props.name,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "copy_TBps": copy_bw,
        }
        with open(os.path.join(out, "gemv.json"), "w") as f:
            json.dump({"meta": meta, "rows": ROWS, "steps": steps}, f, indent=1)
        print(f"wrote {out}/gemv.json")
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
