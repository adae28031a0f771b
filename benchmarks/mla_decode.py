"""MLA decode attention (kernels/mla_decode.py) on one GPU, at DeepSeek-V3 shapes (kv_lora_rank 512 +
rope 64, bf16, block 16), judged against whichever ceiling bounds it.

Per call: bytes = batch * context * 576 * 2 (latent rows, each read once), FLOP = batch * heads *
context * 2 * (576 + 512) (scores and P @ c). Their times at the measured copy bandwidth (eager 1 GiB
device copy, read + write) and matmul rate (bf16 8192^3 torch.matmul on random data) give two floors;
the larger names the regime (`mem` or `mma`) and `of_bound` is that floor over the measured time.
At 128 heads (TP 1) a latent byte feeds ~240 FLOP, above the H200's balance, so large batches are
compute-bound; at 16 (TP 8) and 32 (TP 4) heads every case is memory-bound.

Each case is timed by CUDA-graph replay (gpu_timing.graph_us) round-robin over enough separate caches
("layers") to exceed the L2, as 61 layers' caches do; `new` is the shipped decode kernel and split
rule, `alt` the other candidate tile (ALT_TILES) under the same split rule, `old` the generic MLA
attention kernel at q_len 1 as decode launched it before (old_decode)
(mla_attention.py, still the prefill / verify path), timed on the same inputs.

Usage (device machine, repo root): python benchmarks/mla_decode.py [--quick] [--no-old] [--sweep]
[--sweep-cases 16x64x32768,...] [--heads 16,32,128] (the table's head counts). --sweep times
candidate tiles and split targets at six cases (or the given heads x batch x context) instead of the
table. JSON rows go to
$OUT/mla_decode.json (or mla_decode_sweep.json) when $OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import copy_tbps  # noqa: E402
from tpfuse import gpu_timing  # noqa: E402
from tpfuse.kernels import mla_decode  # noqa: E402
from tpfuse.kernels.mla_attention import mla_attention_launch  # noqa: E402
from tpfuse.kernels.paged_attention_common import choose_num_splits  # noqa: E402

RANK, ROPE, BLOCK = 512, 64, 16
ROW_BYTES = (RANK + ROPE) * 2
L2_DEFEAT_BYTES = 192 << 20
graph_us = functools.partial(gpu_timing.graph_us, min_launches=16, replays=3, samples=3)


def matmul_tflops(n: int = 8192, iters: int = 10) -> float:
    """bf16 n^3 torch.matmul on random data, TFLOP/s."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        torch.matmul(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        torch.matmul(a, b)
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (start.elapsed_time(end) * 1e-3) / 1e12


