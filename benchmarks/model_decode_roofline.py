"""Decode step of the model alone (no engine, no sampling), CUDA-graph captured, against the HBM roofline.

For each batch size: capture model forward + compute_logits for one decode token per sequence at a
fixed context length, replay it, and compare the step time with the bytes a step must read (every
weight except an untied input embedding, plus the KV cache of the context) divided by the device's
measured copy bandwidth. Prints a table and writes JSON.

    python benchmarks/model_decode_roofline.py --model llama-3.1-8b --batch-sizes 1,8,32 --context 512
    python benchmarks/model_decode_roofline.py --model tiny --device cpu --batch-sizes 1 --iters 3  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from tpfuse.comm.communicator import SingleRankCommunicator
from tpfuse.config import EngineConfig
from tpfuse.model import linear_choice
from tpfuse.model.attention import AttentionMetadata
from tpfuse.model.layers import ParallelContext, projections
from tpfuse.model.loader import load_model


def copy_bandwidth(device: str, num_bytes: int = 2 << 30, iters: int = 20) -> float:
    """Bytes read + written per second by a device-to-device copy of num_bytes."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = timed(lambda: dst.copy_(src), device, iters)
    return 2 * num_bytes / seconds


def timed(fn, device: str, iters: int) -> float:
    """Mean seconds per call of fn."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def decode_inputs(model, batch_size: int, context: int, block_size: int, device: str):
    """Static decode inputs: each sequence owns consecutive blocks; its new token sits at context - 1."""
    attn0 = model.layers[0].self_attn
    blocks_per_seq = -(-context // block_size)
    shape = (batch_size * blocks_per_seq, block_size, attn0.num_kv_heads, attn0.head_dim)
    dtype = model.config.dtype
    caches = [
        (torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device))
        for _ in model.layers
    ]
    tables = torch.arange(batch_size * blocks_per_seq, dtype=torch.int32, device=device).view(batch_size, -1)
    pos = context - 1
    slots = tables[:, pos // block_size].long() * block_size + pos % block_size
    attn = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=torch.full((batch_size,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=context,
        is_decode=True,
    )
    ids = torch.randint(0, model.config.vocab_size, (batch_size,), device=device)
    positions = torch.full((batch_size,), pos, dtype=torch.int64, device=device)
    return ids, positions, attn, caches


def step_bytes(model, batch_size: int, context: int) -> int:
    """Bytes one decode step must read: weights (not the input embedding unless tied) + KV of the context."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    attn0 = model.layers[0].self_attn
    kv_per_token = 2 * attn0.num_kv_heads * attn0.head_dim * model.config.dtype.itemsize * len(model.layers)
    return weights + batch_size * context * kv_per_token


def print_kernel_profile(replay, batch_size: int, steps: int = 20) -> None:
    """Per-kernel GPU time of one replayed decode step (mean over steps), largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(event.name[:70], [0.0, 0])
            entry[0] += getattr(event, "device_time_total", 0.0)
            entry[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    step_us = sum(us for us, _ in totals.values()) / steps
    print(f"kernel profile, batch {batch_size}: {step_us:.1f} us of kernels per step")
    for name, (us, count) in rows[:25]:
        print(f"  {us / steps:8.1f} us  x{count // steps:<4d} {name}")


def bench_batch(model, batch_size: int, args) -> dict:
    ids, positions, attn, caches = decode_inputs(
        model, batch_size, args.context, args.block_size, args.device
    )

    def step():
        hidden, _ = model(ids, positions, attn, caches)
        return model.compute_logits(hidden)

    with torch.no_grad():
        eager_s = timed(step, args.device, max(1, args.iters // 10))
        graph_s = None
        if args.device == "cuda" and not args.eager:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            for _ in range(5):
                graph.replay()
            graph_s = timed(graph.replay, args.device, args.iters)
            if args.profile:
                print_kernel_profile(graph.replay, batch_size)
    best = graph_s or eager_s
    return {
        "batch_size": batch_size,
        "context": args.context,
        "eager_ms": eager_s * 1e3,
        "graph_ms": graph_s * 1e3 if graph_s else None,
        "tok_per_s": batch_size / best,
        "step_bytes": step_bytes(model, batch_size, args.context),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--eager", action="store_true", help="no CUDA graph")
    parser.add_argument("--profile", action="store_true", help="print per-kernel GPU time of a step")
    parser.add_argument(
        "--json", default=os.path.join(os.environ.get("OUT", "."), "model_decode_roofline.json")
    )
    args = parser.parse_args()

    engine_config = EngineConfig(model=args.model, dtype=args.dtype, load_format="dummy")
    model, config = load_model(engine_config, ParallelContext(0, 1, SingleRankCommunicator()), args.device)
    if args.device == "cuda":  # as the engine does: projections by measured route, per row bucket
        max_rows = max(int(b) for b in args.batch_sizes.split(","))
        for choice in linear_choice.choose(projections(model), max_rows=max_rows):
            print(f"projection {choice.describe()}")
    bandwidth = copy_bandwidth(args.device) if args.device == "cuda" else None
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    tbps = bandwidth / 1e12 if bandwidth else 0.0
    print(f"{args.model} {config.dtype} on {name}; copy bandwidth {tbps:.2f} TB/s")
    header = ("batch", "eager ms", "graph ms", "tok/s", "GB/step", "roofline ms", "% roof")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (5, 9, 9, 9, 8, 11, 7), strict=True)))
    rows = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        row = bench_batch(model, batch_size, args)
        best_ms = row["graph_ms"] or row["eager_ms"]
        roof_ms = row["step_bytes"] / bandwidth * 1e3 if bandwidth else None
        row["roofline_ms"] = roof_ms
        row["fraction_of_roofline"] = roof_ms / best_ms if roof_ms else None
        rows.append(row)
        graph_text = f"{row['graph_ms']:9.3f}" if row["graph_ms"] else f"{'-':>9}"
        roof_text = f"{roof_ms:11.3f} {100 * roof_ms / best_ms:6.1f}%" if roof_ms else f"{'-':>11} {'-':>7}"
        print(
            f"{batch_size:5d} {row['eager_ms']:9.3f} {graph_text} {row['tok_per_s']:9.1f} "
            f"{row['step_bytes'] / 1e9:8.2f} {roof_text}"
        )
    result = {"model": args.model, "dtype": str(config.dtype), "device": name, "copy_bandwidth": bandwidth}
    with open(args.json, "w") as f:
        json.dump({**result, "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
