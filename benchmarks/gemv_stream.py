"""How fast a Triton program streams packed INT4 weights ([N, K/8] int32) at one-row GEMV shapes, by
layout and tiling, with and without the arithmetic (a diagnostic for kernels/quant_int_gemv.py).

Per shape (llama-3.1-8b gate_up and down): every (layout, rows per program, words per step, warps,
pipeline stages) of a plain kernel that either XORs the words (math 0: the load stream alone) or
takes the INT4 product with x (math 1: 8 values a word, (q - 8) x in fp32 through the 2^23 float
trick, a bf16 scale per 128), timed by CUDA-graph replay over enough weight copies to defeat the L2,
against a 1 GiB device copy. Layouts: "rows" (the checkpoint's row-major words) and "tiled" (each
program's step one contiguous block). Prints the best 12 of each and the best of each layout.

    python benchmarks/gemv_stream.py        # one H200: about a minute
"""

import itertools
import statistics

import torch
import triton
import triton.language as tl

from tpfuse.gpu_timing import graph_us


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def stream_kernel(
    q_ptr,
    x_ptr,
    s_ptr,
    out_ptr,
    KW: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    STEP_STRIDE: tl.constexpr,
    PROG_STRIDE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KS: tl.constexpr,
    MATH: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, KS)
    base = q_ptr + pid * PROG_STRIDE + r[:, None] * ROW_STRIDE + c[None, :]
    if MATH:
        acc = tl.zeros([BLOCK_N, KS], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, KS], tl.int32)
    for step in tl.range(0, KW // KS, num_stages=STAGES):
        w = tl.load(base + step * STEP_STRIDE, eviction_policy="evict_first")
        if MATH:
            kw = step * KS + c  # word index along K
            s = tl.load(s_ptr + (pid * BLOCK_N + r[:, None]) * (KW // 16) + kw[None, :] // 16)
            part = tl.zeros([BLOCK_N, KS], tl.float32)
            for i in tl.static_range(8):
                xv = tl.load(x_ptr + kw * 8 + i).to(tl.float32)
                q = (((w >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                part += (q - 8388616.0) * xv[None, :]
            acc += part * s.to(tl.float32)
        else:
            acc ^= w
    if MATH:
        tl.store(out_ptr + pid * BLOCK_N + r, tl.sum(acc, 1))
    else:
        tl.store(out_ptr + pid * BLOCK_N + r, tl.reduce(acc, 1, _xor).to(tl.float32))


def copy_tbps() -> float:
    """Read + write bandwidth of a 1 GiB device copy, TB/s (median of 5)."""
    src = torch.empty(1 << 28, dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def launches(weights, scales, x, out, grid, **meta):
    """One zero-argument launch per weight copy (graph_us's round robin)."""
    return [
        lambda w=w, s=s: stream_kernel[grid](w, x, s, out, **meta)
        for w, s in zip(weights, scales, strict=True)
    ]


def variants(kw: int):
    """(math, layout, rows, words per step, warps, stages) worth timing at kw words a row."""
    for math, layout, bn, ks, warps, stages in itertools.product(
        (0, 1), ("rows", "tiled"), (2, 4, 8, 16), (128, 256, 512), (2, 4, 8), (1, 3)
    ):
        if stages == 3 and (warps != 4 or kw // ks < 3):
            continue
        if bn * ks > 8192 or bn * ks < 256 or (math and bn * ks > 4096) or kw % ks:
            continue
        yield math, layout, bn, ks, warps, stages


def main() -> None:
    bandwidth = copy_tbps()
    print(f"copy {bandwidth:.2f} TB/s")
    for name, (n, k) in {"gate_up": (28672, 4096), "down": (4096, 14336)}.items():
        kw = k // 8
        nbytes = n * kw * 4 + n * (k // 128) * 2
        copies = max(1, -(-(200 << 20) // nbytes))
        weights = [
            torch.randint(-(2**31), 2**31 - 1, (n * kw,), dtype=torch.int32, device="cuda")
            for _ in range(copies)
        ]
        scales = [torch.rand(n, k // 128, device="cuda").bfloat16() for _ in range(copies)]
        x = torch.randn(k, device="cuda").bfloat16()
        out = torch.empty(n, device="cuda")
        rows = []
        for math, layout, bn, ks, warps, stages in variants(kw):
            if layout == "rows":
                strides = dict(ROW_STRIDE=kw, STEP_STRIDE=ks, PROG_STRIDE=bn * kw)
            else:
                strides = dict(ROW_STRIDE=ks, STEP_STRIDE=bn * ks, PROG_STRIDE=bn * kw)
            calls = launches(weights, scales, x, out, (n // bn,), KW=kw, BLOCK_N=bn, KS=ks, MATH=math,
                             STAGES=stages, num_warps=warps, **strides)  # fmt: skip
            us = graph_us(calls, min_launches=32, replays=10, samples=5)
            rows.append((math, layout, bn, ks, warps, stages, us, nbytes / us / 1e6 / bandwidth))
        for math in (0, 1):
            best = sorted((r for r in rows if r[0] == math), key=lambda r: r[6])
            print(f"== {name} N={n} K={k} math={math}: best 12")
            for _, layout, bn, ks, warps, stages, us, share in best[:12]:
                print(f"  {layout:5} bn{bn:<3} ks{ks:<4} w{warps} s{stages}  {us:7.2f} us  {share:6.1%}")
            for layout in ("rows", "tiled"):
                first = next((r for r in best if r[1] == layout), None)
                if first:
                    _, _, bn, ks, warps, stages, us, share = first
                    print(f"  best {layout}: {us:.2f} us {share:.1%} (bn{bn} ks{ks} w{warps} s{stages})")


if __name__ == "__main__":
    main()
