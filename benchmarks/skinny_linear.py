"""Few-row Triton linear (kernels/skinny_linear.py) vs cuBLAS at the llama-3.1-8b projections, M rows.

For each row count of --rows and each projection: cuBLAS (torch.matmul), the one-row GEMV on the
first row for scale (what a plain decode step pays per sequence), and every tile of --tiles, each
timed by CUDA-graph replay over enough weight copies to exceed the L2 (as benchmarks/gemv.py).
--tiles choice: the tiles model/linear_choice.py tries at start-up for the row bucket; wide: the
session-8 sweep set they were picked from. Reports us per call, the weight bytes streamed per second
as a fraction of the copy bandwidth, the best tile's largest error against float64 as a fraction of
the GPU test's allowance, and per row count the projection time of a step (32 layers + lm_head):
cuBLAS against the faster of cuBLAS and the best tile at each projection.

Usage (device machine, repo root): python benchmarks/skinny_linear.py [--rows 4,32,64] [--tiles wide]
(JSON to $OUT/skinny_linear.json)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # last: benchmarks/kernels.py shadows no package
import gemv as gemv_bench  # noqa: E402  (benchmarks/gemv.py: shapes, copy bandwidth, timing)
from tpfuse.kernels.gemv import gemv_triton  # noqa: E402
from tpfuse.kernels.skinny_linear import Tile, row_bucket, skinny_linear_triton  # noqa: E402
from tpfuse.model.linear_choice import TILES  # noqa: E402


def wide_tiles(block_m: int) -> list[Tile]:
    """The session-8 sweep: rows of weight x K per step x stages, plain / swap, split-K 1, 2, 4."""
    tile = lambda n, k, stages, swap=False, split=1: Tile(block_m, n, k, stages, 4, swap, split)  # noqa: E731
    if block_m == 16:
        return [
            tile(32, 256, 5), tile(64, 128, 5, True), tile(128, 128, 3, True), tile(128, 256, 3, True),
            tile(32, 256, 5, False, 2), tile(64, 256, 4, False, 2), tile(64, 128, 5, True, 2),
            tile(128, 128, 3, True, 2), tile(128, 128, 3, True, 4), tile(64, 128, 5, True, 4),
            tile(16, 256, 5),
        ]  # fmt: skip
    wider = [  # 8 warps (session 8's second sweep)
        Tile(block_m, 64, 128, 3, 8), Tile(block_m, 128, 64, 3, 8), Tile(block_m, 128, 128, 3, 8),
        Tile(block_m, 128, 64, 4, 8, True), Tile(block_m, 64, 128, 4, 8, False, 2),
    ]  # fmt: skip
    return [
        tile(32, 128, 5), tile(64, 128, 3), tile(64, 128, 3, True), tile(32, 128, 4, False, 2),
        tile(64, 128, 3, False, 2), tile(64, 128, 3, True, 2), tile(128, 64, 3, True, 2),
        tile(128, 64, 3, True, 4), tile(64, 128, 3, True, 4), tile(64, 64, 4, False, 4),
    ] + wider  # fmt: skip


def err_of_allowed(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """Largest |out - exact| over the GPU test's allowance (one rounding plus fp32 accumulation)."""
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.T
    allowed = torch.finfo(x.dtype).eps * exact.abs() + x.shape[1] ** 0.5 * 2.0**-24 * (
        x64.abs() @ w64.abs().T
    )
    return ((out.double() - exact).abs() / allowed).max().item()


def bench(name: str, rows: int, tiles: list[Tile], copy_bw: float, rows_out: list[dict]) -> dict:
    num_cols, hidden = gemv_bench.SHAPES[name]
    weight_bytes = num_cols * hidden * 2
    copies = max(1, triton.cdiv(gemv_bench.L2_DEFEAT_BYTES, weight_bytes))
    device, dtype = gemv_bench.DEVICE, gemv_bench.DTYPE
    weights = [torch.randn(num_cols, hidden, device=device).to(dtype) for _ in range(copies)]
    x = torch.randn(rows, hidden, device=device).to(dtype)
    outs = [torch.empty(rows, num_cols, device=device, dtype=dtype) for _ in weights]
    launches = 8 if weight_bytes > (256 << 20) else 32

    def timed(impl: str, make_call) -> float:
        us = gemv_bench.graph_us([make_call(w, o) for w, o in zip(weights, outs, strict=True)], launches)
        share = weight_bytes / us / 1e6 / copy_bw
        rows_out.append(dict(shape=name, M=rows, impl=impl, us=round(us, 2), of_copy=round(share, 3)))
        print(f"{name:8s} M={rows:<3d} {impl:34s} {us:9.2f} us {share:6.1%}", flush=True)
        return us

    cublas = timed("torch.matmul (cuBLAS)", lambda w, o: lambda: torch.matmul(x, w.t(), out=o))
    x1 = x[:1]
    timed("gemv_triton, row 0 only", lambda w, o: lambda: gemv_triton(x1, w, None, o[:1]))
    best = (float("inf"), None)
    for tile in tiles:
        us = timed(tile.label(), lambda w, o, t=tile: lambda: skinny_linear_triton(x, w, None, o, tile=t))
        best = min(best, (us, tile), key=lambda b: b[0])
    error = err_of_allowed(skinny_linear_triton(x, weights[0], None, tile=best[1]), x, weights[0])
    print(f"{name:8s} M={rows:<3d} best {best[1].label()}: x{cublas / best[0]:.3f} cuBLAS, "
          f"error {error:.2f} of allowed", flush=True)  # fmt: skip
    return dict(cublas_us=cublas, best_us=best[0], best_tile=best[1].label(), err_of_allowed=error)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="4,32,64", help="row counts, 2..64")
    parser.add_argument("--tiles", choices=("choice", "wide"), default="choice")
    args = parser.parse_args()
    if gemv_bench.DEVICE == "cuda" and not torch.cuda.is_available():
        print("benchmarks/skinny_linear.py needs a CUDA GPU")
        return 1
    started = time.perf_counter()
    copy_bw = gemv_bench.copy_tbps() if gemv_bench.DEVICE == "cuda" else 1.0
    print(f"copy bandwidth (read + write): {copy_bw:.2f} TB/s")
    rows_out: list[dict] = []
    steps = []
    for rows in (int(r) for r in args.rows.split(",")):
        bucket = row_bucket(rows)
        tiles = list(TILES[bucket]) if args.tiles == "choice" else wide_tiles(bucket)
        results = {name: bench(name, rows, tiles, copy_bw, rows_out) for name in gemv_bench.SHAPES}
        per_step = gemv_bench.PER_STEP
        cublas = sum(per_step[n] * r["cublas_us"] for n, r in results.items())
        best = sum(per_step[n] * min(r["cublas_us"], r["best_us"]) for n, r in results.items())
        steps.append(
            dict(M=rows, cublas_step_us=round(cublas, 1), best_step_us=round(best, 1), shapes=results)
        )
        elapsed = time.perf_counter() - started
        print(f"M={rows}: projections per step cuBLAS {cublas:.0f} us, faster of cuBLAS / best tile "
              f"{best:.0f} us ({cublas / best:.3f}x)  ({elapsed:.0f} s)", flush=True)  # fmt: skip
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "skinny_linear.json"), "w") as f:
            json.dump({"copy_TBps": copy_bw, "rows": rows_out, "steps": steps}, f, indent=1)
        print(f"wrote {out}/skinny_linear.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
