"""Top-p sampling at a 128k vocabulary: the per-row cut (kernels/sampling_cut.py, no sort) against the
sort the sampler used before (apply_top_k_top_p), both timed by CUDA-graph replay
(gpu_timing.graph_us), plus a check of the cut's kept sets against a float64 sort on the GPU.

Usage (device machine, repo root): python benchmarks/top_p_sampling.py [--vocab 128256] [--rows 1,8,64]
"""

from __future__ import annotations

import argparse

import torch

from tpfuse.gpu_timing import graph_us
from tpfuse.kernels.sampling import apply_top_k_top_p, sample_triton
from tpfuse.kernels.sampling_cut import row_cuts


def _kept_float64(z: torch.Tensor, p: float) -> torch.Tensor:
    values, order = z.double().sort(descending=True)
    probs = (values - values[0]).exp()
    probs /= probs.sum()
    keep = (probs.cumsum(0) - probs) < p
    keep[0] = True
    mask = torch.zeros_like(z, dtype=torch.bool)
    mask[order[keep]] = True
    return mask


def _row(rows: int, vocab: int, gen) -> str:
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    temps = torch.full((rows,), 0.8, device="cuda")
    ks = torch.zeros(rows, dtype=torch.int64, device="cuda")
    ps = torch.full((rows,), 0.95, device="cuda")
    seeds = torch.arange(rows, device="cuda")
    z = logits.float() / temps[:, None]
    sort_us = graph_us([lambda: apply_top_k_top_p(z, ks, ps)], min_launches=8)
    cut_us = graph_us([lambda: row_cuts(logits, temps, ks, ps)], min_launches=8)
    sample_us = graph_us([lambda: sample_triton(logits, temps, ks, ps, seeds, (True, 0))], min_launches=8)
    cuts = row_cuts(logits, temps, ks, ps)
    same = all(torch.equal(z[b] >= cuts[b], _kept_float64(z[b], 0.95)) for b in range(min(rows, 8)))
    return (
        f"{rows:>5} {sort_us:>9.1f} {cut_us:>8.1f} {sample_us:>15.1f} {sort_us / cut_us:>10.1f} {same!s:>9}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rows", default="1,8,64")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"top_p 0.95, temperature 0.8, vocab {args.vocab}, logits N(0, 3^2) in bf16; kept: = float64 sort")
    print(f"{'rows':>5} {'sort us':>9} {'cut us':>8} {'sample(cut) us':>15} {'sort / cut':>10} {'kept':>9}")
    for rows in (int(r) for r in args.rows.split(",")):
        print(_row(rows, args.vocab, gen))


if __name__ == "__main__":
    main()
