"""A chain of one-row bf16 GEMVs (48 layers, each its own square weight, past the L2) in one CUDA
graph: plain launches against programmatic dependent launch (kernels/pdl.py's pattern: the next GEMV
loads its weights, then waits; "early": each program also calls launch_dependents at its start), also
with a one-program RMS-scale kernel between the GEMVs; every chain's result compared to the plain one.

    python benchmarks/pdl_chain.py          # one H200: a few seconds
"""

import sys

import torch
import triton
import triton.language as tl

from tpfuse.gpu_timing import graph_us

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    print("gdc available in triton", triton.__version__)
except Exception as e:  # noqa: BLE001
    print("no gdc:", e)
    sys.exit(0)


@triton.jit
def gemv(x_ptr, w_ptr, out_ptr, K: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    w = tl.load(w_ptr + rows[:, None] * K + tl.arange(0, K)[None, :], eviction_policy="evict_first")
    if PDL:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
    x = tl.load(x_ptr + tl.arange(0, K)).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], 1)
    tl.store(out_ptr + rows, (acc * 0.03).to(tl.bfloat16))


@triton.jit
def scale(x_ptr, out_ptr, N: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs).to(tl.float32)
    tl.store(out_ptr + offs, (x * tl.rsqrt(tl.sum(x * x) / N + 1e-6)).to(tl.bfloat16))


def chain(ws, x0, bufs, n: int, bn: int, pdl: int, early: int, norm: int):
    """The 48 GEMVs (and RMS scales) in order; three buffers, so no kernel writes what it reads."""
    x = x0
    launch = dict(num_warps=4, launch_pdl=bool(pdl))
    for i, w in enumerate(ws):
        out = bufs[(2 * i) % 3]
        gemv[(n // bn,)](x, w, out, K=n, BN=bn, PDL=pdl, EARLY=early, **launch)
        x = out
        if norm:
            other = bufs[(2 * i + 1) % 3]
            scale[(1,)](x, other, N=n, PDL=pdl, **launch)
            x = other
    return x


def main() -> None:
    layers, bn = 48, 4
    for n in (2048, 4096):
        ws = [torch.randn(n, n, device="cuda").bfloat16() for _ in range(layers)]
        x0 = torch.randn(n, device="cuda").bfloat16()
        bufs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        for norm in (0, 1):
            results = {}
            for pdl, early in ((0, 0), (1, 0), (1, 1)):
                args = (ws, x0, bufs, n, bn, pdl, early, norm)
                got = chain(*args).clone()
                us = graph_us([lambda args=args: chain(*args)], min_launches=8, replays=10, samples=7)
                results[(pdl, early)] = got
                print(f"n={n} norm={norm} pdl={pdl} early={early}: {us:8.1f} us per chain, "
                      f"{us / layers:6.2f} us per layer")  # fmt: skip
            plain = results[(0, 0)]
            print("   equal to plain:", {key: torch.equal(got, plain) for key, got in results.items()})


if __name__ == "__main__":
    main()
