"""Kernel benchmarks on one GPU at llama-3.1-8b decode shapes, timed by CUDA-graph replay.

A batch-1 decode kernel runs for a few microseconds, less than a Python launch of a Triton kernel
(10-20 us), so do_bench would time the launch. Here each case is captured back to back in one CUDA
graph (as the engine replays its decode step) and the replay time is divided by the launches; the
gap between kernels in a graph is included, as it is in a real step. Decode attention cycles over
enough KV caches to exceed the L2, as 32 layers' caches do.

Sections: (1) per-op table at batch 1, 8, 64 and context 1024, 4096, with old vs new variants;
(2) the decode split sweep (best split count per shape vs the rule); (3) the small ops of one
batch-1 decode step (32 layers), before vs after this round's changes. `--prefill` adds prefill
attention vs SDPA (do_bench); `--verify` (or `--verify-only`) verify-pass attention (k + 1 queries per
sequence) against the K/V bytes it reads. `--decode-attention-only 256x1280,416x1280` runs section (2) alone
at those batch x context shapes, also at key tiles of 32 and 128. `--mixed-attention-only`: a mixed step's
attention, decode rows in the prefill kernel against the split of model/attention.mixed_attention.

Usage (device machine, repo root): python benchmarks/kernels.py [--prefill]   # JSON to $OUT if set
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

from tpfuse.gpu_timing import graph_us
from tpfuse.kernels.activation import silu_and_mul_launch, silu_and_mul_triton
from tpfuse.kernels.decode_attention import decode_attention_launch
from tpfuse.kernels.kv_store import store_kv_triton
from tpfuse.kernels.paged_attention_common import DECODE_BLOCK_N, choose_num_splits
from tpfuse.kernels.rmsnorm import fused_add_rmsnorm_launch, rmsnorm_row
from tpfuse.kernels.rope import rope_cos_sin_cache, rope_triton
from tpfuse.kernels.rope_store_kv import rope_store_kv_triton
from tpfuse.kernels.sampling import sample_triton

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB, BLOCK, LAYERS = 4096, 14336, 32, 8, 128, 128256, 16, 32
DTYPE = torch.bfloat16
BATCHES, CONTEXTS = (1, 8, 64), (1024, 4096)
TABLE_WIDTH = 8192 // BLOCK  # block-table width of a max_model_len 8192 engine: fixes the split count
SCALE, EPS = HEAD_DIM**-0.5, 1e-5
L2_DEFEAT_BYTES = 192 << 20  # H200 L2 is 60 MB
DEVICE = "cuda"  # tests/kernels/test_kernels_benchmark.py runs this file on CPU at tiny shapes
ROWS: list[dict] = []
MIXED_SHAPES = ((64, 1280, 512), (256, 1280, 512), (256, 1280, 2048), (416, 1280, 512))  # decodes, ctx, chunk
VERIFY_SHAPES = ((1, 4, 1024), (32, 4, 512), (128, 2, 512), (128, 4, 512))  # (batch, k + 1, context)


def record(op: str, shape: str, us: float, nbytes: float | None = None, **extra) -> None:
    row = {"op": op, "shape": shape, "us": round(us, 2), **extra}
    bw = ""
    if nbytes is not None:
        row["GB/s"] = round(nbytes / us / 1e3)
        bw = f"{row['GB/s']:7d} GB/s"
    ROWS.append(row)
    note = " ".join(f"{k}={v}" for k, v in extra.items())
    print(f"{op:50s} {shape:22s} {us:8.2f} us {bw:>12s}  {note}", flush=True)


@triton.jit
def _fused_add_rmsnorm_weight_late_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, stride, hidden, eps, BLOCK_H: tl.constexpr
):  # fmt: skip
    """The fused_add_rmsnorm kernel before this round: the weight is loaded after the reduction."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(new_res_ptr.dtype.element_ty)
    tl.store(new_res_ptr + row * stride + cols, s, mask=mask)
    y = rmsnorm_row(s.to(tl.float32), w_ptr, cols, mask, hidden, eps)
    tl.store(out_ptr + row * stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def old_fused_add_rmsnorm(x, residual, weight, eps):
    out, new_residual = torch.empty_like(x), torch.empty_like(x)
    _fused_add_rmsnorm_weight_late_kernel[(x.shape[0],)](
        x,
        residual,
        weight,
        out,
        new_residual,
        x.stride(0),
        x.shape[1],
        eps,
        BLOCK_H=triton.next_power_of_2(x.shape[1]),
        num_warps=8,
    )
    return out, new_residual


def old_num_splits(batch: int, max_blocks: int) -> int:
    """The split rule before this round: ceil(4 programs per SM), at most 32."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 8
    max_tiles = triton.cdiv(max_blocks * BLOCK, DECODE_BLOCK_N)
    return max(1, min(triton.cdiv(4 * sms, batch * KV_HEADS), max_tiles, 32))


def _randn(*shape, dtype=DTYPE):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def _qkv_views(batch: int):
    """q [B, Hq, D], k and v [B, Hk, D]: views of one fused qkv output, as the attention layer has."""
    qkv = _randn(batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    parts = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return tuple(t.view(batch, -1, HEAD_DIM) for t in parts)


class DecodeAttentionCase:
    """B sequences of one context length, TABLE_WIDTH-wide block tables, enough KV copies to defeat L2."""

    def __init__(self, batch: int, context: int, copies: int | None = None):
        blocks = batch * triton.cdiv(context, BLOCK)
        per_copy = 2 * blocks * BLOCK * KV_HEADS * HEAD_DIM * 2
        copies = copies or max(1, min(48, L2_DEFEAT_BYTES // per_copy))
        self.copies = [
            (_randn(blocks, BLOCK, KV_HEADS, HEAD_DIM), _randn(blocks, BLOCK, KV_HEADS, HEAD_DIM))
            for _ in range(copies)
        ]
        self.tables = torch.zeros(batch, TABLE_WIDTH, device=DEVICE, dtype=torch.int32)
        used = torch.randperm(blocks, device=DEVICE, dtype=torch.int32).view(batch, -1)
        self.tables[:, : used.shape[1]] = used
        self.lens = torch.full((batch,), context, device=DEVICE, dtype=torch.int32)
        self.q = _randn(batch, HEADS, HEAD_DIM)
        self.kv_bytes = per_copy

    def calls(self, splits: int, merge_in_kernel: bool = False, block_n: int = DECODE_BLOCK_N):
        return [
            lambda kc=kc, vc=vc: decode_attention_launch(
                self.q,
                kc,
                vc,
                self.tables,
                self.lens,
                SCALE,
                splits,
                block_n,
                merge_in_kernel=merge_in_kernel,
            )
            for kc, vc in self.copies
        ]


def bench_small_ops(batch: int) -> None:
    e = 2
    x, res, w = _randn(batch, HIDDEN), _randn(batch, HIDDEN), _randn(HIDDEN)
    nbytes = (4 * batch + 1) * HIDDEN * e
    shape = f"B={batch} H={HIDDEN}"
    old = graph_us([lambda: old_fused_add_rmsnorm(x, res, w, EPS)])
    record("fused_add_rmsnorm OLD (w late)", shape, old, nbytes, warps=8)
    for warps in (4, 8, 16):
        us = graph_us([lambda warps=warps: fused_add_rmsnorm_launch(x, res, w, EPS, num_warps=warps)])
        record("fused_add_rmsnorm", shape, us, nbytes, warps=warps)
    gate_up = _randn(batch, 2 * INTER)
    for tile, warps in ((512, 2), (1024, 4), (2048, 8), (4096, 8)):
        us = graph_us([lambda tile=tile, warps=warps: silu_and_mul_launch(gate_up, tile, warps)])
        record("silu_and_mul", f"B={batch} I={INTER}", us, 3 * batch * INTER * e, tile=tile, warps=warps)
    cos_sin = rope_cos_sin_cache(HEAD_DIM, 131072, 500000.0).to(DEVICE)
    q, k, v = _qkv_views(batch)
    kc, vc = _randn(4096, BLOCK, KV_HEADS, HEAD_DIM), _randn(4096, BLOCK, KV_HEADS, HEAD_DIM)
    pos = torch.randint(0, 8192, (batch,), device=DEVICE)
    slots = torch.randperm(4096 * BLOCK, device=DEVICE)[:batch]
    shape = f"B={batch} {HEADS}/{KV_HEADS}x{HEAD_DIM}"
    rope_us = graph_us([lambda: rope_triton(pos, q, k, cos_sin)])
    store_us = graph_us([lambda: store_kv_triton(k, v, kc, vc, slots)])
    both_us = graph_us([lambda: (rope_triton(pos, q, k, cos_sin), store_kv_triton(k, v, kc, vc, slots))])
    fused_us = graph_us([lambda: rope_store_kv_triton(pos, q, k, v, cos_sin, kc, vc, slots)])
    record("rope OLD", shape, rope_us)
    record("store_kv OLD", shape, store_us)
    record("rope + store_kv OLD (2 launches)", shape, both_us)
    record("rope_store_kv (fused)", shape, fused_us, saved_us=round(both_us - fused_us, 2))
    logits = torch.randn(batch, VOCAB, device=DEVICE)
    temps, seeds = torch.ones(batch, device=DEVICE), torch.arange(batch, device=DEVICE)
    no_k, no_p = torch.zeros(batch, dtype=torch.int64, device=DEVICE), torch.ones(batch, device=DEVICE)
    for name, t in (("sample greedy", temps * 0), ("sample T=1", temps)):
        us = graph_us([lambda t=t: sample_triton(logits, t, no_k, no_p, seeds)], min_launches=16)
        record(name, f"B={batch} V={VOCAB}", us, batch * VOCAB * 4)


def bench_decode_attention(batch: int, context: int, sweep: bool, block_ns: tuple[int, ...] = ()) -> None:
    """The split rule against the old rule (and every split count with sweep), the last-split merge,
    SDPA; block_ns: also the rule's split count at each of these key tiles."""
    case = DecodeAttentionCase(batch, context)
    shape = f"B={batch} ctx={context}"
    new = choose_num_splits(batch, KV_HEADS, TABLE_WIDTH, BLOCK, case.q.device)
    old = old_num_splits(batch, TABLE_WIDTH)
    times = {}
    launches = 8 if case.kv_bytes > (256 << 20) else 64  # a long launch needs fewer repeats
    for splits in sorted({1, 2, 4, 8, 16, 32, new, old} if sweep else {new, old}):
        times[splits] = graph_us(case.calls(splits), min_launches=launches)
    record("decode_attention OLD rule", shape, times[old], case.kv_bytes, splits=old)
    best = min(times, key=times.get)
    record("decode_attention", shape, times[new], case.kv_bytes, splits=new, best_splits=best,
           best_us=round(times[best], 2), sweep={s: round(t, 1) for s, t in times.items()})  # fmt: skip
    for splits in sorted({new, best} - {1}):
        us = graph_us(case.calls(splits, merge_in_kernel=True), min_launches=launches)
        record("decode_attention last split merges", shape, us, case.kv_bytes, splits=splits,
               vs_merge_launch_us=round(us - times[splits], 2))  # fmt: skip
    for block_n in (n for n in block_ns if n != DECODE_BLOCK_N):
        us = graph_us(case.calls(new, block_n=block_n), min_launches=launches)
        record(f"decode_attention keys {block_n} a tile", shape, us, case.kv_bytes, splits=new)
    kc, vc = case.copies[0]
    used = case.tables[:, : triton.cdiv(context, BLOCK)].long()
    k, v = (c[used].flatten(1, 2).transpose(1, 2).contiguous() for c in (kc, vc))  # [B, Hk, ctx, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    us = graph_us([lambda: sdpa(case.q[:, :, None], k, v, scale=SCALE, enable_gqa=True)])
    record("sdpa (contiguous K/V, L2-warm)", shape, us, case.kv_bytes)


def bench_mixed_attention(decodes: int, context: int, chunk: int) -> None:
    """A mixed step's attention: `decodes` one-token rows at `context` keys and one prompt chunk of
    `chunk` tokens at the end of a `context`-token prompt, all rows by the prefill kernel against
    model/attention.mixed_attention (decode kernel, then the prefill kernel for the chunk)."""
    from tpfuse.kernels.prefill_attention import prefill_attention_triton
    from tpfuse.model.attention import AttentionMetadata, mixed_attention

    per_seq = triton.cdiv(context, BLOCK)
    blocks = (decodes + 1) * per_seq
    kc, vc = _randn(blocks, BLOCK, KV_HEADS, HEAD_DIM), _randn(blocks, BLOCK, KV_HEADS, HEAD_DIM)
    tables = torch.randperm(blocks, device=DEVICE, dtype=torch.int32).view(decodes + 1, per_seq)
    lens = torch.full((decodes + 1,), context, device=DEVICE, dtype=torch.int32)
    q_lens = [1] * decodes + [chunk]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], device=DEVICE, dtype=torch.int32)
    q = _randn(decodes + chunk, HEADS, HEAD_DIM)
    attn = AttentionMetadata(
        torch.empty(0), tables, lens, starts, chunk, context, False, num_decode_rows=decodes
    )
    kv_bytes = 2 * (decodes + 1) * context * KV_HEADS * HEAD_DIM * 2
    shape = f"{decodes} decodes + {chunk} ctx={context}"
    one_kernel = graph_us(
        [lambda: prefill_attention_triton(q, kc, vc, tables, lens, starts, chunk, SCALE)], 8
    )
    split = graph_us([lambda: mixed_attention(q, (kc, vc), attn, SCALE)], 8)
    record("mixed attention, every row by the prefill kernel", shape, one_kernel, kv_bytes)
    record("mixed attention, decode rows by the decode kernel", shape, split, kv_bytes,
           speedup=round(one_kernel / split, 2))  # fmt: skip


