"""Where a decode step's time goes outside the CUDA graph: LLMEngine driven directly (no LLM, no
detokenizer) through --steps decode steps at each --batch-sizes, under torch.profiler.

Printed per batch size (median over the profiled steps, and per step with --per-step):
  * wall: host time from one step's start to the next's;
  * GPU busy: union of kernel, memcpy and memset intervals in that window; GPU idle = wall - busy;
  * host phases: schedule, pack, execute (H2D + replay), sample (incl. the device sync), postprocess;
  * CUDA runtime calls per step by name (cudaGraphLaunch, cudaLaunchKernel, cudaMemcpyAsync, ...) and
    the device work launched outside a graph (kernels / copies whose launch is not cudaGraphLaunch);
  * top host functions by self time per step (cProfile over a separate run of the same steps).

    python benchmarks/profile_engine_step.py                  # llama-3.1-8b bf16, batch 1 and 64
    python benchmarks/profile_engine_step.py --model tiny --device cpu --batch-sizes 1 --steps 3 \
        --context 32                                            # smoke test on a CPU
    python benchmarks/profile_engine_step.py --tp-size 2 --devices 0,0   # TP=2 sharing GPU 0 (rank 0's view)
    python benchmarks/profile_engine_step.py --batch-sizes 256 --arrivals-per-step 1 --context 1024
                                        # serving-like mixed steps: a 1024-token prompt joins every step
Writes JSON to --out (default $OUT/profile_engine_step.json) and the Chrome traces next to it.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import json
import os
import pstats
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tpfuse.config import EngineConfig, SpeculativeConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.model.loader import load_model_config
from tpfuse.spec.eagle3_checkpoint import save_random_eagle3_head
from tpfuse.spec.simulate import SIMULATED_ACCEPTANCE_NOTICE

STEP = "engine_step_"
PHASES = [  # (label, attribute path from the engine, method); a label may wrap several methods
    ("schedule", "scheduler", "schedule"),
    ("schedule", "scheduler", "schedule_following"),  # overlap: the next step planned ahead
    ("schedule", "scheduler", "schedule_next_decode"),  # the same in trees before the token table
    ("pack", "executor.runner", "pack"),
    ("pack", "executor.runner", "pack_next_decode"),  # trees before the token table
    ("execute", "executor.runner", "_forward"),  # H2D copy, replay or eager forward
    ("sample", "executor.runner", "_choose_tokens"),  # sampler path (non-greedy, banned ids, eager)
    ("read_tokens", "executor.runner", "wait"),  # waits for the ids (D2H copy and event)
    ("postprocess", "scheduler", "postprocess_multi"),  # every step, plain and speculative
    ("schedule", "scheduler", "schedule_next_spec_decode"),  # chained speculative steps
    ("spec_launch", "spec_decoder", "launch"),  # with --eagle3-simulate: pack, replay, verify
    ("spec_wait", "spec_decoder", "wait"),  # reads the verified tokens back
    ("spec_execute", "spec_decoder", "execute_spec"),  # every rank's share (spec_forward.step_executor)
]
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def instrument_phases(engine: LLMEngine) -> None:
    """Wraps the engine's step phases in record_function ranges (instance attributes only)."""
    for label, path, method in PHASES:
        owner = engine
        for name in path.split("."):
            owner = getattr(owner, name)
        original = getattr(owner, method, None)
        if original is None:
            continue

        def wrapped(*args, _original=original, _label=label, **kwargs):
            with record_function(f"phase_{_label}"):
                return _original(*args, **kwargs)

        setattr(owner, method, wrapped)


