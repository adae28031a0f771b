"""INT4 W4A16 (group 128, symmetric, bf16 scales) at one row: the FMA GEMV (kernels/quant_int.py), its
GemvTile forms (kernels/quant_int_gemv.py: "vec", "xs"), the tensor-core kernel
(kernels/quant_int_magic.py) and the f16x2 GEMV (kernels/quant_int_half2.py) at every candidate tile
start-up timing tries (model/linear_choice.py QUANT_TILES[1]), at the llama-3.1-8b projections.

Each case is timed by CUDA-graph replay (gpu_timing.graph_us: launches captured back to back, the
median of repeats) round-robin over enough weight copies to exceed the L2, as 32 layers' weights do.
Bytes per call = packed weights + scales + x. GB/s is against the copy bandwidth (--copy-tbps, else
a 1 GiB device copy measured here). max_abs_err is against x.float() @ the float32 dequantized
weight; rel is that over max |reference|.

Usage (device machine, repo root): python benchmarks/int4_gemv.py [--copy-tbps 4.3] [--json PATH] [--sweep]
    [--forms int,vec,xs,magic] [--shapes qkv,o_proj,gate_up,down]
--sweep also times SWEEP (tensor-core tiles by rows per program, pipeline stages and split-K),
GEMV_SWEEP (more GemvTile forms: pinned or not, prefetch, warps, rows, registers) and HALF2_SWEEP
(kernels/quant_int_half2.py's f16x2 GEMV by rows, K step, warps and K split).
--forms keeps the tiles of those families ("int": kernels/quant_int.py's GEMV; "ready": the f16x2 tiles
on x converted once beforehand, quant_int_half2.Half2X, timed without that conversion, and then the
norm and SiLU-and-mul that would write it, each writing the plain row and Half2X); --shapes those
shapes.
Each row's "form" is its family; "kernel" is "magic" for the tensor-core kernel, "half2" for the
f16x2 GEMV, else "gemv".
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

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # last: benchmarks/kernels.py shadows no package
from tpfuse.kernels import quant_int, quant_int_half2  # noqa: E402
from tpfuse.kernels.quant_int import GemvTile, Half2Tile, MagicTile  # noqa: E402
from tpfuse.model.linear_choice import QUANT_TILES  # noqa: E402

SWEEP = tuple(  # --sweep: more tensor-core tiles than start-up times, to choose its candidates from
    MagicTile(1, n, 128, stages, warps, split_k=split)
    for n, warps, stage_set in ((64, 4, (1, 4)), (128, 4, (1, 2, 4)), (256, 8, (1, 3)))
    for stages in stage_set
    for split in (1, 2, 4, 8)
)
GEMV_SWEEP = (  # --sweep: more GemvTile forms than start-up times (kernels/quant_int_gemv.py)
    GemvTile(1, 8, 4096, 1, 4, pin=True),  # once a start-up candidate: 1.05-1.3x the 8-row GEMV (H200)
    GemvTile(1, 8, 4096, 1, 4, form="xs", pin=True, programs_per_sm=5),  # likewise: 1.2-1.9x
    GemvTile(1, 8, 4096, 1, 4),  # the pinned candidate's schedule left to ptxas: 80 registers
    GemvTile(1, 8, 4096, 1, 4, form="xs", programs_per_sm=8),  # 72 registers, loads sunk
    GemvTile(1, 8, 4096, 1, 4, form="xs", prefetch=True, programs_per_sm=4),
    GemvTile(1, 4, 4096, 1, 4, form="xs", pin=True, programs_per_sm=8),
    GemvTile(1, 4, 4096, 1, 2, form="xs", prefetch=True, programs_per_sm=8),
    GemvTile(1, 8, 2048, 1, 2, pin=True),  # two steps at K = 4096, each issued up front
    GemvTile(1, 4, 2048, 1, 2, prefetch=True),
    GemvTile(1, 8, 1024, 1, 1, prefetch=True),  # one warp: no cross-warp reduction
    GemvTile(1, 8, 1024, 1, 1, pin=True),
    GemvTile(1, 16, 2048, 1, 2, max_registers=128),
)
HALF2_SWEEP = tuple(  # --sweep: f16x2 tiles (kernels/quant_int_half2.py) by rows, K step and warps
    Half2Tile(1, n, k, 1, w)
    for n in (1, 2, 4, 8, 16)
    for k, w in ((1024, 1), (2048, 1), (4096, 1), (2048, 2), (4096, 2), (4096, 4))
    if n * k // (32 * 32 * w) <= 16
) + tuple(  # and K split over 2-4 programs
    Half2Tile(1, n, k, 1, 1, split_k=split) for n in (1, 2, 4) for k in (1024, 2048) for split in (2, 4)
)
FORMS = ("int", "vec", "xs", "magic", "half2", "ready")
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


def family(tile) -> str:
    """The kernel family of a tile: "magic", a GemvTile's form, else "int" (kernels/quant_int.py)."""
    if isinstance(tile, MagicTile):
        return "magic"
    if isinstance(tile, Half2Tile):
        return "half2"
    return tile.form if isinstance(tile, GemvTile) else "int"


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
    parser.add_argument("--sweep", action="store_true", help="also time the SWEEP and GEMV_SWEEP tiles")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"families to time, of {','.join(FORMS)}")
    parser.add_argument("--shapes", default=None, help="shapes to time (default: all)")
    args = parser.parse_args(argv)
    forms = set(args.forms.split(","))
    if not forms <= set(FORMS):
        parser.error(f"--forms takes {','.join(FORMS)}; got {args.forms}")
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        copy_tbps = 1.0
    elif args.copy_tbps is not None:
        copy_tbps = args.copy_tbps
    else:
        from roofline import copy_tbps as measure

        copy_tbps = measure()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    tiles = QUANT_TILES[1]
    if args.sweep:
        tiles += tuple(t for t in SWEEP + GEMV_SWEEP + HALF2_SWEEP if t not in QUANT_TILES[1])
    cases = [(t, family(t)) for t in tiles if family(t) in forms]
    if "ready" in forms:  # the f16x2 tiles again, on x converted once beforehand (Half2X)
        cases += [(t, "ready") for t in tiles if isinstance(t, Half2Tile)]
    print(
        f"INT4 group {GROUP}, 1 row, bf16 x; copy bandwidth {copy_tbps:.2f} TB/s" + (" (smoke)" * args.smoke)
    )
    header = ("shape", "N x K", "kernel", "us", "GB/s", "of copy", "max_abs_err", "rel")
    print("{:8} {:>13} {:38} {:>8} {:>7} {:>8} {:>12} {:>8}".format(*header))
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
        made = quant_int_half2.half2_x(x)
        for tile, form in cases:
            calls = [
                lambda p=p, s=s, x=x, tile=tile: quant_int.int_linear_triton(
                    x, p, s, None, 4, GROUP, tile=tile
                )
                for p, s in layers
            ]
            if form == "ready":
                calls = [
                    lambda p=p, s=s, tile=tile, made=made: quant_int_half2.half2_int4_gemv(
                        made, p, s, None, GROUP, tile=tile
                    )
                    for p, s in layers
                ]
            out = calls[0]()
            err = (out.float() - reference).abs().max().item()
            rel = err / reference.abs().max().item()
            us = time_us(calls, args.smoke)
            label = tile.label() + " on Half2X" * (form == "ready")
            gbps = call_bytes / us / 1e3
            best[form] = min(best.get(form, (float("inf"), "")), (us, label))
            kernel = form if form in ("magic", "half2", "ready") else "gemv"
            row = dict(shape=name, N=num_cols, K=hidden, kernel=kernel, form=form, tile=label,
                       us=round(us, 2),
                       candidate=tile in QUANT_TILES[1],
                       GBps=round(gbps, 1), of_copy=round(gbps / (copy_tbps * 1e3), 3),
                       max_abs_err=err, rel_err=rel)  # fmt: skip
            rows.append(row)
            print(f"{name:8} {num_cols:>5} x {hidden:<5} {label:38} {us:8.2f} {gbps:7.0f} "
                  f"{gbps / (copy_tbps * 1e3):8.1%} {err:12.3e} {rel:8.1e}", flush=True)  # fmt: skip
        if best:
            ranked = sorted(best.items(), key=lambda b: b[1])
            print(f"{name:8} best: " + ", ".join(f"{form} {tile} {us:.2f} us" for form, (us, tile) in ranked))
    producers = time_producers(device, args.smoke) if "ready" in forms else {}
    for what, us in producers.items():
        print(f"producer {what}: {us:.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_tbps=copy_tbps, rows=rows, producers=producers), f, indent=1)
    return 0


def time_producers(device: str, smoke: bool) -> dict[str, float]:
    """The kernels that make x, writing the plain row and writing Half2X instead (what taking Half2X
    adds to them, beside what the "ready" rows save): the fused add + RMSNorm at llama-3.1-8b's hidden
    size and SiLU-and-mul at its intermediate size, one row."""
    from tpfuse.kernels import activation, rmsnorm

    hidden, inter = (256, 384) if smoke else (4096, 14336)
    gen = torch.Generator(device).manual_seed(7)
    x, residual = (torch.randn(1, hidden, generator=gen, device=device).bfloat16() for _ in range(2))
    weight = torch.rand(hidden, generator=gen, device=device).bfloat16()
    gate_up = torch.randn(1, 2 * inter, generator=gen, device=device).bfloat16()
    cases = {
        "add + RMSNorm, plain row": lambda: rmsnorm.fused_add_rmsnorm_triton(x, residual, weight, 1e-5),
        "add + RMSNorm, Half2X": lambda: rmsnorm.fused_add_rmsnorm_half2x_triton(x, residual, weight, 1e-5),
        "SiLU-and-mul, plain row": lambda: activation.silu_and_mul_triton(gate_up),
        "SiLU-and-mul, Half2X": lambda: activation.silu_and_mul_half2x_triton(gate_up),
    }
    return {what: round(time_us([call], smoke), 2) for what, call in cases.items()}


if __name__ == "__main__":
    sys.exit(main())
