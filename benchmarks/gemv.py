"""Triton GEMV (kernels/gemv.py) vs torch.matmul (cuBLAS) at llama-3.1-8b decode projections.

Each case is timed by CUDA-graph replay (launches captured back to back, as the decode step
replays them) over enough weight copies to exceed the 60 MB L2, as 32 layers' weights do.
Reports us per call and achieved TB/s (weight bytes / time) against the measured copy bandwidth
(bytes read + written / time of a 1 GiB copy), whether repeated Triton calls are bit-identical,
and the largest error against float64 as a fraction of the GPU test's allowance. A sweep over
tiles runs for the small projections (qkv, o_proj) while the time budget lasts. Ends with the
per-step estimate: 32 layers plus lm_head at each M, cuBLAS vs the faster of the two per projection.

cuBLAS is also timed through F.linear and with cuBLASLt as torch's BLAS backend, to see whether
another route into the vendor library serves the small M = 1 projections (qkv, o_proj) better.

Usage (device machine, repo root): python benchmarks/gemv.py   # JSON to $OUT/gemv.json if set
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import torch
import triton

from tpfuse.bench import gpu_timing
from tpfuse.kernels import gemv

SHAPES = {  # name: (N, K), per layer count
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
PER_STEP = {"qkv": 32, "o_proj": 32, "gate_up": 32, "down": 32, "lm_head": 1}
ROWS_LIST = (1, 4, 8)
SWEEP_SHAPES = ("qkv", "o_proj")
SUM_TILES = ((8, 512), (16, 256), (16, 512), (32, 256))  # (block_n, block_k at M=1)
DOT_TILES = ((32, 128), (64, 128), (64, 256), (128, 128))
SWEEP_BUDGET_S = 40.0
L2_DEFEAT_BYTES = 192 << 20
COPY_BYTES = 1 << 30
DEVICE = "cuda"  # tests/kernels/test_gemv.py runs this file on CPU at tiny shapes
DTYPE = torch.bfloat16
ROWS: list[dict] = []


graph_us = functools.partial(gpu_timing.graph_us, replays=5, samples=3)


def copy_tbps(iters: int = 20) -> float:
    """Bytes read + written per second by an eager device-to-device copy, as benchmarks/decode.py
    measures it. (The same copy captured in a CUDA graph, a memcpy node, gave 2.77 TB/s on the H200
    where the eager copy gives 4.26-4.29 TB/s, likely the copy engines serving it: not the reference.)"""
    src = torch.empty(COPY_BYTES // 2, dtype=DTYPE, device=DEVICE)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * src.element_size() * iters / (start.elapsed_time(end) * 1e-3) / 1e12


def record(name: str, rows: int, impl: str, us: float, weight_bytes: int, copy_bw: float, **extra) -> dict:
    tbps = weight_bytes / us / 1e6
    row = dict(shape=name, M=rows, impl=impl, us=round(us, 2), TBps=round(tbps, 3),
               of_copy=round(tbps / copy_bw, 3), **extra)  # fmt: skip
    ROWS.append(row)
    note = " ".join(f"{k}={v}" for k, v in extra.items())
    print(
        f"{name:8s} M={rows:<2d} {impl:34s} {us:9.2f} us {tbps:6.2f} TB/s {tbps / copy_bw:6.1%}  {note}",
        flush=True,
    )
    return row


class Case:
    """x [M, K], enough copies of weight [N, K] to defeat the L2, one output per copy."""

    def __init__(self, num_cols: int, hidden: int, rows: int):
        self.weight_bytes = num_cols * hidden * 2
        copies = max(1, triton.cdiv(L2_DEFEAT_BYTES, self.weight_bytes))
        self.weights = [torch.randn(num_cols, hidden, device=DEVICE).to(DTYPE) for _ in range(copies)]
        self.x = torch.randn(rows, hidden, device=DEVICE).to(DTYPE)
        self.outs = [torch.empty(rows, num_cols, device=DEVICE, dtype=DTYPE) for _ in range(copies)]

    def cublas_calls(self):
        return [
            lambda w=w, o=o: torch.matmul(self.x, w.t(), out=o)
            for w, o in zip(self.weights, self.outs, strict=True)
        ]

    def linear_calls(self):
        return [lambda w=w: torch.nn.functional.linear(self.x, w) for w in self.weights]

    def triton_calls(self, **launch):
        run = (lambda w, o: gemv.gemv_launch(self.x, w, o, **launch)) if launch else (
            lambda w, o: gemv.gemv_triton(self.x, w, o))  # fmt: skip
        return [lambda w=w, o=o: run(w, o) for w, o in zip(self.weights, self.outs, strict=True)]

    def check(self) -> dict:
        """Bit-identity of three eager calls, and the largest error vs float64 as a fraction of
        the allowance the GPU test uses (<= 1 passes): one rounding, eps * |exact|, plus fp32
        accumulation, sqrt(K) * 2^-24 * sum_k |x_k w_k|."""
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


def sweep_launches(name: str, rows: int, num_sms: int):
    """(label, gemv_launch kwargs) for the tiles in the sweep; split from the shape rule."""
    num_cols, hidden = SHAPES[name]
    for block_n, block_k in SUM_TILES if rows <= 4 else ():
        block_k = max(block_k // triton.next_power_of_2(rows), 32)
        split = gemv.split_k_for(num_cols, hidden, block_n, block_k, num_sms)
        launch = dict(
            split_k=split, block_n=block_n, block_k=block_k, use_dot=False, num_warps=4, num_stages=3
        )
        yield f"sum n={block_n} k={block_k} s={split}", launch
    for block_n, block_k in DOT_TILES if rows >= 4 else ():
        split = gemv.split_k_for(num_cols, hidden, block_n, block_k, num_sms)
        launch = dict(
            split_k=split, block_n=block_n, block_k=block_k, use_dot=True, num_warps=4, num_stages=4
        )
        yield f"dot n={block_n} k={block_k} s={split}", launch


def bench_shape(name: str, rows: int, copy_bw: float, num_sms: int, sweep: bool) -> dict:
    num_cols, hidden = SHAPES[name]
    case = Case(num_cols, hidden, rows)
    launches = 8 if case.weight_bytes > (256 << 20) else 32
    cublas = graph_us(case.cublas_calls(), launches)
    record(name, rows, "torch.matmul (cuBLAS)", cublas, case.weight_bytes, copy_bw)
    # other ways into the vendor library: F.linear (addmm path), and cuBLASLt as torch's BLAS backend
    record(name, rows, "F.linear", graph_us(case.linear_calls(), launches), case.weight_bytes, copy_bw)
    previous = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        lt = graph_us(case.cublas_calls(), launches)
        record(name, rows, "torch.matmul (cuBLASLt backend)", lt, case.weight_bytes, copy_bw)
    except RuntimeError as exc:  # a build without cuBLASLt as a choice
        print(f"cuBLASLt backend not available: {exc}")
    finally:
        torch.backends.cuda.preferred_blas_library(previous)
    config = gemv.gemv_config(rows)
    split = gemv.split_k_for(num_cols, hidden, config["block_n"], config["block_k"], num_sms)
    default = graph_us(case.triton_calls(), launches)
    record(name, rows, "gemv_triton (default config)", default, case.weight_bytes, copy_bw, split_k=split,
           vs_cublas_us=round(default - cublas, 2), **case.check())  # fmt: skip
    best = {"label": "default", "us": default}
    for label, launch in sweep_launches(name, rows, num_sms) if sweep else ():
        us = graph_us(case.triton_calls(**launch), launches)
        record(name, rows, f"gemv_launch {label}", us, case.weight_bytes, copy_bw)
        if us < best["us"]:
            best = {"label": label, "us": us}
    return dict(cublas_us=cublas, triton_us=default, best=best)


def main() -> int:
    if not torch.cuda.is_available():
        print("benchmarks/gemv.py needs a CUDA GPU")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    versions = f"torch {torch.__version__} triton {triton.__version__}"
    print(f"{props.name} sms={props.multi_processor_count} {versions}")
    started = time.perf_counter()
    copy_bw = copy_tbps()
    print(f"copy bandwidth (read + write): {copy_bw:.2f} TB/s")
    results = {}
    for rows in ROWS_LIST:
        for name in SHAPES:
            sweep = name in SWEEP_SHAPES and time.perf_counter() - started < SWEEP_BUDGET_S
            results[(name, rows)] = bench_shape(name, rows, copy_bw, props.multi_processor_count, sweep)
        print(f"({time.perf_counter() - started:.0f} s)", flush=True)
    steps = []
    for rows in ROWS_LIST:
        cublas = sum(PER_STEP[n] * results[(n, rows)]["cublas_us"] for n in SHAPES)
        best = sum(
            PER_STEP[n] * min(results[(n, rows)]["cublas_us"], results[(n, rows)]["best"]["us"])
            for n in SHAPES
        )
        steps.append(dict(M=rows, cublas_step_us=round(cublas, 1), best_step_us=round(best, 1)))
        print(f"projections per step M={rows}: cuBLAS {cublas:8.1f} us, faster of the two {best:8.1f} us "
              f"(saves {cublas - best:.1f} us)")  # fmt: skip
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