def start_decode_batch(engine: LLMEngine, batch_size: int, context: int, num_tokens: int, tag: str) -> None:
    """Adds batch_size requests of context prompt tokens and steps until every one is decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    for i in range(batch_size):
        prompt = [100 + (i * 7 + j) % 50 for j in range(context)]
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < len(s) - 1 for s in engine.scheduler.running
    ):
        engine.step()


class Load:
    """engine.step() with `arrivals` new requests of `context` prompt tokens and `tokens` output
    tokens added before each step (0: the decode batch alone), so steps mix prompt chunks, arrivals
    and finishes with the decodes, as serving traffic does."""

    def __init__(self, engine: LLMEngine, arrivals: int, context: int, tokens: int):
        self.engine, self.arrivals, self.context, self.tokens = engine, arrivals, context, tokens
        self.added = 0

    def step(self) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=self.tokens, ignore_eos=True)
        for _ in range(self.arrivals):
            prompt = [100 + (self.added * 11 + j) % 50 for j in range(self.context)]
            self.engine.add_request(f"arrival-{self.added}", prompt, params)
            self.added += 1
        self.engine.step()


def profile_steps(load: Load, num_steps: int, cuda: bool, trace_path: str) -> dict:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(num_steps):
            with record_function(f"{STEP}{i}"):
                load.step()
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        return json.load(f)


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def analyse_trace(trace: dict, num_steps: int) -> list[dict]:
    """Per step: wall_us, gpu_busy_us, gpu_idle_us, phase_us, runtime_calls, outside_graph."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = sorted(
        (e for e in events if e.get("name", "").startswith(STEP)), key=lambda e: int(e["name"][len(STEP) :])
    )
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launch_of = {e.get("args", {}).get("correlation"): e["name"] for e in runtime}
    phases = [e for e in events if e.get("name", "").startswith("phase_")]
    results = []
    for i, step in enumerate(steps[:num_steps]):
        begin = step["ts"]
        end = steps[i + 1]["ts"] if i + 1 < len(steps) else step["ts"] + step["dur"]
        inside = [(max(e["ts"], begin), min(e["ts"] + e["dur"], end)) for e in device]
        busy = _union_length([(a, b) for a, b in inside if b > a])
        calls = collections.Counter(e["name"] for e in runtime if begin <= e["ts"] < end)
        outside = collections.Counter(
            e["name"][:60]
            for e in device
            if begin <= e["ts"] < end
            and launch_of.get(e.get("args", {}).get("correlation")) not in ("cudaGraphLaunch", None)
        )
        kernel_us = collections.Counter()
        for e in device:
            if begin <= e["ts"] < end:
                kernel_us[e["name"][:70]] += e["dur"]
        phase_us = collections.Counter()
        for e in phases:
            if begin <= e["ts"] < end:
                phase_us[e["name"][len("phase_") :]] += e["dur"]
        results.append(
            {
                "wall_us": end - begin,
                "gpu_busy_us": busy,
                "gpu_idle_us": end - begin - busy,
                "phase_us": dict(phase_us),
                "runtime_calls": dict(calls),
                "outside_graph": dict(outside),
                "kernel_us": dict(kernel_us),
            }
        )
    return results


