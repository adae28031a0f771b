"""Kernel micro-benchmarks on one GPU at llama-3.1-8b decode and prefill shapes.

Times every tpfuse Triton kernel with triton.testing.do_bench (median, L2 flushed between runs),
reports achieved bytes/s against the device copy bandwidth, compares paged decode attention with
torch SDPA on already-gathered K/V, prefill attention with torch SDPA (causal), and sweeps the
decode split count so the heuristic in kernels/decode_attention.py can be checked.

Usage (device machine, repo root): python benchmarks/kernels.py   # JSON to $OUT/kernels.json if set
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
from triton.testing import do_bench

from tpfuse.kernels.activation import silu_and_mul_triton
from tpfuse.kernels.decode_attention import (
    choose_num_splits,
    decode_attention_launch,
    decode_attention_triton,
)
from tpfuse.kernels.kv_store import store_kv_triton
from tpfuse.kernels.prefill_attention import (
    prefill_attention_launch,
    prefill_attention_triton,
    prefill_tile_config,
)
from tpfuse.kernels.rmsnorm import fused_add_rmsnorm_triton, rmsnorm_triton
from tpfuse.kernels.rope import rope_cos_sin_cache, rope_triton
from tpfuse.kernels.sampling import sample_triton

COPY_BANDWIDTH = 4.25e12  # bytes/s, H200 device copy (read + write), measured 2026-11-29
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, BLOCK = 4096, 14336, 32, 8, 128, 128256, 16
DTYPE = torch.bfloat16
BATCHES = (1, 8, 64, 128)
CONTEXTS = (512, 2048, 8192)
SCALE = HEAD_DIM**-0.5
ROWS: list[dict] = []


def _ms(fn, *args, **kwargs) -> float:
    """Median milliseconds of fn(*args, **kwargs), L2 flushed between calls."""
    return do_bench(lambda: fn(*args, **kwargs), warmup=25, rep=100, return_mode="median")


def record(op: str, shape: str, ms: float, nbytes: float | None = None, flops: float | None = None, **extra):
    row = {"op": op, "shape": shape, "us": ms * 1e3, **extra}
    if nbytes is not None:
        row["GB/s"] = nbytes / (ms * 1e-3) / 1e9
        row["of_copy_bw"] = row["GB/s"] * 1e9 / COPY_BANDWIDTH
    if flops is not None:
        row["TFLOP/s"] = flops / (ms * 1e-3) / 1e12
    ROWS.append(row)
    bw = f"{row['GB/s']:8.0f} GB/s {row['of_copy_bw']:6.1%}" if nbytes is not None else " " * 22
    tf = f"{row['TFLOP/s']:7.1f} TFLOP/s" if flops is not None else ""
    note = " ".join(f"{k}={v}" for k, v in extra.items())
    print(f"{op:28s} {shape:28s} {ms * 1e3:9.1f} us {bw} {tf} {note}", flush=True)


def bench_elementwise():
    e = torch.finfo(DTYPE).bits // 8
    cache = rope_cos_sin_cache(HEAD_DIM, 131072, 500000.0).cuda()
    for t in BATCHES:
        x, r = (
            torch.randn(t, HIDDEN, device="cuda", dtype=DTYPE),
            torch.randn(t, HIDDEN, device="cuda", dtype=DTYPE),
        )
        w = torch.randn(HIDDEN, device="cuda", dtype=DTYPE)
        record("rmsnorm", f"T={t} H={HIDDEN}", _ms(rmsnorm_triton, x, w, 1e-5), (2 * t + 1) * HIDDEN * e)
        record(
            "fused_add_rmsnorm",
            f"T={t} H={HIDDEN}",
            _ms(fused_add_rmsnorm_triton, x, r, w, 1e-5),
            (4 * t + 1) * HIDDEN * e,
        )
        q = torch.randn(t, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        k = torch.randn(t, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        pos = torch.randint(0, 8192, (t,), device="cuda")
        record(
            "rope",
            f"T={t} {HEADS}/{KV_HEADS}x{HEAD_DIM}",
            _ms(rope_triton, pos, q, k, cache),
            2 * t * (HEADS + KV_HEADS) * HEAD_DIM * e + t * HEAD_DIM * 4,
        )
        gate_up = torch.randn(t, 2 * INTER, device="cuda", dtype=DTYPE)
        record("silu_and_mul", f"T={t} I={INTER}", _ms(silu_and_mul_triton, gate_up), 3 * t * INTER * e)
        kc = torch.empty(4096, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        vc = torch.empty_like(kc)
        slots = torch.randperm(4096 * BLOCK, device="cuda")[:t]
        record(
            "store_kv", f"T={t}", _ms(store_kv_triton, k, k, kc, vc, slots), 4 * t * KV_HEADS * HEAD_DIM * e
        )
        logits = torch.randn(t, VOCAB, device="cuda", dtype=torch.float32)
        temps, seeds = torch.ones(t, device="cuda"), torch.arange(t, device="cuda")
        no_k, no_p = torch.zeros(t, dtype=torch.int64, device="cuda"), torch.ones(t, device="cuda")
        record(
            "sample greedy",
            f"B={t} V={VOCAB}",
            _ms(sample_triton, logits, temps * 0, no_k, no_p, seeds),
            t * VOCAB * 4,
        )
        record(
            "sample T=1",
            f"B={t} V={VOCAB}",
            _ms(sample_triton, logits, temps, no_k, no_p, seeds),
            t * VOCAB * 4,
        )
        top_k = torch.full((t,), 50, device="cuda")
        record(
            "sample T=1 top-k50 top-p.9",
            f"B={t} V={VOCAB}",
            _ms(sample_triton, logits, temps, top_k, no_p * 0.9, seeds),
            t * VOCAB * 4,
        )


def _paged_cache(batch: int, context: int):
    blocks = triton.cdiv(context, BLOCK)
    kc = torch.randn(batch * blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    vc = torch.randn_like(kc)
    tables = torch.randperm(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return kc, vc, tables, lens


def _gathered(cache, tables, context):
    # [B, Hk, context, D]: the contiguous K or V that a gather-then-SDPA design would feed SDPA
    return cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()


def bench_decode_attention():
    e = torch.finfo(DTYPE).bits // 8
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for context in CONTEXTS:
        for batch in BATCHES:
            kc, vc, tables, lens = _paged_cache(batch, context)
            q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
            nbytes = 2 * batch * context * KV_HEADS * HEAD_DIM * e + 2 * q.numel() * e
            splits = choose_num_splits(batch, KV_HEADS, tables.shape[1], BLOCK, q.device)
            shape = f"B={batch} ctx={context}"
            ms = _ms(decode_attention_triton, q, kc, vc, tables, lens, SCALE)
            record("decode_attention", shape, ms, nbytes, splits=splits)
            k, v = _gathered(kc, tables, context), _gathered(vc, tables, context)
            q4 = q[:, :, None, :]
            sdpa_ms = _ms(sdpa, q4, k, v, scale=SCALE, enable_gqa=True)
            record(
                "sdpa decode (gathered K/V)", shape, sdpa_ms, nbytes, triton_speedup=round(sdpa_ms / ms, 2)
            )


def bench_decode_splits():
    """Best split count per shape, to check choose_num_splits."""
    for batch, context in [(1, 2048), (1, 8192), (8, 8192), (64, 2048), (64, 8192)]:
        kc, vc, tables, lens = _paged_cache(batch, context)
        q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        times = {}
        for splits in (1, 2, 4, 8, 16, 32, 64):
            for block_n in (32, 64):
                times[(splits, block_n)] = _ms(
                    decode_attention_launch, q, kc, vc, tables, lens, SCALE, splits, block_n
                )
        best = min(times, key=times.get)
        chosen = choose_num_splits(batch, KV_HEADS, tables.shape[1], BLOCK, q.device)
        chosen_ms = _ms(decode_attention_triton, q, kc, vc, tables, lens, SCALE)
        shape = f"B={batch} ctx={context}"
        extra = {"best_splits": best[0], "best_block_n": best[1], "chosen_splits": chosen}
        record("decode split sweep", shape, times[best], chosen_us=round(chosen_ms * 1e3, 1), **extra)


def bench_prefill_attention():
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for num_seqs in (1, 4):
        for length in (512, 2048):
            kc, vc, tables, lens = _paged_cache(num_seqs, length)
            q = torch.randn(num_seqs * length, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
            starts = torch.arange(num_seqs + 1, device="cuda", dtype=torch.int32) * length
            flops = 4 * num_seqs * HEADS * HEAD_DIM * length * length / 2
            shape = f"{num_seqs}x{length}"
            ms = _ms(prefill_attention_triton, q, kc, vc, tables, lens, starts, length, SCALE)
            record("prefill_attention", shape, ms, flops=flops)
            k, v = _gathered(kc, tables, length), _gathered(vc, tables, length)
            qb = q.view(num_seqs, length, HEADS, HEAD_DIM).transpose(1, 2)
            sdpa_ms = _ms(sdpa, qb, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
            record(
                "sdpa causal (contiguous)", shape, sdpa_ms, flops=flops, triton_speedup=round(sdpa_ms / ms, 2)
            )


def bench_prefill_tiles():
    """Prefill tile configs at 4 x 2048, to check prefill_tile_config."""
    num_seqs, length = 4, 2048
    kc, vc, tables, lens = _paged_cache(num_seqs, length)
    q = torch.randn(num_seqs * length, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    starts = torch.arange(num_seqs + 1, device="cuda", dtype=torch.int32) * length
    flops = 4 * num_seqs * HEADS * HEAD_DIM * length * length / 2
    chosen = prefill_tile_config(length, HEAD_DIM)
    for config in [
        (64, 64, 4, 2),
        (64, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 2),
        (128, 32, 4, 3),
    ]:
        try:
            ms = _ms(prefill_attention_launch, q, kc, vc, tables, lens, starts, length, SCALE, *config)
        except Exception as error:  # a config that does not fit the GPU is reported, not fatal
            print(f"prefill tiles {config}: {type(error).__name__}: {error}")
            continue
        record(
            "prefill tile sweep", f"{num_seqs}x{length} {config}", ms, flops=flops, chosen=config == chosen
        )


def main() -> int:
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU")
        return 1
    props = torch.cuda.get_device_properties(0)
    versions = f"torch {torch.__version__} triton {triton.__version__}"
    print(f"{props.name} sms={props.multi_processor_count} {versions}")
    print(f"{'op':28s} {'shape':28s} {'median':>12s} {'achieved':>13s} {'of copy':>7s}")
    bench_elementwise()
    bench_decode_attention()
    bench_prefill_attention()
    bench_decode_splits()
    bench_prefill_tiles()
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        meta = {"gpu": props.name, "torch": torch.__version__, "triton": triton.__version__}
        with open(os.path.join(out, "kernels.json"), "w") as f:
            json.dump({"meta": meta, "rows": ROWS}, f, indent=1)
        print(f"wrote {out}/kernels.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
