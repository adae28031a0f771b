"""`tpfuse bench` end to end on the GPU machine: start `tpfuse serve`, run the single-stream method and a
concurrency sweep with GPU telemetry, stop the server; optionally a second server configuration (B)
swept the same way, then the crossover of B / A.

GPU: python benchmarks/serve_bench.py --model llama-3.1-8b --load-format dummy
     python benchmarks/serve_bench.py --model llama-3.1-8b --load-format dummy --single-tokens 0 \
         --server-args-b="--speculative-algorithm ngram"   (use = so argparse takes the flags as a value)
     python benchmarks/serve_bench.py --model llama-3.1-8b --load-format dummy --single-tokens 0 \
         --concurrency 256 --input-len 1024 --sweep-tokens 512 --repeats 1 --requests-per-level 256 \
         --warmup-requests 16 --server-args="--max-prefill-tokens-per-step 8192" --server-args-b=""
         (the prefill budget's old behaviour, A = the whole 8192-token batch budget, against the
         default, B = 2048: ITL p99 and TPOT at C = 256 with 1024-token prompts and 512 outputs)
CPU smoke: python benchmarks/serve_bench.py --device cpu --model tiny --single-tokens 16 --runs 2 \
         --concurrency 1,2 --sweep-tokens 4 --repeats 1
Results: $OUT/serve_bench/{single_a,sweep_a,sweep_b,compare}/ (summary.json, CSV, PNG); tables on stdout.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from tpfuse.bench import SweepConfig


class ExactSweepConfig(SweepConfig):
    """A sweep whose requests_per_level is taken as given (a time-bounded A/B at high concurrency),
    not raised to tpfuse bench's floor of 5 x C; None keeps the floor."""

    def requests_at(self, concurrency: int) -> int:
        return self.requests_per_level or super().requests_at(concurrency)


ENGINE_COUNTERS = ("num_preemptions", "num_generated_tokens", "num_prompt_tokens", "num_kv_blocks")


def engine_counters(url: str) -> str:
    """The engine's cumulative counters from the server's /metrics, one line (or why not)."""
    import urllib.request

    try:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    except OSError as error:
        return f"engine counters: /metrics unreadable ({error})"
    gauges = (line.split() for line in text.splitlines() if line.startswith("tpfuse_engine_"))
    found = {name.removeprefix("tpfuse_engine_"): value for name, *_, value in gauges}
    return "engine counters: " + ", ".join(f"{k} {found[k]}" for k in ENGINE_COUNTERS if k in found)


def serve_and_bench(args, server_args: list[str], label: str, out: Path, single: bool) -> Path:
    """Starts `tpfuse serve` with args' model/device/load format plus server_args, runs the single
    method (when `single`; into out/single_LABEL) and the sweep (into out/sweep_LABEL), stops the
    server; returns the sweep directory. args: warmups, runs, single_tokens, concurrency (text),
    repeats, sweep_tokens, requests_per_level, warmup_requests, input_len, seed, start_timeout."""
    from rich.console import Console

    from tpfuse.bench import (
        BenchOptions,
        ClientConfig,
        PromptConfig,
        SingleConfig,
        print_single,
        print_sweep,
        run_single,
        run_sweep,
        write_single,
        write_sweep,
    )
    from tpfuse.bench.report import format_run_line
    from tpfuse.server.launcher import ServerSubprocess

    console = Console(width=160)
    cmd = ["--device", args.device, "--model", args.model, "--load-format", args.load_format, *server_args]
    console.print(f"== {label}: tpfuse serve {' '.join(cmd)}")
    with ServerSubprocess(cmd, start_timeout=args.start_timeout) as server:
        if single:
            options = BenchOptions(ClientConfig(url=server.url), label=label)
            config = SingleConfig(args.warmups, args.runs, args.single_tokens)
            result = run_single(options, config, on_run=lambda r, n: console.print(format_run_line(r, n)))
            print_single(result, console)
            write_single(result, out / f"single_{label}")
        prompts = PromptConfig("random", input_len=args.input_len, seed=args.seed)
        options = BenchOptions(ClientConfig(url=server.url), prompts, label=label)
        concurrencies = tuple(int(c) for c in args.concurrency.split(","))
        config = ExactSweepConfig(
            concurrencies,
            requests_per_level=args.requests_per_level,
            repeats=args.repeats,
            max_tokens=args.sweep_tokens,
            warmup_requests=args.warmup_requests,
        )
        sweep = run_sweep(options, config)
        print_sweep(sweep, console)
        console.print(engine_counters(server.url))
        sweep_dir = out / f"sweep_{label}"
        write_sweep(sweep, sweep_dir)
    return sweep_dir


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--server-args", default="", help="extra `tpfuse serve` flags for configuration A")
    p.add_argument("--server-args-b", default=None, help="flags for configuration B (enables the compare)")
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--single-tokens", type=int, default=1024, help="0 skips the single-stream runs")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sweep-tokens", type=int, default=128)
    p.add_argument(
        "--requests-per-level",
        type=int,
        default=None,
        help="measured requests per repeat and level, exactly (default: 5 x C)",
    )
    p.add_argument("--warmup-requests", type=int, default=None, help="per level (default: C)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    args = p.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/out")) / "serve_bench"
    sweep_a = serve_and_bench(args, shlex.split(args.server_args), "a", out, args.single_tokens > 0)
    if args.server_args_b is None:
        return 0
    sweep_b = serve_and_bench(args, shlex.split(args.server_args_b), "b", out, False)
    from tpfuse.bench.cli import register

    parser = argparse.ArgumentParser(prog="tpfuse")
    register(parser.add_subparsers())
    cmp_args = parser.parse_args(
        ["bench", "compare", "--a", str(sweep_a), "--b", str(sweep_b), "--output-dir", str(out / "compare")]
    )
    return cmp_args.handler(cmp_args)


if __name__ == "__main__":
    sys.exit(main())