def top_host_functions(load: Load, num_steps: int, top: int) -> list[dict]:
    """cProfile over num_steps steps: the top functions by self time, per step."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(num_steps):
        load.step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, name), (_, calls, self_s, cum_s, _) in stats.stats.items():
        where = f"{os.path.basename(filename)}:{line}({name})"
        per_step = {"calls_per_step": calls / num_steps, "self_us": self_s * 1e6 / num_steps}
        rows.append({"function": where, **per_step, "cum_us": cum_s * 1e6 / num_steps})
    return sorted(rows, key=lambda r: -r["self_us"])[:top]


def summarise(per_step: list[dict]) -> dict:
    def median(key):
        return statistics.median(s[key] for s in per_step)

    def median_counts(key):
        names = sorted({name for s in per_step for name in s[key]})
        return {name: statistics.median(s[key].get(name, 0) for s in per_step) for name in names}

    return {
        "wall_us": median("wall_us"),
        "gpu_busy_us": median("gpu_busy_us"),
        "gpu_idle_us": median("gpu_idle_us"),
        "phase_us": median_counts("phase_us"),
        "runtime_calls": median_counts("runtime_calls"),
        "outside_graph": median_counts("outside_graph"),
        "kernel_us": median_counts("kernel_us"),
    }


def print_report(
    batch_size: int, summary: dict, per_step: list[dict], hosts: list[dict], verbose: bool, arrivals: str = ""
) -> None:
    print(f"\n=== batch {batch_size}{arrivals}: median over {len(per_step)} steps ===")
    print(f"wall {summary['wall_us']:9.1f} us   GPU busy {summary['gpu_busy_us']:9.1f} us   "
          f"GPU idle {summary['gpu_idle_us']:8.1f} us")  # fmt: skip
    print("host phases (us): " + ", ".join(f"{k} {v:.1f}" for k, v in summary["phase_us"].items()))
    print(
        "runtime calls per step: "
        + (", ".join(f"{k} x{v:g}" for k, v in summary["runtime_calls"].items()) or "-")
    )
    print("device work launched outside a graph: "
          + (", ".join(f"{k} x{v:g}" for k, v in summary["outside_graph"].items()) or "-"))  # fmt: skip
    if verbose:
        for i, s in enumerate(per_step):
            print(
                f"  step {i:3d}: wall {s['wall_us']:8.1f}  busy {s['gpu_busy_us']:8.1f}  "
                f"idle {s['gpu_idle_us']:7.1f}"
            )
    kernels = sorted(summary["kernel_us"].items(), key=lambda kv: -kv[1])
    print(f"device time by kernel (us per step, median; top {len(hosts)} of {len(kernels)}):")
    for name, us in kernels[: len(hosts)]:
        print(f"  {us:8.1f}  {name}")
    print("top host functions by self time (us per step, cProfile):")
    for row in hosts:
        print(
            f"  {row['self_us']:8.1f} self {row['cum_us']:9.1f} cum {row['calls_per_step']:6.1f} calls  "
            f"{row['function']}"
        )


def eagle3_simulation(
    config: EngineConfig, head_dir: str, num_steps: int, length: float
) -> SpeculativeConfig:
    """A random EAGLE-3 head for config's model saved in head_dir, simulating acceptance length."""
    target = load_model_config(EngineConfig(model=config.model, dtype=config.dtype))
    aux = (0, 1, 2) if target.num_layers < 8 else None  # the default layers collide in tiny models
    save_random_eagle3_head(
        head_dir, target, draft_vocab_size=min(32000, target.vocab_size), aux_layer_ids=aux
    )
    return SpeculativeConfig(
        algorithm="eagle3", draft_model_path=head_dir, num_steps=num_steps, simulate_acceptance_length=length
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=20, help="profiled decode steps per batch size")
    parser.add_argument("--warmups", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--per-step", action="store_true", help="print every step's wall/busy/idle")
    parser.add_argument(
        "--arrivals-per-step", type=int, default=0,
        help="requests of --context prompt tokens added before every step (mixed prefill + decode steps)",
    )  # fmt: skip
    parser.add_argument("--arrival-tokens", type=int, default=8, help="output tokens of each arrival")
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument(
        "--eagle3-simulate", type=float, default=None, metavar="L",
        help="speculative steps instead: a random EAGLE-3 head, fixed k = --num-steps, simulated "
        "acceptance length L (timings real, tokens not the model's)",
    )  # fmt: skip
    parser.add_argument(
        "--num-steps", type=int, default=3, help="draft tokens per step with --eagle3-simulate"
    )
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (rank 0 is profiled)")
    parser.add_argument("--devices", default=None, help="CUDA device per rank, e.g. 0,0 (ranks share GPU 0)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "profile_engine_step.json"))
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    cuda = args.device == "cuda"
    tokens_per_step = 1 + args.num_steps if args.eagle3_simulate is not None else 1  # at most
    tokens_per_request = (2 + args.warmups + 2 * args.steps) * tokens_per_step
    # An arrival runs for its prompt's chunks and its tokens: room for all that may be running at once.
    max_running = max(batch_sizes) + args.arrivals_per_step * (args.arrival_tokens + 8)
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        load_format="dummy",
        max_model_len=args.context + tokens_per_request + 16,
        max_running_requests=max_running,
        cuda_graph_max_bs=max_running,
        max_num_batched_tokens=max(8192, args.context * 2),
        num_kv_blocks=None if cuda else max_running * (-(-(args.context + tokens_per_request) // 16) + 1),
        disable_overlap_schedule=args.disable_overlap_schedule,
        tp_size=args.tp_size,
        devices=[int(d) for d in args.devices.split(",")] if args.devices else None,
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as head_dir:  # the head is read while the engine starts
        if args.eagle3_simulate is not None:
            speculative = eagle3_simulation(config, head_dir, args.num_steps, args.eagle3_simulate)
            config = dataclasses.replace(config, speculative=speculative)  # validated as a new config
        engine = LLMEngine(config)
    if engine.spec_decoder is not None:
        engine.spec_decoder.policy = None  # fixed k: every decode step drafts num_steps tokens
        print(SIMULATED_ACCEPTANCE_NOTICE)
    graphs = engine.executor.runner.graphs is not None
    print(f"engine ready in {time.perf_counter() - start:.1f} s; graphs: {graphs}; overlap: {engine.overlap}")
    instrument_phases(engine)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    record = {"model": args.model, "dtype": args.dtype, "device": args.device, "context": args.context,
              "tp_size": args.tp_size, "devices": args.devices, "arrivals_per_step": args.arrivals_per_step,
              "steps": args.steps, "graphs": graphs, "overlap": engine.overlap, "results": {}}  # fmt: skip
    for b in batch_sizes:
        start_decode_batch(engine, b, args.context, tokens_per_request, f"b{b}")
        load = Load(engine, args.arrivals_per_step, args.context, args.arrival_tokens)
        for _ in range(args.warmups):
            load.step()
        trace_path = os.path.join(out_dir, f"profile_engine_step_b{b}.trace.json")
        per_step = analyse_trace(profile_steps(load, args.steps, cuda, trace_path), args.steps)
        hosts = top_host_functions(load, args.steps, args.top)
        summary = summarise(per_step)
        mixed = f" + {args.arrivals_per_step} x {args.context}-token arrivals a step" if load.arrivals else ""
        print_report(b, summary, per_step, hosts, args.per_step, mixed)
        record["results"][str(b)] = {"summary": summary, "per_step": per_step, "top_host_functions": hosts,
                                     "trace": trace_path}  # fmt: skip
        for request_id in list(engine.requests):
            engine.abort_request(request_id)
        while engine.has_unfinished():
            engine.step()
    engine.shutdown()
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
