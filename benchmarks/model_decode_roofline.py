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
import os
import sys

import torch

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # last: benchmarks/kernels.py shadows no package
from roofline import (  # noqa: E402
    add_decode_args,
    capture_graph,
    copy_bandwidth,
    decode_inputs,
    logits_step,
    print_header,
    print_kernel_profile,
    step_bytes,
    timed,
    write_json,
)
from tpfuse.comm.communicator import SingleRankCommunicator  # noqa: E402
from tpfuse.config import EngineConfig  # noqa: E402
from tpfuse.model import linear_choice  # noqa: E402
from tpfuse.model.layers import ParallelContext, projections  # noqa: E402
from tpfuse.model.loader import load_model  # noqa: E402


def bench_batch(model, batch_size: int, args) -> dict:
    ids, positions, attn, caches = decode_inputs(
        model, batch_size, args.context, args.block_size, args.device
    )
    step = logits_step(model, ids, positions, attn, caches)

    with torch.no_grad():
        eager_s = timed(step, args.device, max(1, args.iters // 10))
        graph_s = None
        if args.device == "cuda" and not args.eager:
            graph = capture_graph(step)
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
    add_decode_args(
        parser, model="llama-3.1-8b", batch_sizes="1,8,32", context=512, iters=200,
        json_name="model_decode_roofline.json",
    )  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--eager", action="store_true", help="no CUDA graph")
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
    print_header(header, (5, 9, 9, 9, 8, 11, 7))
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
    write_json(args.json, result, rows)


if __name__ == "__main__":
    main()
