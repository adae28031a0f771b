"""The host's share of a decode step at large batches, without a model: Scheduler.schedule_following
(the step planned ahead), pack_step and postprocess for B running requests of a given context, per
step (median over --steps). On a GPU host this is the time that must stay under the GPU's step for
steps launched ahead to keep the GPU busy (at TP 8 an 8B model's decode step is a few ms or less).

    python benchmarks/host_step_cost.py                       # batch 1, 16, 64, 256 at context 1024
    python benchmarks/host_step_cost.py --batch-sizes 256 --context 4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tpfuse.engine.block_manager import BlockManager
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.engine.scheduler import Scheduler
from tpfuse.engine.sequence import Sequence
from tpfuse.engine.step_inputs import pack_step

BLOCK = 16


def measure(batch: int, context: int, steps: int) -> dict:
    bm = BlockManager(batch * (context // BLOCK + steps // BLOCK + 4), BLOCK, enable_prefix_caching=True)
    scheduler = Scheduler(bm, batch, 1 << 20, 1 << 20, eos_token_ids={2})
    params = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 1000 + 3 for j in range(context)]
        scheduler.add(Sequence(f"r{i}", prompt, params, BLOCK))
    step = scheduler.schedule()  # every prompt in one step
    scheduler.postprocess(step, [5] * batch)
    step = scheduler.schedule()
    times = {"schedule_following": [], "pack_step": [], "postprocess": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        following = scheduler.schedule_following(step)
        t1 = time.perf_counter()
        pack_step(following, BLOCK, 0, table_sink=batch)
        t2 = time.perf_counter()
        scheduler.postprocess(step, [7] * len(step.seqs))
        t3 = time.perf_counter()
        for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            times[name].append(dt * 1e6)
        step = following
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    print(f"context {args.context}, block {BLOCK}; us per step (median of {args.steps})")
    print(f"{'batch':>6} {'schedule_following':>19} {'pack_step':>10} {'postprocess':>12} {'total':>8}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        result = measure(batch, args.context, args.steps)
        total = sum(result.values())
        rows.append({"batch": batch, "context": args.context, **result, "total": total})
        print(
            f"{batch:6d} {result['schedule_following']:19.0f} {result['pack_step']:10.0f} "
            f"{result['postprocess']:12.0f} {total:8.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
