"""DeepSeek-V3-family decode step (model alone, CUDA-graph captured) against the bytes it must read.

For each batch size: a decode token per sequence at a fixed context over MLA latent caches, captured
with compute_logits and replayed. Roofline = bytes read / measured copy bandwidth, where the bytes are
attention, norm, router and shared-expert weights + the routed experts the captured inputs' routing
touched (the union over tokens, per layer) + dense-layer MLPs + lm_head + the latent cache of the
context (kv_lora_rank + rope values per token and layer); quantized weights count their codes and
scales as stored. Prints ms per step and
per layer, tok/s and the fraction of the roofline.

Then, at --layer-batch (default 1), each decoder layer alone (MLA, the post-attention fused add +
norm, the MLP or MoE block with its finalize) captured in its own graph on static inputs, against that
layer's bytes (its weights, the experts its routing touched, its latent cache). A layer's graph is
replayed back to back, so weights that fit in L2 (small layers) read faster than from HBM: the ratio is
an upper bound there. Dummy weights (--quantization fp8-block: DeepSeek-V3's 128x128 FP8 blocks,
kv_b_proj dequantized to bf16 at load; int4-experts: Kimi K2-Thinking's INT4 group-32 experts beside
bf16 linears). Writes JSON.

    python benchmarks/deepseek_decode.py --model deepseek-v3-4l --quantization fp8-block
    python benchmarks/deepseek_decode.py --model kimi-k2-3l --quantization int4-experts
    python benchmarks/deepseek_decode.py --model deepseek-v3-4l --batch-sizes 1,8,32,64 --context 1024
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # last: benchmarks/kernels.py shadows no package
from roofline import (  # noqa: E402
    add_decode_args,
    capture_graph,
    copy_bandwidth,
    decode_metadata,
    input_embedding_bytes,
    load_moe_model,
    logits_step,
    print_header,
    roofline_fields,
    routed_experts,
    routed_graph_seconds,
    timed,
    write_json,
)
from tpfuse.config import EngineConfig  # noqa: E402
from tpfuse.model import linear_choice  # noqa: E402
from tpfuse.model.deepseek_v3 import DeepseekV3MoE  # noqa: E402
from tpfuse.model.quant import DUMMY_QUANTIZATIONS  # noqa: E402


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


def expert_bytes(block: DeepseekV3MoE) -> int:
    """Bytes of one routed expert as stored (codes and scales of every stacked [E, ...] parameter)."""
    experts = block.experts
    stacked = [p for p in experts.parameters() if p.dim() and p.shape[0] == experts.num_experts]
    return sum(p.nbytes for p in stacked) // experts.num_experts


def non_expert_bytes(module) -> int:
    """Bytes of module's parameters outside its routed experts."""
    routed = {id(p) for m in module.modules() if isinstance(m, DeepseekV3MoE) for p in m.experts.parameters()}
    return sum(p.nbytes for p in module.parameters() if id(p) not in routed)


def step_bytes(model, batch_size: int, context: int, experts_touched: list[int], layout) -> dict[str, int]:
    blocks = [m for m in model.modules() if isinstance(m, DeepseekV3MoE)]
    dense = non_expert_bytes(model) - input_embedding_bytes(model)
    experts = sum(n * expert_bytes(b) for n, b in zip(experts_touched, blocks, strict=True))
    latent = layout.bytes_per_block(1) * batch_size * context
    return {"dense": dense, "experts": experts, "latent_cache": latent}


def layer_rows(model, batch_size: int, args, bandwidth: float) -> list[dict]:
    """Each decoder layer alone at batch_size: graph ms against its own bytes-read roofline."""
    inputs = latent_decode_inputs(model, batch_size, args.context, args.block_size)
    _, positions, attn, caches, layout = inputs
    hidden = model.config.hidden_size
    h = torch.randn(batch_size, hidden, dtype=model.config.dtype, device="cuda")
    residual = torch.randn_like(h)
    comm, eps, rows = model.comm, model.eps, []
    for i, layer in enumerate(model.layers):
        next_norm = model.norm if i == len(model.layers) - 1 else model.layers[i + 1].input_layernorm

        def step(layer=layer, cache=caches[i], next_norm=next_norm):
            partial = layer.self_attn(positions, h, attn, cache, model.cos_sin_cache)
            mid, res = comm.fused_add_rmsnorm_all_reduce(
                partial, residual, layer.post_attention_layernorm.weight, eps
            )
            return layer.mlp.forward_add_rmsnorm(mid, res, next_norm.weight, eps, comm)

        with torch.no_grad():
            touched = sum(routed_experts(model, step, DeepseekV3MoE))  # this layer's: the others run none
            seconds = timed(capture_graph(step).replay, "cuda", args.iters)
        moe = isinstance(layer.mlp, DeepseekV3MoE)
        parts = {
            "weights": non_expert_bytes(layer),
            "experts": touched * expert_bytes(layer.mlp) if moe else 0,
            "latent_cache": layout.bytes_per_block(1) // len(model.layers) * batch_size * args.context,
        }
        rows.append({
            "layer": i, "kind": "moe" if moe else "dense", "batch_size": batch_size, "ms": seconds * 1e3,
            "experts_touched": touched if moe else 0, **roofline_fields(parts, seconds, bandwidth),
        })  # fmt: skip
        torch.cuda.empty_cache()
    return rows


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
    parser.add_argument("--quantization", default=None, choices=DUMMY_QUANTIZATIONS)
    parser.add_argument("--layer-batch", type=int, default=1, help="batch of the per-layer table (0: none)")
    args = parser.parse_args()

    engine_config = EngineConfig(
        model=args.model, dtype="bfloat16", load_format="dummy", quantization=args.quantization
    )
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_rows = max(batch_sizes + [args.layer_batch])
    model, config = load_moe_model(engine_config, max_rows)
    linear_choice.choose_quantized([model], max_rows=max_rows)  # as the engine does at start-up
    bandwidth = copy_bandwidth("cuda")
    name = torch.cuda.get_device_name()
    weights = args.quantization or "bf16"
    print(
        f"{args.model} ({config.num_layers} layers) {weights} on {name}; "
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
    result = {
        "model": args.model, "dtype": "bfloat16", "quantization": args.quantization, "device": name,
        "copy_bandwidth": bandwidth, "context": args.context,
    }  # fmt: skip
    if args.layer_batch:
        result["layers"] = print_layers(layer_rows(model, args.layer_batch, args, bandwidth), args)
    write_json(args.json, result, rows)


def print_layers(rows: list[dict], args) -> list[dict]:
    print(f"per layer at batch {args.layer_batch}, context {args.context}:")
    header = ("layer", "kind", "ms", "experts", "MB read", "roofline ms", "% roof")
    print_header(header, (5, 5, 8, 7, 8, 11, 7))
    for row in rows:
        print(
            f"{row['layer']:5d} {row['kind']:>5} {row['ms']:8.3f} {row['experts_touched']:7d} "
            f"{row['step_bytes'] / 1e6:8.1f} {row['roofline_ms']:11.3f} "
            f"{100 * row['fraction_of_roofline']:6.1f}%"
        )
    return rows


if __name__ == "__main__":
    main()
