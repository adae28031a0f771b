"""Engine decode speed on one GPU: batch-1 tok/s against the HBM roofline and transformers, and the
decode step time as the batch grows.

What is measured (all through LLMEngine, CUDA graphs on, dummy weights, greedy, ignore_eos):
  * batch 1: a short prompt, --tokens generated; tok/s over the decode steps only (the prefill step
    is excluded), --warmups runs thrown away, median of --runs.
  * roofline: bytes a decode step must read (every weight except an untied input embedding, plus the
    KV cache at the run's mean context) / device copy bandwidth measured here (read + write); beside
    it the issue's all-weights roofline (every weight byte, embedding included, / the same bandwidth).
  * transformers: eager `generate` on the same weights, --hf-tokens tokens (fewer than the engine's
    run: it is slow), batch 1.
  * step time at each --batch-sizes: median over --steps decode steps after --step-warmups.
Targets: batch 1 >= 85% of roofline; batch-64 step <= 1.25x the batch-1 step.

    python benchmarks/decode.py                        # llama-3.1-8b, JSON to $OUT/decode.json
    python benchmarks/decode.py --model tiny --device cpu --tokens 16 --runs 1 --warmups 0 \
        --batch-sizes 1,2 --steps 3 --hf-tokens 0      # smoke test on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.model import linear_choice

PROMPT = [100 + i for i in range(16)]  # valid in every vocabulary, the tiny one included


def copy_bandwidth(device: str, num_bytes: int = 4 << 30, iters: int = 20) -> float:
    """Bytes read + written per second by a device-to-device copy of num_bytes."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    return 2 * num_bytes * iters / (time.perf_counter() - start)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def all_weight_bytes(engine: LLMEngine) -> int:
    """Bytes of every parameter, each shared one counted once."""
    model = engine.executor.model
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def weight_bytes_per_step(engine: LLMEngine) -> int:
    """Bytes of every weight a decode step reads: all parameters, less an untied input embedding."""
    model = engine.executor.model
    total = all_weight_bytes(engine)
    slots = model.checkpoint_slots()
    if not engine.executor.model_config.tie_word_embeddings:
        embed = slots["model.embed_tokens.weight"].param
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(engine: LLMEngine) -> int:
    k, _ = engine.executor.kv_caches[0]
    per_token_per_layer = k[0, 0].numel() * k.element_size() * 2
    return per_token_per_layer * len(engine.executor.kv_caches)


def decode_tok_s(engine: LLMEngine, num_tokens: int, request_id: str) -> float:
    """Generated tokens per second over the decode steps of one batch-1 request."""
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    engine.add_request(request_id, PROMPT, params)
    engine.step()  # prefill: the first token
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        steps += len(engine.step())
    return steps / (time.perf_counter() - start)


