"""The MoE layer's experts at prefill sizes: tpfuse's grouped Triton GEMMs against the best torch path.

For each token count, one layer of the model's shape (default qwen3-30b-a3b: 128 experts of 768,
top-8, hidden 2048) with uniformly random routing: tpfuse's fused_experts at the tile the start-up
measurement picks, against torch._grouped_mm (tokens sorted by expert, the two grouped GEMMs, SiLU-and-mul,
weighted combine) and, where _grouped_mm is missing, a per-expert torch.mm loop. Both get the same
top-k ids and weights; the outputs are compared. Prints one row per size and writes JSON.

    python benchmarks/moe_prefill.py                       # 2048, 4096, 8192, 16384 tokens
    python benchmarks/moe_prefill.py --tokens 2048 --model mixtral-8x7b
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from tpfuse.kernels import fused_moe
from tpfuse.kernels.fused_moe_tiles import PREFILL_TILES
from tpfuse.model.presets import preset_config


def torch_grouped_mm(x, w13, w2, weights, ids):
    """Sorted by expert, torch._grouped_mm for both products, then the weighted combine."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    offsets = torch.bincount(flat, minlength=w13.shape[0]).cumsum(0).to(torch.int32)
    xs = x[order // top_k]
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offsets)
    inter = w2.shape[2]
    act = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offsets)
    out = torch.empty_like(y)
    out[order] = y
    return (out.view(num_tokens, top_k, -1).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def torch_loop(x, w13, w2, weights, ids):
    """One torch.mm pair per expert (syncs on the host for each expert's rows)."""
    return fused_moe.fused_experts_ref(x, w13, w2, weights, ids)


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", default="2048,4096,8192,16384")
    parser.add_argument("--tp-size", type=int, default=1, help="expert slice of one rank (I / tp)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "moe_prefill.json"))
    args = parser.parse_args()

    config = preset_config(args.model, "bfloat16")
    e, h, k = config.num_experts, config.hidden_size, config.num_experts_per_tok
    i = config.moe_intermediate_size // args.tp_size
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) * 0.02).bfloat16()
    torch_path = torch_grouped_mm if hasattr(torch, "_grouped_mm") else torch_loop
    if torch_path is torch_grouped_mm:
        try:  # the grouped GEMM needs a recent GPU (sm_90 CUTLASS); else the per-expert loop
            ids = torch.randint(0, e, (16, k), device="cuda", dtype=torch.int32)
            probe = torch.randn(16, h, device="cuda").bfloat16()
            torch_grouped_mm(probe, w13, w2, torch.rand(16, k, device="cuda"), ids)
        except RuntimeError as exc:
            print(f"torch._grouped_mm unavailable here ({exc}); comparing with the per-expert loop")
            torch_path = torch_loop
    print(f"{args.model} experts {e} x (2*{i} x {h}), top-{k}, on {torch.cuda.get_device_name()}; "
          f"torch path: {torch_path.__name__}")  # fmt: skip
    header = ("tokens", "tile", "tpfuse ms", "default ms", "torch ms", "speedup", "rel err")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (6, 26, 10, 10, 9, 8, 8), strict=True)))
    rows = []
    for num_tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(num_tokens, h, device="cuda", generator=g).bfloat16()
        scores = torch.rand(num_tokens, e, device="cuda", generator=g)
        weights, ids = scores.topk(k, dim=-1)
        weights, ids = (weights / weights.sum(-1, keepdim=True)).float(), ids.to(torch.int32)
        inputs = (x, w13, w2, weights, ids)
        timings = []
        for n, tile in enumerate(PREFILL_TILES):
            call = lambda t=tile, a=inputs: fused_moe.fused_experts_triton(*a, tile=t)  # noqa: E731
            timings.append((time_ms(call, args.iters), n, tile))
        default_ms = timings[0][0]  # PREFILL_TILES[0] is the default
        ours_ms, _, tile = min(timings)
        theirs_ms = time_ms(lambda inputs=inputs: torch_path(*inputs), args.iters)
        ours = fused_moe.fused_experts_triton(x, w13, w2, weights, ids, tile=tile).float()
        ref = torch_path(x, w13, w2, weights, ids).float()
        err = ((ours - ref).abs().max() / ref.abs().max()).item()
        row = dict(
            tokens=num_tokens, tile=tile.label(), tpfuse_ms=ours_ms, default_tile_ms=default_ms,
            torch_ms=theirs_ms, torch_path=torch_path.__name__, speedup=theirs_ms / ours_ms, rel_err=err,
        )  # fmt: skip
        rows.append(row)
        print(f"{num_tokens:6d} {tile.label():>26} {ours_ms:10.3f} {default_ms:10.3f} {theirs_ms:9.3f} "
              f"{theirs_ms / ours_ms:7.2f}x {err:8.1e}")  # fmt: skip
    with open(args.json, "w") as f:
        json.dump({"model": args.model, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