def make_case(batch: int, context: int, heads: int):
    """(layers of (cache, tables), seq_lens, q_latent, q_rope): random caches with shuffled blocks."""
    blocks = batch * context // BLOCK
    copies = max(1, -(-L2_DEFEAT_BYTES // (blocks * BLOCK * ROW_BYTES)))
    layers = []
    for _ in range(min(copies, 16)):
        cache = torch.randn(blocks, BLOCK, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, context // BLOCK)
        layers.append((cache, tables))
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q_lat = torch.randn(batch, heads, RANK, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(batch, heads, ROPE, device="cuda", dtype=torch.bfloat16)
    return layers, lens, q_lat, q_rope


def old_decode(q_lat, q_rope, cache, tables, lens, scale):
    """The generic kernel as decode ran it before mla_decode.py had a kernel of its own: all heads up
    to 32 per program (16 at most 16 heads), 32 keys per tile, decode_attention's split rule."""
    block_m = max(16, min(triton.next_power_of_2(q_lat.shape[1]), 32))
    splits = choose_num_splits(q_lat.shape[0], triton.cdiv(q_lat.shape[1], block_m), tables.shape[1], BLOCK,
                               q_lat.device)  # fmt: skip
    return mla_attention_launch(q_lat, q_rope, cache, tables, lens, None, 1, scale, splits, block_m, 32, 4, 2)


def time_new(case, tile=None, programs_per_sm=None) -> tuple[float, int]:
    layers, lens, q_lat, q_rope = case
    batch, heads = q_lat.shape[:2]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if tile is None and programs_per_sm is None:
        splits = mla_decode.mla_decode_num_splits(batch, heads, layers[0][1].shape[1], BLOCK, q_lat.device)
    else:
        splits = mla_decode.mla_decode_splits_for(batch, heads, layers[0][1].shape[1], BLOCK, sms,
                                                  programs_per_sm, tile)  # fmt: skip
    calls = [
        functools.partial(
            mla_decode.mla_decode_launch, q_lat, q_rope, cache, tables, lens, 0.07, splits, tile
        )
        for cache, tables in layers
    ]
    return graph_us(calls), splits


def time_old(case) -> float:
    layers, lens, q_lat, q_rope = case
    return graph_us([functools.partial(old_decode, q_lat, q_rope, c, t, lens, 0.07) for c, t in layers])


def check(case) -> float:
    """Relative error of the new kernel against the float64 reference on the first sequence."""
    layers, lens, q_lat, q_rope = case
    cache, tables = layers[0]
    out = mla_decode.mla_decode_triton(q_lat, q_rope, cache, tables, lens, 0.07)[:1].double()
    ref = mla_decode.mla_decode_ref(q_lat[:1].double(), q_rope[:1].double(), cache.double(), tables[:1],
                                    lens[:1], 0.07)  # fmt: skip
    return float((out - ref).norm() / ref.norm())


def bounds(batch, heads, context, copy_bw, mm_rate):
    nbytes = batch * context * ROW_BYTES
    flops = batch * heads * context * 2 * (RANK + ROPE + RANK)
    mem_us, mma_us = nbytes / copy_bw / 1e6, flops / mm_rate / 1e6
    return nbytes, flops, ("mem", mem_us) if mem_us >= mma_us else ("mma", mma_us)


SWEEP_TILES = {
    16: [(16, 64, 4, 3, True), (16, 64, 4, 2, True), (16, 32, 4, 2, False), (16, 32, 4, 3, False),
         (16, 64, 4, 2, False), (16, 32, 8, 2, False), (16, 64, 8, 2, False), (16, 16, 4, 4, False)],
    32: [(32, 64, 4, 3, True), (32, 64, 4, 2, True), (32, 32, 4, 2, False), (32, 64, 4, 2, False)],
    128: [(64, 64, 8, 2, False), (64, 64, 8, 3, False), (64, 32, 8, 2, False)],
}
# The other tile the table times beside the shipped one (mla_decode.mla_decode_tile), per head count.
ALT_TILES = {16: (16, 64, 4, 3, True), 32: (32, 64, 8, 3, True), 128: (64, 64, 8, 3, False)}
SWEEP_CASES = [
    (128, 64, 4096),
    (16, 1, 32768),
    (16, 64, 4096),
    (128, 1, 32768),
    (32, 8, 16384),
    (16, 1, 4096),
]


def sweep(copy_bw, mm_rate, dump, cases=SWEEP_CASES) -> None:
    """Each (heads, batch, context) case: the old kernel, every candidate tile at its programs per SM,
    then the best tile at 1, 2, 4 and 8; rows are dumped after every case (a run cut short keeps what
    it measured)."""
    rows = []
    for heads, batch, context in cases:
        case = make_case(batch, context, heads)
        _, _, (regime, floor_us) = bounds(batch, heads, context, copy_bw, mm_rate)
        old = time_old(case)
        print(
            f"H{heads} B{batch} ctx{context} {regime} floor {floor_us:.1f} us, old {old:.1f} us", flush=True
        )
        results = []
        for tile, per_sm in [(t, None) for t in SWEEP_TILES[heads]] + [(None, p) for p in (1, 2, 4, 8)]:
            tile = tile or min(results)[1]
            try:
                us, splits = time_new(case, tile, per_sm)
            except Exception as exc:  # out of shared memory or registers: reported, not fatal
                print(f"  {tile}: {type(exc).__name__} {str(exc)[:100]}", flush=True)
                continue
            results.append((us, tile))
            row = dict(heads=heads, batch=batch, context=context, tile=tile, per_sm=per_sm, splits=splits)
            rows.append(dict(row, us=round(us, 2), of_bound=round(floor_us / us, 3), old_us=round(old, 2)))
            print(f"  {tile} per_sm {per_sm} splits {splits}: {us:.1f} us ({floor_us / us:.1%})", flush=True)
        dump(rows)
        del case
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="batch 1 and 64, context 4k and 32k only")
    parser.add_argument("--no-old", action="store_true", help="skip the generic kernel's times")
    parser.add_argument("--heads", default="16,32,128", help="head counts of the table, comma-separated")
    parser.add_argument("--sweep", action="store_true", help="candidate tiles and split targets instead")
    parser.add_argument(
        "--sweep-cases", default=None,
        help="with --sweep: HEADSxBATCHxCONTEXT cases, comma-separated (e.g. 16x64x32768), instead of six",
    )  # fmt: skip
    args = parser.parse_args()
    copy_bw, mm_rate = copy_tbps(), matmul_tflops()
    print(
        f"copy bandwidth (eager 1 GiB, read + write): {copy_bw:.3f} TB/s; bf16 matmul {mm_rate:.0f} TFLOP/s; "
        f"balance {mm_rate / copy_bw:.0f} FLOP/byte",
        flush=True,
    )
    out_dir = os.environ.get("OUT")

    def dump(rows, name="mla_decode.json"):
        if out_dir:
            with open(os.path.join(out_dir, name), "w") as f:
                json.dump({"copy_TBps": copy_bw, "matmul_TFLOPs": mm_rate, "rows": rows}, f, indent=1)

    if args.sweep:
        cases = SWEEP_CASES
        if args.sweep_cases:
            cases = [tuple(int(v) for v in case.split("x")) for case in args.sweep_cases.split(",")]
        sweep(copy_bw, mm_rate, functools.partial(dump, name="mla_decode_sweep.json"), cases)
        return
    batches, contexts = (
        ([1, 64], [4096, 32768]) if args.quick else ([1, 8, 32, 64], [1024, 4096, 16384, 32768])
    )
    rows = []
    print(
        f"{'heads':>5} {'batch':>5} {'ctx':>6} {'split':>5} {'new_us':>8} {'alt_us':>8} {'old_us':>8} "
        f"{'TB/s':>5} {'TFLOP/s':>7} {'bound':>5} {'of_bound':>8} {'alt_of':>6} {'old_of':>6} {'err':>7}"
    )
    for heads in [int(h) for h in args.heads.split(",")]:
        for batch in batches:
            for context in contexts:
                case = make_case(batch, context, heads)
                nbytes, flops, (regime, floor_us) = bounds(batch, heads, context, copy_bw, mm_rate)
                us, splits = time_new(case)
                alt, _ = time_new(case, ALT_TILES[heads])
                old = float("nan") if args.no_old else time_old(case)
                err = check(case) if batch * context <= 8 * 32768 else float("nan")
                row = dict(
                    heads=heads,
                    batch=batch,
                    context=context,
                    splits=splits,
                    us=round(us, 2),
                    alt_us=round(alt, 2),
                    alt_tile=ALT_TILES[heads],
                    old_us=round(old, 2),
                    TBps=round(nbytes / us / 1e6, 3),
                    TFLOPs=round(flops / us / 1e6, 1),
                    bound=regime,
                    floor_us=round(floor_us, 2),
                    of_bound=round(floor_us / us, 3),
                    alt_of_bound=round(floor_us / alt, 3),
                    old_of_bound=round(floor_us / old, 3),
                    rel_err=err,
                )
                rows.append(row)
                print(
                    f"{heads:5d} {batch:5d} {context:6d} {splits:5d} {us:8.1f} {alt:8.1f} {old:8.1f} "
                    f"{row['TBps']:5.2f} {row['TFLOPs']:7.0f} {regime:>5} {floor_us / us:8.1%} "
                    f"{floor_us / alt:6.1%} {floor_us / old:6.1%} {err:7.1e}",
                    flush=True,
                )
                dump(rows)
                del case
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