def step_ms(engine: LLMEngine, batch_size: int, warmups: int, steps: int) -> float:
    """Median decode step time (ms) with batch_size running requests."""
    params = SamplingParams(temperature=0.0, max_tokens=1 + warmups + steps, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(f"bs{batch_size}-{i}", PROMPT, params)
    while len(engine.scheduler.running) < batch_size or engine.scheduler.waiting:
        engine.step()
    for _ in range(warmups):
        engine.step()
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def transformers_tok_s(engine: LLMEngine, preset: dict, num_tokens: int, device: str) -> float:
    """Eager transformers generate, batch 1, on the engine's own weights (TP=1)."""
    import transformers

    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
    model_type["MistralForCausalLM"] = "mistral"
    config = transformers.AutoConfig.for_model(model_type[preset["architectures"][0]], **preset)
    dtype = engine.executor.model_config.dtype
    with torch.device(device):
        try:
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # transformers 4.x names it torch_dtype
            hf = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    hf = hf.to(dtype).eval()
    state = hf.state_dict()
    with torch.no_grad():
        for name, slot in engine.executor.model.checkpoint_slots().items():
            state[name].narrow(slot.dim, slot.start, slot.length).copy_(slot.destination())
    ids = torch.tensor([PROMPT], device=device)
    kwargs = dict(max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})
        _sync(device)
        start = time.perf_counter()
        hf.generate(ids, **kwargs)
        _sync(device)
    seconds = time.perf_counter() - start
    del hf, state
    if device == "cuda":
        torch.cuda.empty_cache()
    return num_tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--warmups", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hf-tokens", type=int, default=128, help="0 skips transformers")
    parser.add_argument("--batch-sizes", default="1,8,32,64,128")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--step-warmups", type=int, default=8)
    parser.add_argument("--mem-fraction-static", type=float, default=0.6, help="leaves room for transformers")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "decode.json"))
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        load_format="dummy",
        max_model_len=len(PROMPT) + args.tokens + 64,
        max_running_requests=max(batch_sizes),
        cuda_graph_max_bs=max(batch_sizes),
        mem_fraction_static=args.mem_fraction_static,
        enforce_eager=args.enforce_eager,
        num_kv_blocks=None if args.device == "cuda" else 512,
    )
    start = time.perf_counter()
    engine = LLMEngine(config)
    print(f"engine ready in {time.perf_counter() - start:.1f} s ({engine.stats().num_kv_blocks} KV blocks)")
    projection_routes = [choice.describe() for choice in linear_choice.decisions()]
    for route in projection_routes:
        print(f"projection {route}")
    pdl_choice = getattr(engine.executor.runner, "pdl_choice", None)
    print(f"programmatic dependent launch: {pdl_choice}")  # engine/launch_choice.py

    bandwidth = copy_bandwidth(args.device, num_bytes=(4 << 30) if args.device == "cuda" else 64 << 20)
    weights = weight_bytes_per_step(engine)
    mean_context = len(PROMPT) + args.tokens / 2
    step_bytes = weights + kv_bytes_per_token(engine) * mean_context
    roofline = bandwidth / step_bytes
    all_bytes = all_weight_bytes(engine)
    all_weights_roofline = bandwidth / all_bytes

    runs = [decode_tok_s(engine, args.tokens, f"warm{i}") for i in range(args.warmups)]
    runs = [decode_tok_s(engine, args.tokens, f"run{i}") for i in range(args.runs)]
    batch1 = statistics.median(runs)

    step_times = {b: step_ms(engine, b, args.step_warmups, args.steps) for b in batch_sizes}

    hf = None
    if args.hf_tokens > 0:
        from tpfuse.model.presets import PRESETS

        if args.model in PRESETS:
            hf = transformers_tok_s(engine, PRESETS[args.model], args.hf_tokens, args.device)
    engine.shutdown()

    print(f"\n{args.model} {args.dtype} on {_device_name(args.device)}, decode of {args.tokens} tokens")
    print(f"copy bandwidth         {bandwidth / 1e12:8.2f} TB/s (read + write)")
    print(f"bytes per decode step  {step_bytes / 1e9:8.2f} GB ({weights / 1e9:.2f} GB weights)")
    print(f"roofline               {roofline:8.1f} tok/s")
    print(
        f"tpfuse batch 1         {batch1:8.1f} tok/s  {batch1 / roofline:6.1%} of roofline  (runs: "
        + ", ".join(f"{r:.1f}" for r in runs)
        + ")"
    )
    print(
        f"all-weights roofline   {all_weights_roofline:8.1f} tok/s  (the issue's: "
        f"{all_bytes / 1e9:.2f} GB / copy bandwidth); tpfuse at {batch1 / all_weights_roofline:.1%}"
    )
    if hf is not None:
        speedup = batch1 / hf
        print(f"transformers eager     {hf:8.1f} tok/s  ({args.hf_tokens} tokens)  tpfuse is {speedup:.1f}x")
    print("\nbatch  step ms  tok/s   vs batch 1")
    base = step_times[batch_sizes[0]]
    for b, ms in step_times.items():
        print(f"{b:5d} {ms:8.3f} {b * 1e3 / ms:8.1f}   {ms / base:5.2f}x")
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "device": _device_name(args.device),
        "tokens": args.tokens,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "weight_bytes_per_step": weights,
        "bytes_per_step": step_bytes,
        "roofline_tok_s": roofline,
        "batch1_tok_s_runs": runs,
        "batch1_tok_s_median": batch1,
        "batch1_fraction_of_roofline": batch1 / roofline,
        "all_weight_bytes": all_bytes,
        "all_weights_roofline_tok_s": all_weights_roofline,
        "batch1_fraction_of_all_weights_roofline": batch1 / all_weights_roofline,
        "transformers_tok_s": hf,
        "transformers_tokens": args.hf_tokens,
        "step_ms": {str(b): ms for b, ms in step_times.items()},
        "enforce_eager": args.enforce_eager,
        "projection_routes": projection_routes,
        "pdl_choice": pdl_choice,
        "tpfuse_linear": os.environ.get("TPFUSE_LINEAR", "auto"),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


if __name__ == "__main__":
    main()
