"""MoE decode step (model alone, CUDA-graph captured) against the bytes it must read.

For each batch size: a decode token per sequence at a fixed context, captured with compute_logits
and replayed. The roofline of a step is the bytes it reads over the measured copy bandwidth:
attention and norm weights + routers + the experts the step's routing actually touched (the union
over its tokens, counted per layer from the routing of the captured inputs) + lm_head + the KV of
the context. Prints tok/s and the fraction of that roofline per batch, and writes JSON.

    python benchmarks/moe_decode.py                                   # qwen3-30b-a3b, batch 1,8,32,64
    python benchmarks/moe_decode.py --model qwen3-30b-a3b --batch-sizes 1 --profile
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # last: benchmarks/kernels.py shadows no package
from roofline import (  # noqa: E402
    add_decode_args,
    copy_bandwidth,
    decode_inputs,
    input_embedding_bytes,
    kv_bytes_per_token,
    load_moe_model,
    logits_step,
    print_header,
    roofline_fields,
    routed_graph_seconds,
    write_json,
)
from tpfuse.config import EngineConfig  # noqa: E402
from tpfuse.model.moe import SparseMoeBlock  # noqa: E402


def step_bytes(model, batch_size: int, context: int, experts_touched: list[int]) -> dict[str, int]:
    """Bytes a decode step reads, by part."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    # every expert parameter (bf16 w13/w2, or quantized codes and scales) is stacked [E, ...]
    expert_params = {id(p) for b in blocks for p in b.experts.parameters()}
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_params)
    dense -= input_embedding_bytes(model)
    per_expert = [sum(p[0].nbytes for p in b.experts.parameters()) for b in blocks]
    experts = sum(n * size for n, size in zip(experts_touched, per_expert, strict=True))
    return {"dense": dense, "experts": experts, "kv": batch_size * context * kv_bytes_per_token(model)}


def bench_batch(model, batch_size: int, args, bandwidth: float) -> dict:
    ids, positions, attn, caches = decode_inputs(model, batch_size, args.context, args.block_size, "cuda")
    step = logits_step(model, ids, positions, attn, caches)
    profile = batch_size if args.profile else None
    touched, seconds = routed_graph_seconds(model, step, SparseMoeBlock, args.iters, profile)
    parts = step_bytes(model, batch_size, args.context, touched)
    return {
        "batch_size": batch_size,
        "context": args.context,
        "graph_ms": seconds * 1e3,
        "tok_per_s": batch_size / seconds,
        "mean_experts_touched_per_layer": sum(touched) / len(touched),
        **roofline_fields(parts, seconds, bandwidth),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_decode_args(
        parser, model="qwen3-30b-a3b", batch_sizes="1,8,32,64", context=512, iters=100,
        json_name="moe_decode.json",
    )  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, choices=["fp8", "fp8-block", "int4"])
    parser.add_argument(
        "--pdl",
        action="store_true",
        help="launch the decode kernels with PDL where supported (kernels/pdl.py)",
    )
    args = parser.parse_args()
    if args.pdl:
        from tpfuse.kernels import pdl

        pdl.choose(torch.device("cuda", torch.cuda.current_device()), True)

    engine_config = EngineConfig(
        model=args.model, dtype=args.dtype, load_format="dummy", quantization=args.quantization
    )
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    model, config = load_moe_model(engine_config, max(batch_sizes))
    bandwidth = copy_bandwidth("cuda")
    name = torch.cuda.get_device_name()
    print(f"{args.model} {config.dtype} on {name}; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    header = ("batch", "graph ms", "tok/s", "experts/layer", "GB/step", "roofline ms", "% roof")
    print_header(header, (5, 9, 9, 13, 8, 11, 7))
    rows = []
    for batch_size in batch_sizes:
        row = bench_batch(model, batch_size, args, bandwidth)
        rows.append(row)
        print(
            f"{batch_size:5d} {row['graph_ms']:9.3f} {row['tok_per_s']:9.1f} "
            f"{row['mean_experts_touched_per_layer']:13.1f} {row['step_bytes'] / 1e9:8.3f} "
            f"{row['roofline_ms']:11.3f} {100 * row['fraction_of_roofline']:6.1f}%"
        )
    result = {"model": args.model, "dtype": str(config.dtype), "device": name, "copy_bandwidth": bandwidth}
    write_json(args.json, result, rows)


if __name__ == "__main__":
    main()
