"""Admission under KV pressure, without a model: the real Scheduler and BlockManager serve a closed
loop of C clients (random-free: every request has the same prompt and output lengths, ignore_eos),
and each step's time is taken from a stated cost model, not measured. It compares admission with
the growth reserve (scheduler.GrowthReserve) against admitting whatever prompt fits.

Step cost model (llama-3.1-8b on an H200 by default; change the flags for another case):
  time = (weight bytes + KV bytes the decode rows read) / copy bandwidth
         + prompt tokens x 2 x parameters / prefill FLOP rate
Reported per policy: steps, preemptions, prompt tokens recomputed after a preemption, mean running
requests, modelled output tok/s. The figures rank policies; they are not a throughput prediction.

    python benchmarks/admission_sim.py --concurrency 256,1024 --requests 1024
"""

from __future__ import annotations

import argparse
import statistics
from collections import deque

from tpfuse.engine.block_manager import BlockManager
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.engine.scheduler import GrowthReserve, Scheduler
from tpfuse.engine.sequence import Sequence

BLOCK = 16


def simulate(args, concurrency: int, reserve: GrowthReserve | None) -> dict:
    bm = BlockManager(args.kv_tokens // BLOCK, BLOCK, enable_prefix_caching=False)
    scheduler = Scheduler(
        bm, args.max_running, 1 << 20, 1 << 20, eos_token_ids={2},
        max_prefill_tokens_per_step=args.prefill_budget, growth_reserve=reserve,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    pending = deque(range(args.requests))
    in_flight, finished, prompt_tokens, seconds, steps, running = 0, 0, 0, 0.0, 0, []
    while finished < args.requests:
        while in_flight < concurrency and pending:
            i = pending.popleft()
            scheduler.add(
                Sequence(f"r{i}", [3 + (i + j) % 1000 for j in range(args.input_len)], params, BLOCK)
            )
            in_flight += 1
        batch = scheduler.schedule()
        if batch is None:
            raise RuntimeError("nothing can run: the KV budget is smaller than one request")
        decode_context = sum(
            len(s.token_ids) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if n == 1
        )
        prefill = sum(n for n in batch.num_new_tokens if n > 1)
        prompt_tokens += prefill
        seconds += (args.weight_bytes + decode_context * args.kv_bytes_per_token) / args.copy_bps
        seconds += prefill * 2 * args.params / args.prefill_flops
        running.append(len(scheduler.running))
        sampled = [5 if batch.samples(i) else None for i in range(len(batch.seqs))]
        for seq in scheduler.postprocess(batch, sampled):
            if seq.is_finished:
                finished += 1
                in_flight -= 1
        steps += 1
    recomputed = prompt_tokens - args.requests * args.input_len
    return {
        "steps": steps,
        "preemptions": scheduler.num_preemptions,
        "recomputed_tokens": recomputed,
        "mean_running": statistics.mean(running),
        "modelled_tok_s": args.requests * args.output_len / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="256,1024")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--max-running", type=int, default=1024)
    parser.add_argument("--prefill-budget", type=int, default=2048)
    parser.add_argument("--kv-tokens", type=int, default=840_000, help="KV capacity in tokens")
    parser.add_argument("--kv-bytes-per-token", type=float, default=131_072)
    parser.add_argument("--weight-bytes", type=float, default=16.06e9)
    parser.add_argument("--params", type=float, default=8.03e9)
    parser.add_argument("--copy-bps", type=float, default=4.28e12)
    parser.add_argument("--prefill-flops", type=float, default=600e12)
    args = parser.parse_args()
    print(
        f"closed loop, {args.requests} requests of {args.input_len} + {args.output_len} tokens, KV "
        f"{args.kv_tokens:,} tokens, prefill budget {args.prefill_budget}; time from the cost model"
    )
    print(
        f"{'C':>5} {'policy':>14} {'steps':>7} {'preempt':>8} {'recomputed':>11} {'running':>8} {'tok/s':>8}"
    )
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for name, reserve in (("admit-fits", None), ("growth-reserve", GrowthReserve())):
            r = simulate(args, concurrency, reserve)
            print(
                f"{concurrency:>5} {name:>14} {r['steps']:>7} {r['preemptions']:>8} "
                f"{r['recomputed_tokens']:>11,} {r['mean_running']:>8.1f} {r['modelled_tok_s']:>8.0f}"
            )


if __name__ == "__main__":
    main()
