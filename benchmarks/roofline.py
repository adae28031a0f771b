"""What the decode benchmarks share: the roofline's denominator (measured device copy bandwidth), mean
time per call, a decode step captured in a CUDA graph, its per-kernel profile, static decode inputs over
random paged KV caches, and the bytes a step reads.

Imported by deepseek_decode.py, moe_decode.py, quant_decode.py, model_decode_roofline.py, mla_decode.py
and gemv.py (each appends benchmarks/ to sys.path first).
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch

from tpfuse.comm.communicator import SingleRankCommunicator
from tpfuse.gpu_timing import stream_us
from tpfuse.model import linear_choice, moe_choice
from tpfuse.model.attention import AttentionMetadata
from tpfuse.model.layers import ParallelContext, projections
from tpfuse.model.loader import load_model


def add_decode_args(
    parser, *, model: str, batch_sizes: str, context: int, iters: int, json_name: str
) -> None:
    """The flags every decode-step benchmark takes, with this script's defaults: --model, --batch-sizes,
    --context, --block-size (16), --iters, --profile and --json ($OUT/json_name)."""
    parser.add_argument("--model", default=model)
    parser.add_argument("--batch-sizes", default=batch_sizes)
    parser.add_argument("--context", type=int, default=context)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--profile", action="store_true", help="print per-kernel GPU time of a step")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), json_name))


def load_moe_model(engine_config, max_rows: int):
    """(model, config) of engine_config on one GPU, with the projection, quantized-tile and MoE routes
    chosen up to max_rows rows as the engine does at start-up (the MoE choices are printed)."""
    model, config = load_model(engine_config, ParallelContext(0, 1, SingleRankCommunicator()), "cuda")
    linear_choice.choose(projections(model), max_rows=max_rows)
    linear_choice.choose_quantized([model], max_rows=max_rows)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("tpfuse").setLevel(logging.INFO)  # the router and finalize timings
    for choice in moe_choice.choose(model, max_rows, 0):
        print(choice.describe())
    return model, config


def timed(fn, device: str, iters: int) -> float:
    """Mean seconds per call of fn (CUDA events on cuda, wall clock elsewhere)."""
    if device == "cuda":
        return stream_us(fn, iters) / 1e6
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def copy_bandwidth(device: str, num_bytes: int = 2 << 30, iters: int = 20) -> float:
    """Bytes read + written per second by an eager device-to-device copy of num_bytes (eager: a copy
    captured in a CUDA graph measures lower)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = timed(lambda: dst.copy_(src), device, iters)
    return 2 * num_bytes / seconds


def copy_tbps(num_bytes: int = 1 << 30, iters: int = 20) -> float:
    """copy_bandwidth of a 1 GiB cuda copy, in TB/s."""
    return copy_bandwidth("cuda", num_bytes, iters) / 1e12


def capture_graph(step) -> torch.cuda.CUDAGraph:
    """step captured in a CUDA graph after three eager warm-up calls on a side stream, replayed 5 times."""
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
    return graph


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


def decode_metadata(tables: torch.Tensor, block_size: int, context: int) -> AttentionMetadata:
    """One decode token per row of tables [batch, blocks_per_seq], at position context - 1."""
    batch_size, device = tables.shape[0], tables.device
    pos = context - 1
    return AttentionMetadata(
        slot_mapping=tables[:, pos // block_size].long() * block_size + pos % block_size,
        block_tables=tables,
        seq_lens=torch.full((batch_size,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32, device=device),
        max_query_len=1,
        max_seq_len=context,
        is_decode=True,
    )


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
    ids = torch.randint(0, model.config.vocab_size, (batch_size,), device=device)
    positions = torch.full((batch_size,), context - 1, dtype=torch.int64, device=device)
    return ids, positions, decode_metadata(tables, block_size, context), caches


def kv_bytes_per_token(model) -> int:
    """K and V bytes of one token over all layers (the first layer's attention shape)."""
    attn0 = model.layers[0].self_attn
    return 2 * attn0.num_kv_heads * attn0.head_dim * model.config.dtype.itemsize * len(model.layers)


def input_embedding_bytes(model) -> int:
    """Bytes of the input embedding a decode step does not stream (0 when tied to lm_head)."""
    if model.config.tie_word_embeddings:
        return 0
    return model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()


def step_bytes(model, batch_size: int, context: int) -> int:
    """Bytes one decode step must read: weights (not the input embedding unless tied) + KV of the context."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - input_embedding_bytes(model)
    return weights + batch_size * context * kv_bytes_per_token(model)


def logits_step(model, ids, positions, attn, caches):
    """The decode step the benchmarks time: model forward + compute_logits on static inputs."""

    def step():
        hidden, _ = model(ids, positions, attn, caches)
        return model.compute_logits(hidden)

    return step


def routed_experts(model, step, block_type) -> list[int]:
    """Runs step once eagerly, recording per block_type layer how many distinct experts its routing chose:
    the ids its experts (block.experts, a FusedMoE) were called with, or picked themselves where the
    block routes inside them (routed_slot_outputs); the methods are wrapped for the call, then restored."""
    counts, wrapped = {}, []
    for block in model.modules():
        if not isinstance(block, block_type):
            continue
        experts = block.experts

        def by_argument(original, experts=experts):
            def recording(x, weights, ids):
                counts[experts] = int(torch.unique(ids).numel())
                return original(x, weights, ids)

            return recording

        def by_result(original, experts=experts):
            def recording(*args):
                out = original(*args)
                counts[experts] = int(torch.unique(out[2]).numel())
                return out

            return recording

        for name, wrap in (
            ("forward", by_argument),
            ("slot_outputs", by_argument),
            ("routed_slot_outputs", by_result),
        ):
            setattr(experts, name, wrap(getattr(experts, name)))
            wrapped.append((experts, name))
    step()
    for experts, name in wrapped:
        delattr(experts, name)  # the class's method again
    return [counts.get(experts, 0) for experts, name in wrapped if name == "forward"]  # 0: not called


def routed_graph_seconds(model, step, block_type, iters: int, profile_batch: int | None):
    """(routed_experts of one eager step, mean seconds of a CUDA-graph replay of step over iters), under
    no_grad; prints the kernel profile (labelled batch profile_batch) unless that is None."""
    with torch.no_grad():
        touched = routed_experts(model, step, block_type)
        graph = capture_graph(step)
        seconds = timed(graph.replay, "cuda", iters)
        if profile_batch is not None:
            print_kernel_profile(graph.replay, profile_batch)
    return touched, seconds


def roofline_fields(parts: dict[str, int], seconds: float, bandwidth: float) -> dict:
    """The JSON fields of a step that read sum(parts) bytes in `seconds`, at `bandwidth` bytes/s."""
    total = sum(parts.values())
    roof_s = total / bandwidth
    return {
        "bytes": parts,
        "step_bytes": total,
        "roofline_ms": roof_s * 1e3,
        "fraction_of_roofline": roof_s / seconds,
    }


def print_header(header: tuple[str, ...], widths: tuple[int, ...]) -> None:
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))


def write_json(path: str, result: dict, rows: list[dict]) -> None:
    """{**result, "rows": rows} to path, indented, and a line saying so."""
    with open(path, "w") as f:
        json.dump({**result, "rows": rows}, f, indent=2)
    print(f"wrote {path}")
