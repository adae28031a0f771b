"""Mixed prefill + decode steps with and without the piecewise CUDA graphs (engine/piecewise_graphs.py),
side by side in one engine: --batch running decodes, and every step one new prompt of --prompt tokens
(prefilled in that step, then finished), so each step carries batch + prompt tokens. The piecewise
graphs are switched off and on between rounds (the runner's `piecewise` seam), so both sides share
the weights, the KV cache and the machine's state.

Printed per (batch, prompt): median wall ms per step with the graphs (where the start-up timing kept
the step's bucket) and without, their ratio, and the start-up timing of every bucket.

    python benchmarks/mixed_steps.py                                  # llama-3.1-8b, dummy weights
    python benchmarks/mixed_steps.py --model tiny --device cpu --cases 2x8 --steps 3   # smoke (no graphs)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.sampling_params import SamplingParams


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, min(vocab, 30000)) for _ in range(n)]


def _steps(engine: LLMEngine, prompt: int, steps: int, rng: random.Random, tag: str) -> list[float]:
    """Wall seconds of `steps` engine steps, each with one arrival of `prompt` tokens and one output."""
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(steps):
        engine.add_request(f"{tag}-{i}", _ids(rng, prompt, engine.vocab_size), one)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def run_case(engine: LLMEngine, batch: int, prompt: int, context: int, steps: int, rounds: int, seed: int):
    """Median ms per mixed step with the piecewise graphs on and off (alternating rounds)."""
    rng = random.Random(seed)
    runner = engine.executor.runner
    piecewise = runner.piecewise
    room = engine.max_model_len - context  # the decodes outlast the case, then are aborted
    long = SamplingParams(temperature=0.0, max_tokens=room, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{prompt}-{i}", _ids(rng, context, engine.vocab_size), long)
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in scheduler.running):
        engine.step()  # every decode's prompt prefilled
    sides = {"on": [], "off": []} if piecewise is not None else {"off": []}
    for r in range(rounds):
        for side in sorted(sides, reverse=r % 2 == 1):
            runner.piecewise = piecewise if side == "on" else None
            _steps(engine, prompt, 2, rng, f"w{batch}-{prompt}-{r}-{side}")  # warm-up: the side's first steps
            sides[side] += _steps(engine, prompt, steps, rng, f"m{batch}-{prompt}-{r}-{side}")
    runner.piecewise = piecewise
    for i in range(batch):
        engine.abort_request(f"d{batch}-{prompt}-{i}")
    while engine.has_unfinished():
        engine.step()
    result = {side: statistics.median(times) * 1e3 for side, times in sides.items()}
    result["bucket"] = piecewise.bucket(batch + prompt) if piecewise is not None else None
    return result


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cases", default="1x64,8x120,32x200,64x400,256x256",
                        help="batchxprompt: running decodes x prompt tokens arriving each step")  # fmt: skip
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of the running decodes")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "mixed_steps.json"))
    args = parser.parse_args()
    cases = [tuple(int(v) for v in case.split("x")) for case in args.cases.split(",")]
    most = max(b + p for b, p in cases)
    growth = (args.rounds * 2 + 2) * (args.steps + 2) + 64
    blocks = max(b for b, _ in cases) * -(-(args.context + growth) // 16) + 4 * most
    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype,
        load_format="auto" if args.model == "tiny" else "dummy",
        max_num_batched_tokens=max(most, 2048), max_prefill_tokens_per_step=max(most, 2048),
        num_kv_blocks=blocks, max_model_len=args.context + growth + 16,
    )  # fmt: skip
    engine = LLMEngine(config)
    piecewise = engine.executor.runner.piecewise
    report = {"model": args.model, "context": args.context, "cases": []}
    if piecewise is None:
        print("no piecewise graphs here (CPU, --enforce-eager or none configured): eager side only")
    else:
        report["startup_us"] = {str(s): t for s, t in piecewise.timings.items()}
        report["kept"] = sorted(piecewise.kept)
        report["piecewise_startup_s"] = piecewise.startup_s
        print("start-up timing, replay / eager us at the fewest tokens of each bucket:")
        print("  " + ", ".join(f"{s}: {r:.0f}/{e:.0f}" for s, (r, e) in piecewise.timings.items()))
        print(f"  kept: {sorted(piecewise.kept)}; capture and timing took {piecewise.startup_s:.1f} s")
    print(f"{'batch':>6} {'prompt':>6} {'tokens':>6} {'bucket':>6} {'on ms':>8} {'off ms':>8} {'off/on':>7}")
    for batch, prompt in cases:
        result = run_case(engine, batch, prompt, args.context, args.steps, args.rounds, args.seed)
        on, off = result.get("on"), result["off"]
        ratio = f"{off / on:7.3f}" if on else "      -"
        on_text = f"{on:8.3f}" if on else "       -"
        bucket = result["bucket"] or "-"
        print(f"{batch:>6} {prompt:>6} {batch + prompt:>6} {bucket:>6} {on_text} {off:8.3f} {ratio}")
        report["cases"].append({"batch": batch, "prompt": prompt, **result})
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    engine.shutdown()


if __name__ == "__main__":
    main()
