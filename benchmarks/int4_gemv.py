"""INT4 W4A16 (group 128, symmetric, bf16 scales) at one row: the FMA GEMV (kernels/quant_int.py) vs the
tensor-core kernel (kernels/quant_int_magic.py) at every candidate tile start-up timing tries
(model/linear_choice.py QUANT_TILES[1]), at the llama-3.1-8b projections.

Each case is timed by CUDA-graph replay (gpu_timing.graph_us: launches captured back to back, the
median of repeats) round-robin over enough weight copies to exceed the L2, as 32 layers' weights do.
Bytes per call = packed weights + scales + x. GB/s is against the copy bandwidth (--copy-tbps, else
a 1 GiB device copy measured here). max_abs_err is against x.float() @ the float32 dequantized
weight; rel is that over max |reference|.

Usage (device machine, repo root): python benchmarks/int4_gemv.py [--copy-tbps 4.3] [--json PATH] [--sweep]
--sweep also times SWEEP (tensor-core tiles by rows per program, pipeline stages and split-K).
--smoke runs tiny shapes on the CPU under TRITON_INTERPRET=1 (one call each, no timing: a check that
the script runs; the interpreter multiplies bf16 tl.dot operands as raw bits, so the tensor-core rows'
errors mean something only where tests/kernels/test_quant_int_magic.py patches that).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tpfuse.kernels import quant_int  # noqa: E402
from tpfuse.kernels.quant_int import MagicTile  # noqa: E402
from tpfuse.model.linear_choice import QUANT_TILES  # noqa: E402

SWEEP = tuple(  # --sweep: more tensor-core tiles than start-up times, to choose its candidates from
    MagicTile(1, n, 128, stages, warps, split_k=split)
    for n, warps, stage_set in ((64, 4, (1, 4)), (128, 4, (1, 2, 4)), (256, 8, (1, 3)))
    for stages in stage_set
    for split in (1, 2, 4, 8)
)
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_SHAPES = {"qkv": (48, 256), "down": (32, 384)}
GROUP = 128
L2_DEFEAT_BYTES = 192 << 20


def make_case(num_cols: int, hidden: int, device: str, copies: int):
    gen = torch.Generator(device).manual_seed(num_cols + hidden)
    layers = []
    for _ in range(copies):
        values = torch.randint(0, 16, (num_cols, hidden), generator=gen, device=device)
        scales = (
            torch.rand(num_cols, hidden // GROUP, generator=gen, device=device) * 0.01 + 1e-3
        ).bfloat16()
        layers.append((quant_int.pack_int(values, 4), scales))
    x = torch.randn(1, hidden, generator=gen, device=device).bfloat16()
    return layers, x


def time_us(calls, smoke: bool) -> float:
    if smoke:
        start = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - start) * 1e6
    from tpfuse.gpu_timing import graph_us

    return graph_us(calls, min_launches=32, replays=10, samples=5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--copy-tbps", type=float, default=None, help="copy bandwidth, TB/s (default: measured)"
    )
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, no timing")
    parser.add_argument("--sweep", action="store_true", help="also time the SWEEP tiles")
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        copy_tbps = 1.0
    elif args.copy_tbps is not None:
        copy_tbps = args.copy_tbps
    else:
        from roofline import copy_tbps as measure

        copy_tbps = measure()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    print(
        f"INT4 group {GROUP}, 1 row, bf16 x; copy bandwidth {copy_tbps:.2f} TB/s" + (" (smoke)" * args.smoke)
    )
    header = ("shape", "N x K", "kernel", "us", "GB/s", "of copy", "max_abs_err", "rel")
    print("{:8} {:>13} {:32} {:>8} {:>7} {:>8} {:>12} {:>8}".format(*header))
    rows = []
    for name, (num_cols, hidden) in shapes.items():
        weight_bytes = num_cols * hidden // 2 + num_cols * (hidden // GROUP) * 2
        copies = 1 if args.smoke else max(1, triton.cdiv(L2_DEFEAT_BYTES, weight_bytes))
        layers, x = make_case(num_cols, hidden, device, copies)
        packed, scales = layers[0]
        weight = quant_int.dequantize_int(packed, scales, None, 4, GROUP, hidden)
        reference = x.float() @ weight.T
        call_bytes = weight_bytes + hidden * 2
        best: dict[str, tuple[float, str]] = {}
        tiles = QUANT_TILES[1] + tuple(t for t in SWEEP if args.sweep and t not in QUANT_TILES[1])
        for tile in tiles:
            family = "magic" if isinstance(tile, MagicTile) else "gemv"
            calls = [
                lambda p=p, s=s, x=x, tile=tile: quant_int.int_linear_triton(
                    x, p, s, None, 4, GROUP, tile=tile
                )
                for p, s in layers
            ]
            out = calls[0]()
            err = (out.float() - reference).abs().max().item()
            rel = err / reference.abs().max().item()
            us = time_us(calls, args.smoke)
            gbps = call_bytes / us / 1e3
            best[family] = min(best.get(family, (float("inf"), "")), (us, tile.label()))
            row = dict(shape=name, N=num_cols, K=hidden, kernel=family, tile=tile.label(), us=round(us, 2),
                       candidate=tile in QUANT_TILES[1],
                       GBps=round(gbps, 1), of_copy=round(gbps / (copy_tbps * 1e3), 3),
                       max_abs_err=err, rel_err=rel)  # fmt: skip
            rows.append(row)
            print(f"{name:8} {num_cols:>5} x {hidden:<5} {tile.label():32} {us:8.2f} {gbps:7.0f} "
                  f"{gbps / (copy_tbps * 1e3):8.1%} {err:12.3e} {rel:8.1e}", flush=True)  # fmt: skip
        if len(best) == 2:
            (magic_us, magic_tile), (gemv_us, gemv_tile) = best["magic"], best["gemv"]
            print(f"{name:8} best: {magic_tile} {magic_us:.2f} us, {gemv_tile} {gemv_us:.2f} us "
                  f"(magic / gemv {magic_us / gemv_us:.2f})")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_tbps=copy_tbps, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
