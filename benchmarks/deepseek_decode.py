"""DeepSeek-V3-family decode step (model alone, CUDA-graph captured) against the bytes it must read.

For each batch size: a decode token per sequence at a fixed context over MLA latent caches, captured
with compute_logits and replayed. Roofline = bytes read / measured copy bandwidth, where the bytes are
attention, norm, router and shared-expert weights + the routed experts the captured inputs' routing
touched (the union over tokens, per layer) + dense-layer MLPs + lm_head + the latent cache of the
context (kv_lora_rank + rope values per token and layer). Prints ms per step and per layer, tok/s and
the fraction of the roofline, and writes JSON. Weights are bf16 dummies (FP8 block weights need the
quantization seam's FP8 experts, not wired for this family yet).

    python benchmarks/deepseek_decode.py --model deepseek-v3-4l --batch-sizes 1,8,32,64 --context 1024
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import (  # noqa: E402
    add_decode_args,
    copy_bandwidth,
    decode_metadata,
    input_embedding_bytes,
    load_moe_model,
    logits_step,
    print_header,
    roofline_fields,
    routed_graph_seconds,
    write_json,
)
from tpfuse.config import EngineConfig  # noqa: E402
from tpfuse.model.deepseek_v3 import DeepseekV3MoE  # noqa: E402


def latent_decode_inputs(model, batch_size: int, context: int, block_size: int):
    """Static decode inputs over random latent caches; each sequence owns consecutive blocks."""
    blocks_per_seq = -(-context // block_size)
    layout = model.kv_cache_layout(1)
    caches = layout.allocate(batch_size * blocks_per_seq, block_size, torch.device("cuda"))
    for (cache,) in caches:
        cache.normal_()
    tables = torch.arange(batch_size * blocks_per_seq, dtype=torch.int32, device="cuda").view(batch_size, -1)
    attn = decode_metadata(tables, block_size, context)
    ids = torch.randint(0, model.config.vocab_size, (batch_size,), device="cuda")
    positions = torch.full((batch_size,), context - 1, dtype=torch.int64, device="cuda")
    return ids, positions, attn, caches, layout


def step_bytes(model, batch_size: int, context: int, experts_touched: list[int], layout) -> dict[str, int]:
    blocks = [m for m in model.modules() if isinstance(m, DeepseekV3MoE)]
    expert_params = {id(b.experts.w13) for b in blocks} | {id(b.experts.w2) for b in blocks}
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_params)
    dense -= input_embedding_bytes(model)
    per_expert = [b.experts.w13[0].nbytes + b.experts.w2[0].nbytes for b in blocks]
    experts = sum(n * size for n, size in zip(experts_touched, per_expert, strict=True))
    latent = layout.bytes_per_block(1) * batch_size * context
    return {"dense": dense, "experts": experts, "latent_cache": latent}


def bench_batch(model, batch_size: int, args, bandwidth: float) -> dict:
    ids, positions, attn, caches, layout = latent_decode_inputs(
        model, batch_size, args.context, args.block_size
    )
    step = logits_step(model, ids, positions, attn, caches)
    profile = batch_size if args.profile else None
    touched, seconds = routed_graph_seconds(model, step, DeepseekV3MoE, args.iters, profile)
    parts = step_bytes(model, batch_size, args.context, touched, layout)
    return {
        "batch_size": batch_size,
        "context": args.context,
        "graph_ms": seconds * 1e3,
        "ms_per_layer": seconds * 1e3 / len(model.layers),
        "tok_per_s": batch_size / seconds,
        "mean_experts_touched_per_moe_layer": sum(touched) / max(len(touched), 1),
        **roofline_fields(parts, seconds, bandwidth),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_decode_args(
        parser, model="deepseek-v3-4l", batch_sizes="1,8,32,64", context=1024, iters=50,
        json_name="deepseek_decode.json",
    )  # fmt: skip
    args = parser.parse_args()

    engine_config = EngineConfig(model=args.model, dtype="bfloat16", load_format="dummy")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    model, config = load_moe_model(engine_config, max(batch_sizes))
    bandwidth = copy_bandwidth("cuda")
    name = torch.cuda.get_device_name()
    print(
        f"{args.model} ({config.num_layers} layers) bf16 on {name}; "
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s"
    )
    header = ("batch", "graph ms", "ms/layer", "tok/s", "experts/layer", "GB/step", "roofline ms", "% roof")
    print_header(header, (5, 9, 9, 9, 13, 8, 11, 7))
    rows = []
    for batch_size in batch_sizes:
        row = bench_batch(model, batch_size, args, bandwidth)
        torch.cuda.empty_cache()
        rows.append(row)
        print(
            f"{batch_size:5d} {row['graph_ms']:9.3f} {row['ms_per_layer']:9.3f} {row['tok_per_s']:9.1f} "
            f"{row['mean_experts_touched_per_moe_layer']:13.1f} {row['step_bytes'] / 1e9:8.3f} "
            f"{row['roofline_ms']:11.3f} {100 * row['fraction_of_roofline']:6.1f}%"
        )
    result = {"model": args.model, "dtype": "bfloat16", "device": name, "copy_bandwidth": bandwidth}
    write_json(args.json, result, rows)


if __name__ == "__main__":
    main()
