"""Top-p sampling at a 128k vocabulary: the per-row cut (kernels/sampling_cut.py, radix select, no
sort) against the sort the sampler used before (apply_top_k_top_p), and the whole sampler on the cut
path and unfiltered, all timed by CUDA-graph replay (gpu_timing.graph_us); plus a check of the cut's
kept sets against a float64 sort on the GPU: each must hold the float64 set at top_p - eps and lie
in the one at top_p + eps (both closed under ties), the float32 error of the mass.

Usage (device machine, repo root): python benchmarks/top_p_sampling.py [--vocab 128256] [--rows 1,8,64]
    [--top-k 0] [--top-p 0.95] [--eps 1e-5]
"""

from __future__ import annotations

import argparse

import torch

from tpfuse.gpu_timing import graph_us
from tpfuse.kernels.sampling import apply_top_k_top_p, sample_triton
from tpfuse.kernels.sampling_cut import parts_per_row, row_cuts


def _kept_float64(z: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """[V] bool: the sort rule in float64 (top-k, then the shortest prefix whose renormalised mass
    reaches p, at least the top token), closed under ties at each cut."""
    values = z.double().sort(descending=True).values
    if 0 < k < len(values):
        values = values[values >= values[k - 1]]
    if p < 1:
        probs = (values - values[0]).exp()
        probs /= probs.sum()
        values = values[: max(1, int(((probs.cumsum(0) - probs) < p).sum()))]
    return z.double() >= values[-1]


def _in_band(z: torch.Tensor, cut: torch.Tensor, k: int, p: float, eps: float) -> bool:
    kept = z >= cut
    inner = _kept_float64(z, k, p - eps if p < 1 else p)
    outer = _kept_float64(z, k, p + eps if p < 1 else p)
    return not bool((inner & ~kept).any() or (kept & ~outer).any())


def _row(rows: int, args, gen) -> str:
    vocab = args.vocab
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    temps = torch.full((rows,), 0.8, device="cuda")
    ks = torch.full((rows,), args.top_k, dtype=torch.int64, device="cuda")
    ps = torch.full((rows,), args.top_p, device="cuda")
    ones = torch.ones(rows, device="cuda")
    seeds = torch.arange(rows, device="cuda")
    z = logits.float() / temps[:, None]
    sort_us = graph_us([lambda: apply_top_k_top_p(z, ks, ps)], min_launches=8)
    cut_us = graph_us([lambda: row_cuts(logits, temps, ks, ps)], min_launches=8)
    sample_us = graph_us([lambda: sample_triton(logits, temps, ks, ps, seeds, (True, 0))], min_launches=8)
    plain_us = graph_us([lambda: sample_triton(logits, temps, ks, ones, seeds, (False, 0))], min_launches=8)
    cuts = row_cuts(logits, temps, ks, ps)
    same = torch.equal(cuts.view(torch.int32), row_cuts(logits, temps, ks, ps).view(torch.int32))
    kept = all(_in_band(z[b], cuts[b], args.top_k, args.top_p, args.eps) for b in range(min(rows, 8)))
    return (
        f"{rows:>5} {parts_per_row(rows, vocab):>6} {sort_us:>9.1f} {cut_us:>8.1f} {sample_us:>15.1f}"
        f" {plain_us:>15.1f} {sort_us / cut_us:>10.1f} {kept!s:>8} {same!s:>7}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--eps", type=float, default=1e-5, help="mass band around top_p for the kept check")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(
        f"top_k {args.top_k}, top_p {args.top_p}, temperature 0.8, vocab {args.vocab}, logits N(0, 3^2)"
        f" in bf16; kept: within the float64 sets at top_p -/+ {args.eps} (first 8 rows);"
        " same: two calls bit-equal"
    )
    print(
        f"{'rows':>5} {'parts':>6} {'sort us':>9} {'cut us':>8} {'sample(cut) us':>15}"
        f" {'sample(none) us':>15} {'sort / cut':>10} {'kept':>8} {'same':>7}"
    )
    for rows in (int(r) for r in args.rows.split(",")):
        print(_row(rows, args, gen))


if __name__ == "__main__":
    main()
