"""FP8 experts' routes side by side in one process, per scale layout and token count: per slot W8A16
(kernels/quant_moe.py), per slot W8A8 (kernels/quant_moe_w8a8.py) and the grouped GEMMs
(kernels/quant_moe_grouped.py); the per-slot routes up to 512 slots.

Random e4m3 experts at a model's real shapes (qwen3-30b-a3b: 128 experts, hidden 2048, intermediate
768, top-8; per-channel and 128x128 block scales), routing to distinct experts, copies of the stacks
round-robin past the L2, timed by CUDA-graph replay. Each route is checked against the float64 product
of the dequantized experts (W8A8 within 5 % of the largest value: its activation rounding). The
roofline is the routed experts' weight and scale bytes over the measured device copy bandwidth (a
memory bound: at thousands of tokens the grouped route is bound by its FLOPs instead).

    python benchmarks/moe_w8a8_slots.py                  # one H200: about a minute
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from roofline import copy_tbps  # noqa: E402
from tpfuse.gpu_timing import graph_us  # noqa: E402
from tpfuse.kernels.fused_moe import fused_experts_ref  # noqa: E402
from tpfuse.kernels.quant_fp8 import FP8_DTYPE  # noqa: E402
from tpfuse.kernels.quant_moe import QuantExperts, quant_slots_triton  # noqa: E402
from tpfuse.kernels.quant_moe_grouped import GROUPED_TILES, W8A8_GROUPED_TILES, grouped_slots_triton  # noqa: E402
from tpfuse.kernels.quant_moe_w8a8 import SLOT_TILES, w8a8_slots_triton  # noqa: E402


def stacks(experts: int, hidden: int, inter: int, group: int | None, gen):
    def stack(n, k):
        g = group or k
        codes = (torch.randn(experts, n, k, device="cuda", generator=gen) * 2).to(FP8_DTYPE)
        scales = torch.rand(experts, n, -(-k // g), device="cuda", generator=gen) * 0.01 + 1e-3
        return QuantExperts(codes, scales, 0, g, k)

    return stack(2 * inter, hidden), stack(hidden, inter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", default="1,8,64,512,2048")
    args = parser.parse_args()
    bandwidth = copy_tbps()
    shape = f"{args.experts} x (2 x {args.inter}) x {args.hidden}"
    print(f"copy {bandwidth:.2f} TB/s; experts {shape}, top-{args.top_k}")
    gen = torch.Generator("cuda").manual_seed(0)
    for group in (128, None):
        copies = [stacks(args.experts, args.hidden, args.inter, group, gen) for _ in range(3)]
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, args.hidden, device="cuda", generator=gen).bfloat16()
            ids = torch.stack([torch.randperm(args.experts, device="cuda", generator=gen)[: args.top_k]
                               for _ in range(tokens)]).int()  # fmt: skip
            weights = torch.rand(tokens, args.top_k, device="cuda", generator=gen)
            w13, w2 = copies[0]
            gate_up, down = w13.dequantize().double(), w2.dequantize().double()
            expected = fused_experts_ref(x.double(), gate_up, down, weights.double(), ids, combine=False)
            expected = expected.reshape(-1, args.hidden)
            del gate_up, down
            routed = ids.unique().numel()
            nbytes = routed * sum(s.codes[0].numel() + s.scales[0].numel() * 4 for s in (w13, w2))
            roof_us = nbytes / bandwidth / 1e6
            routes = [(t.label(), t) for t in GROUPED_TILES + W8A8_GROUPED_TILES]
            if tokens * args.top_k <= 512:
                routes = [("w8a16 slots", None)] + [(t.label(), t) for t in SLOT_TILES] + routes
            for label, tile in routes:

                def run(w13, w2, tile=tile, x=x, weights=weights, ids=ids):
                    if tile is None:
                        return quant_slots_triton(x, w13, w2, weights, ids)
                    if tile in GROUPED_TILES + W8A8_GROUPED_TILES:
                        return grouped_slots_triton(x, w13, w2, weights, ids, tile)
                    return w8a8_slots_triton(x, w13, w2, weights, ids, tile)

                err = (run(w13, w2).double() - expected).abs().max().item() / expected.abs().max().item()
                us = graph_us([lambda c=c: run(*c) for c in copies], min_launches=24, replays=5, samples=5)
                w8a8 = tile in SLOT_TILES or getattr(tile, "fp8_activations", False)
                ok = "ok" if err <= (0.05 if w8a8 else 0.01) else "WRONG"
                scales = "block128" if group else "channel"
                print(f"{scales:8} T={tokens:<3} {label:26} {us:8.2f} us  {roof_us / us:6.1%} of roofline "
                      f"({roof_us:.2f} us)  err {err:.2e} {ok}")  # fmt: skip


if __name__ == "__main__":
    main()
