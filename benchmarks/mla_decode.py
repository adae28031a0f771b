"""MLA decode attention (kernels/mla_decode.py) on one GPU: latent-cache bytes read per second against
the measured copy bandwidth, at DeepSeek-V3 shapes (kv_lora_rank 512 + rope 64, bf16, block 16).

Heads 128 (TP 1) and 16 (TP 8), batch 1-64, context 1k-32k. Each case is timed by CUDA-graph replay
(gpu_timing.graph_us) round-robin over enough separate caches ("layers") to exceed the L2, as 61
layers' caches do. Bytes per call = batch * context * 576 * 2 (the latent rows each sequence reads
once); of_copy = that rate over an eager 1 GiB device copy's (read + write) rate. The shipped tile
(decode_block_m(heads), MLA_DECODE_BLOCK_N, 4 warps) is reported everywhere; a tile sweep (rows per
program, keys per tile, warps) runs while its time budget lasts, and the best tile per case is
reported beside it.

Usage (device machine, repo root): python benchmarks/mla_decode.py [--sweep-seconds 180] [--quick]
JSON rows go to $OUT/mla_decode.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

from tpfuse import gpu_timing
from tpfuse.kernels import mla_decode

RANK, ROPE, BLOCK = 512, 64, 16
ROW_BYTES = (RANK + ROPE) * 2
L2_DEFEAT_BYTES = 192 << 20
COPY_BYTES = 1 << 30
TILES = [(bm, bn, w) for bm in (16, 32, 64) for bn in (16, 32, 64) for w in (4, 8) if bm * bn <= 2048]
graph_us = functools.partial(gpu_timing.graph_us, replays=5, samples=3)


def copy_tbps(iters: int = 20) -> float:
    """Bytes read + written per second by an eager 1 GiB device copy (as benchmarks/gemv.py measures it)."""
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda")
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


def make_case(batch: int, context: int, heads: int):
    """(layers of (cache, tables), seq_lens, q_latent, q_rope): caches with shuffled blocks."""
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


def time_tile(case, tile, num_splits=None) -> float:
    layers, lens, q_lat, q_rope = case
    block_m, block_n, warps = tile
    if num_splits is None:
        num_splits = mla_decode.mla_decode_num_splits(q_lat.shape[0], q_lat.shape[1], layers[0][1].shape[1],
                                                      BLOCK, q_lat.device)  # fmt: skip
    calls = [
        functools.partial(
            mla_decode.mla_decode_launch,
            q_lat,
            q_rope,
            cache,
            tables,
            lens,
            0.07,
            num_splits,
            block_m,
            block_n,
            warps,
        )  # fmt: skip
        for cache, tables in layers
    ]
    return graph_us(calls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep-seconds", type=float, default=180.0)
    parser.add_argument("--quick", action="store_true", help="batch 1 and 64, context 4k and 32k only")
    args = parser.parse_args()
    copy_bw = copy_tbps()
    print(f"copy bandwidth (eager 1 GiB, read + write): {copy_bw:.3f} TB/s", flush=True)
    batches, contexts = (
        ([1, 64], [4096, 32768]) if args.quick else ([1, 8, 32, 64], [1024, 4096, 16384, 32768])
    )
    deadline = time.monotonic() + args.sweep_seconds
    rows = []
    print(
        f"{'heads':>5} {'batch':>5} {'ctx':>6} {'us':>9} {'TB/s':>6} {'of_copy':>7}   best tile (us, of_copy)"
    )
    for heads in (128, 16):
        for batch in batches:
            for context in contexts:
                case = make_case(batch, context, heads)
                shipped = (mla_decode.decode_block_m(heads), mla_decode.MLA_DECODE_BLOCK_N, 4)
                nbytes = batch * context * ROW_BYTES
                us = time_tile(case, shipped)
                best, best_us = shipped, us
                for tile in TILES:
                    if time.monotonic() > deadline:
                        break
                    if tile != shipped:
                        t = time_tile(case, tile)
                        if t < best_us:
                            best, best_us = tile, t
                tbps = nbytes / us / 1e6
                row = dict(heads=heads, batch=batch, context=context, us=round(us, 2), TBps=round(tbps, 3),
                           of_copy=round(tbps / copy_bw, 3), best_tile=list(best), best_us=round(best_us, 2),
                           best_of_copy=round(nbytes / best_us / 1e6 / copy_bw, 3))  # fmt: skip
                rows.append(row)
                print(f"{heads:5d} {batch:5d} {context:6d} {us:9.2f} {tbps:6.2f} {tbps / copy_bw:7.1%}   "
                      f"{best} ({best_us:.2f}, {row['best_of_copy']:.1%})", flush=True)  # fmt: skip
                del case
                torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "mla_decode.json"), "w") as f:
            json.dump({"copy_TBps": round(copy_bw, 3), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
