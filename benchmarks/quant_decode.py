"""Quantized decode and prefill on one GPU: llama-3.1-8b with dummy weights in bf16 and with
--quantization fp8 (per-channel), fp8-block (128x128) and int4 (group 128), side by side.

Per method: the batch-1 and batch-64 decode step (model forward + logits, CUDA-graph replayed, at a
fixed context), each against its roofline: the bytes a step really reads (every parameter, packed
codes and scales included, but not the untied input embedding; plus the KV cache of the context) at
the measured device copy bandwidth; and prefill throughput (one sequence of --prefill-tokens,
eager). Where layers can take their input in a form their producers write (model/input_forms.py),
the prefill with FP8 rows and the batch-1 step with Half2X off, on everywhere and as chosen. Prints
one table and writes JSON.

    python benchmarks/quant_decode.py                       # $OUT/quant_decode.json
    python benchmarks/quant_decode.py --methods bf16,int4 --prefill-tokens 1024
    python benchmarks/quant_decode.py --methods fp8,fp8-block --fp8-tiles compare   # W8A16 vs W8A8 decode
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # last: benchmarks/kernels.py shadows no package
from roofline import (  # noqa: E402
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
from tpfuse.kernels.fp8_scaled_mm import GemmRoute  # noqa: E402
from tpfuse.kernels.quant_fp8_w8a8 import W8A8Tile, fp8_dot_supported  # noqa: E402
from tpfuse.model import linear_choice  # noqa: E402
from tpfuse.model.attention import AttentionMetadata  # noqa: E402
from tpfuse.model.layers import ParallelContext, projections  # noqa: E402
from tpfuse.model.loader import load_model  # noqa: E402
from tpfuse.model.quant.fp8 import Fp8LinearMethod  # noqa: E402

METHODS = {"bf16": None, "fp8": "fp8", "fp8-block": "fp8-block", "int4": "int4"}


def graph_step_s(model, batch_size: int, context: int, iters: int, profile: bool = False) -> float:
    ids, positions, attn, caches = decode_inputs(model, batch_size, context, 16, "cuda")
    graph = capture_graph(logits_step(model, ids, positions, attn, caches))
    seconds = timed(graph.replay, "cuda", iters)
    if profile:
        print_kernel_profile(graph.replay, batch_size)
    return seconds


def prefill_tok_s(model, tokens: int, iters: int) -> float:
    """One sequence of `tokens` new tokens (an empty cache), eager forward + last-token logits."""
    attn0 = model.layers[0].self_attn
    block = 16
    blocks = -(-tokens // block)
    shape = (blocks, block, attn0.num_kv_heads, attn0.head_dim)
    dtype = model.config.dtype
    caches = [(torch.empty(shape, dtype=dtype, device="cuda"), torch.empty(shape, dtype=dtype, device="cuda"))
              for _ in model.layers]  # fmt: skip
    attn = AttentionMetadata(
        slot_mapping=torch.arange(tokens, device="cuda"),
        block_tables=torch.arange(blocks, dtype=torch.int32, device="cuda").view(1, -1),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device="cuda"),
        max_query_len=tokens,
        max_seq_len=tokens,
        is_decode=False,
    )
    ids = torch.randint(0, model.config.vocab_size, (tokens,), device="cuda")
    positions = torch.arange(tokens, device="cuda")

    def step():
        hidden, _ = model(ids, positions, attn, caches)
        return model.compute_logits(hidden[-1:])

    for _ in range(2):
        step()
    return tokens / timed(step, "cuda", iters)


def _restrict_fp8_tiles(model, which: str) -> None:
    """--fp8-tiles: w8a16 / w8a8 keep only that form among the FP8 candidates start-up timing tries (the
    forms side by side in one call); all leaves them as the engine has them."""
    if which == "all":
        return
    for layer in model.modules():
        method = getattr(layer, "method", None)
        if isinstance(method, Fp8LinearMethod) and not hasattr(method, "_all_tiles"):
            method._all_tiles = method.tile_candidates

            def restricted(bucket, layer, method=method):
                tiles = method._all_tiles(bucket, layer)
                kept = tuple(t for t in tiles if isinstance(t, (W8A8Tile, GemmRoute)) == (which == "w8a8"))
                if not kept:
                    raise SystemExit(f"--fp8-tiles {which}: no such tile for {method.name} here")
                return kept

            method.tile_candidates = restricted


def prefill_by_route(model, args) -> dict[str, float]:
    """Prefill tok/s with every prefill-routed layer forced onto each route its method offers them all
    (kernels/fp8_scaled_mm.py), FP8 rows off; then, where layers can take FP8 rows from the norms
    (kernels/fp8_rows.py), the chosen routes with them off, on at every norm-reading projection, and
    as start-up chose them, side by side. {} where there is neither choice. Restores every choice."""
    tokens, iters = args.prefill_tokens, max(3, args.iters // 20)
    layers = [m for m in model.modules() if hasattr(getattr(m, "method", None), "prefill_candidates")]
    rows_layers = [m for m in layers if m.method.form_candidates(m, linear_choice.PREFILL)[1]]
    offered = [set(layer.method.prefill_candidates(layer)) for layer in layers]
    common = set.intersection(*offered) if offered else set()
    chosen = {layer: linear_choice.quant_tile(layer, tokens) for layer in layers}
    chosen_rows = {layer: linear_choice.form_route(layer, tokens) for layer in rows_layers}
    for layer in rows_layers:
        linear_choice.set_form_route(layer, tokens, None)
    result = {}
    for route in sorted(common, key=lambda r: r.label()) if len(common) >= 2 else ():
        for layer in layers:
            linear_choice.set_quant_tile(layer, tokens, route)
        result[route.label()] = prefill_tok_s(model, tokens, iters)
    for layer, route in chosen.items():
        linear_choice.set_quant_tile(layer, tokens, route)
    if rows_layers:
        result["the chosen routes, plain tensors from the norms"] = prefill_tok_s(model, tokens, iters)
        for layer in rows_layers:
            _, routes = layer.method.form_candidates(layer, linear_choice.PREFILL)
            linear_choice.set_form_route(layer, tokens, routes[0])
        result["the chosen routes, FP8 rows into every projection that reads a norm"] = prefill_tok_s(
            model, tokens, iters
        )
    for layer, route in chosen_rows.items():
        linear_choice.set_form_route(layer, tokens, route)
    if rows_layers:
        result["start-up's choices as made (FP8 rows where chosen)"] = prefill_tok_s(model, tokens, iters)
    return result


def b1_by_input_form(model, args) -> dict[str, float]:
    """The batch-1 step (ms) where layers can take their input in a form their producers write at one
    row (model/input_forms.py: Half2X for the INT4 GEMV): with every such layer on the plain row, on
    the form at every one (at its chosen tile where that is one of the form's routes, else the first
    of them), and as start-up chose, side by side. {} where no layer offers a form. Restores every
    choice."""
    layers = [m for m in model.modules() if hasattr(getattr(m, "method", None), "form_candidates")]
    offered = {m: m.method.form_candidates(m, 1)[1] for m in layers}
    offered = {m: routes for m, routes in offered.items() if routes}
    if not offered:
        return {}
    chosen = {layer: linear_choice.form_route(layer, 1) for layer in offered}
    plain = {layer: linear_choice.quant_tile(layer, 1) for layer in offered}
    # on the form: the layer's plain tile where the form offers it, else the form's first route
    on_form = {m: plain[m] if plain[m] in routes else routes[0] for m, routes in offered.items()}
    result = {}
    for label, routes in (
        ("plain rows everywhere", dict.fromkeys(offered)),
        ("the input form into every layer that takes it", on_form),
        ("start-up's choices as made", chosen),
    ):
        for layer, route in routes.items():
            linear_choice.set_form_route(layer, 1, route)
        result[label] = graph_step_s(model, 1, args.context, args.iters) * 1e3
    return result


def bench_method(name: str, args, bandwidth: float) -> dict:
    config = EngineConfig(model=args.model, dtype="bfloat16", load_format="dummy", quantization=METHODS[name])
    model, _ = load_model(config, ParallelContext(0, 1, SingleRankCommunicator()), "cuda")
    start = time.perf_counter()
    linear_choice.choose(projections(model), max_rows=64)  # as the engine does at start-up
    _restrict_fp8_tiles(model, args.fp8_tiles)
    # the batch sizes timed, and the prefill route at the prefill measured
    decided = linear_choice.choose_quantized(
        [model], max_rows=64, buckets=(1, 64), prefill_rows=args.prefill_tokens
    )
    row = {"method": name, "route_choice_s": time.perf_counter() - start}
    row["tiles"] = [
        f"{key[0]} {list(key[1])} at {rows} rows: {tile.label()}" + (f" ({us:.1f} us)" if us else "")
        for key, rows, tile, us in decided
    ]
    with torch.no_grad():
        for batch_size in (1, 64):
            profile = args.profile and batch_size == 1
            seconds = graph_step_s(model, batch_size, args.context, args.iters, profile)
            roofline = step_bytes(model, batch_size, args.context) / bandwidth
            row[f"b{batch_size}_ms"] = seconds * 1e3
            row[f"b{batch_size}_roofline_ms"] = roofline * 1e3
            row[f"b{batch_size}_fraction"] = roofline / seconds
        row["b1_tok_s"] = 1e3 / row["b1_ms"]
        row["b64_over_b1"] = row["b64_ms"] / row["b1_ms"]
        row["prefill_tok_s"] = prefill_tok_s(model, args.prefill_tokens, max(3, args.iters // 20))
        row["prefill_by_route"] = prefill_by_route(model, args)
        row["b1_by_input_form"] = b1_by_input_form(model, args)
    row["weight_gb"] = step_bytes(model, 0, 0) / 1e9
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument(
        "--fp8-tiles", choices=("all", "w8a16", "w8a8", "compare"), default="all",
        help="the FP8 decode forms start-up timing may choose from (kernels/quant_fp8_w8a8.py); "
             "compare: each FP8 method twice, W8A16 tiles only then all, back to back",
    )  # fmt: skip
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--profile", action="store_true", help="print the batch-1 step's per-kernel GPU time")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "quant_decode.json"))
    parser.add_argument(
        "--pdl",
        action="store_true",
        help="launch the decode kernels with PDL where supported (kernels/pdl.py)",
    )
    args = parser.parse_args()
    if args.pdl:
        from tpfuse.kernels import pdl

        pdl.choose(torch.device("cuda", torch.cuda.current_device()), True)
    bandwidth = copy_bandwidth("cuda")
    device = torch.cuda.get_device_name()
    fp8_dot = fp8_dot_supported(torch.device("cuda", torch.cuda.current_device()))
    print(
        f"{args.model} on {device}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; FP8 tensor cores: {fp8_dot}"
    )
    header = ("method", "GB", "b1 ms", "tok/s", "% roof", "b64 ms", "% roof", "b64/b1", "prefill tok/s")
    widths = (16, 6, 7, 7, 7, 7, 7, 7, 13)
    print_header(header, widths)
    rows = []
    compare = args.fp8_tiles == "compare"
    runs = []  # (method, --fp8-tiles of the run)
    for name in args.methods.split(","):
        forms = ("w8a16", "all") if compare and name.startswith("fp8") else (args.fp8_tiles,)
        runs += [(name, "all" if form == "compare" else form) for form in forms]
    for name, form in runs:
        linear_choice.reset()  # each run times its own choices
        args.fp8_tiles = form
        row = bench_method(name, args, bandwidth)
        row["fp8_tiles"] = form
        rows.append(row)
        label = f"{name} {form}" if compare and name.startswith("fp8") else name
        print(
            f"{label:>16} {row['weight_gb']:6.2f} {row['b1_ms']:7.3f} {row['b1_tok_s']:7.1f} "
            f"{100 * row['b1_fraction']:6.1f}% {row['b64_ms']:7.3f} {100 * row['b64_fraction']:6.1f}% "
            f"{row['b64_over_b1']:7.2f} {row['prefill_tok_s']:13.0f}   "
            f"(route choice {row['route_choice_s']:.0f} s)"
        )
        for tile in row["tiles"]:
            print(f"    {tile}")
        for route, tok_s in row["prefill_by_route"].items():
            print(f"    prefill with every layer on {route}: {tok_s:.0f} tok/s")
        for forms, ms in row["b1_by_input_form"].items():
            print(f"    batch 1 with {forms}: {ms:.3f} ms")
        result = {"model": args.model, "device": device, "copy_bandwidth": bandwidth, "fp8_dot": fp8_dot}
        write_json(args.json, result, rows)  # after every method, so a cut-short run keeps what it measured


if __name__ == "__main__":
    main()