def bench_decode_step(batch: int, context: int) -> None:
    """The small ops of one decode step (32 layers): norms, rope/store, attention, silu; no GEMMs."""
    cos_sin = rope_cos_sin_cache(HEAD_DIM, 131072, 500000.0).to(DEVICE)
    x, res, gate_up = _randn(batch, HIDDEN), _randn(batch, HIDDEN), _randn(batch, 2 * INTER)
    weights = [_randn(HIDDEN) for _ in range(2 * LAYERS + 1)]
    q, k, v = _qkv_views(batch)
    layers = DecodeAttentionCase(batch, context, copies=LAYERS)  # one KV cache per layer
    pos = layers.lens.long() - 1
    slots = layers.tables[:, (context - 1) // BLOCK].long() * BLOCK + (context - 1) % BLOCK
    splits = {"before": old_num_splits(batch, TABLE_WIDTH),
              "after": choose_num_splits(batch, KV_HEADS, TABLE_WIDTH, BLOCK, x.device)}  # fmt: skip

    def step(version: str):
        norm = old_fused_add_rmsnorm if version == "before" else fused_add_rmsnorm_launch
        num_splits = splits["before" if version == "before" else "after"]
        for layer, (kc, vc) in enumerate(layers.copies):
            norm(x, res, weights[2 * layer], EPS)
            if version == "before":
                rope_triton(pos, q, k, cos_sin)
                store_kv_triton(k, v, kc, vc, slots)
            else:
                rope_store_kv_triton(pos, q, k, v, cos_sin, kc, vc, slots)
            decode_attention_launch(q, kc, vc, layers.tables, layers.lens, SCALE, num_splits,
                                    merge_in_kernel=version == "after, last split merges")  # fmt: skip
            norm(x, res, weights[2 * layer + 1], EPS)
            silu_and_mul_triton(gate_up)
        norm(x, res, weights[-1], EPS)

    shape = f"B={batch} ctx={context} x{LAYERS}"
    before = graph_us([lambda: step("before")], min_launches=1)
    record("SMALL OPS PER DECODE STEP before", shape, before, splits=splits["before"])
    for version in ("after", "after, last split merges"):
        us = graph_us([lambda version=version: step(version)], min_launches=1)
        record(f"SMALL OPS PER DECODE STEP {version}", shape, us, splits=splits["after"],
               saved_us=round(before - us, 1), of_4596us_step=f"{(before - us) / 4596:.1%}")  # fmt: skip


def bench_prefill(num_seqs: int, length: int) -> None:
    """Prefill attention vs SDPA (causal, contiguous K/V) with do_bench: long kernels, no graph needed."""
    from triton.testing import do_bench

    from tpfuse.kernels.prefill_attention import prefill_attention_triton

    blocks = num_seqs * length // BLOCK
    kc, vc = _randn(blocks, BLOCK, KV_HEADS, HEAD_DIM), _randn(blocks, BLOCK, KV_HEADS, HEAD_DIM)
    tables = torch.arange(blocks, device=DEVICE, dtype=torch.int32).view(num_seqs, -1)
    lens = torch.full((num_seqs,), length, device=DEVICE, dtype=torch.int32)
    q = _randn(num_seqs * length, HEADS, HEAD_DIM)
    starts = torch.arange(num_seqs + 1, device=DEVICE, dtype=torch.int32) * length
    ms = do_bench(lambda: prefill_attention_triton(q, kc, vc, tables, lens, starts, length, SCALE))
    k, v = (c.view(num_seqs, length, KV_HEADS, HEAD_DIM).transpose(1, 2) for c in (kc, vc))
    qb = q.view(num_seqs, length, HEADS, HEAD_DIM).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = do_bench(lambda: sdpa(qb, k, v, is_causal=True, scale=SCALE, enable_gqa=True))
    record("prefill_attention (do_bench)", f"{num_seqs}x{length}", ms * 1e3, sdpa_us=round(sdpa_ms * 1e3, 1))


def bench_verify(batch: int, q_len: int, context: int) -> None:
    """Verify-pass attention (q_len = k + 1 query tokens per sequence, prefill kernel) against the
    bytes of K/V it must read once, over enough cache copies to defeat the L2."""
    from tpfuse.kernels.prefill_attention import prefill_attention_triton

    blocks = batch * triton.cdiv(context, BLOCK)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    copies = max(1, min(16, L2_DEFEAT_BYTES // kv_bytes + 1))
    caches = [
        (_randn(blocks, BLOCK, KV_HEADS, HEAD_DIM), _randn(blocks, BLOCK, KV_HEADS, HEAD_DIM))
        for _ in range(copies)
    ]
    tables = torch.arange(blocks, device=DEVICE, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), context, device=DEVICE, dtype=torch.int32)
    starts = torch.arange(batch + 1, device=DEVICE, dtype=torch.int32) * q_len
    q = _randn(batch * q_len, HEADS, HEAD_DIM)
    calls = [lambda kc=kc, vc=vc: prefill_attention_triton(q, kc, vc, tables, lens, starts, q_len, SCALE)
             for kc, vc in caches]  # fmt: skip
    us = graph_us(calls, min_launches=32)
    record("verify attention (prefill kernel)", f"B={batch} q={q_len} ctx={context}", us, kv_bytes,
           per_32_layers_ms=round(32 * us / 1e3, 3))  # fmt: skip


def main() -> int:
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU")
        return 1
    props = torch.cuda.get_device_properties(0)
    versions = f"torch {torch.__version__} triton {triton.__version__}"
    print(f"{props.name} sms={props.multi_processor_count} {versions}")
    started = time.perf_counter()
    if "--decode-attention-only" in sys.argv:  # e.g. --decode-attention-only 256x1280,416x1280
        shapes = sys.argv[sys.argv.index("--decode-attention-only") + 1]
        for shape in shapes.split(","):
            batch, context = (int(v) for v in shape.split("x"))
            bench_decode_attention(batch, context, sweep=True, block_ns=(32, 64, 128))
        return 0
    if "--mixed-attention-only" in sys.argv:
        for decodes, context, chunk in MIXED_SHAPES:
            bench_mixed_attention(decodes, context, chunk)
        return 0
    if "--verify-only" in sys.argv:  # the verify section alone
        for batch, q_len, context in VERIFY_SHAPES:
            bench_verify(batch, q_len, context)
        return 0
    print("== per-op, CUDA-graph replay, us per launch (inter-kernel gap included)")
    for batch in BATCHES:
        bench_small_ops(batch)
    print(f"({time.perf_counter() - started:.0f} s)")
    print("== decode attention (sweep over split counts at every shape)")
    for batch in BATCHES:
        for context in CONTEXTS:
            bench_decode_attention(batch, context, sweep=True)
    print(f"({time.perf_counter() - started:.0f} s)")
    print("== small ops of one decode step, before vs after this round")
    for batch, context in ((1, 1024), (1, 4096), (8, 1024), (64, 1024)):
        bench_decode_step(batch, context)
    print(f"({time.perf_counter() - started:.0f} s)")
    if "--verify" in sys.argv:
        for batch, q_len, context in VERIFY_SHAPES:
            bench_verify(batch, q_len, context)
    if "--prefill" in sys.argv:
        for num_seqs, length in ((1, 2048), (4, 2048)):
            bench_prefill(num_seqs, length)
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
