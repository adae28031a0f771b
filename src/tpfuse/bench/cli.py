"""`tpfuse bench single | sweep | compare`: argparse only at import; the work happens in handlers."""

from __future__ import annotations

import argparse
import sys
import time


def _concurrency_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1,2,4,8, got {text!r}"
        ) from None


def _gpu_list(text: str) -> list[int]:
    return list(_concurrency_list(text))


def _add_common(p: argparse.ArgumentParser, url_required: bool = True) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--url", required=url_required, help="server base URL, e.g. http://127.0.0.1:30000")
    g.add_argument("--model", default=None, help="model name to request (default: first id in /v1/models)")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument("--api-key", default=None)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--no-length-controls",
        action="store_true",
        help="do not send ignore_eos / min_tokens / continuous usage stats (outputs may stop early)",
    )
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to open a connection")
    g.add_argument(
        "--ready-timeout", type=float, default=10.0, help="seconds to wait for the server to answer"
    )
    d = p.add_argument_group("prompts")
    d.add_argument("--dataset", choices=("builtin", "random", "sharegpt"), default="builtin")
    d.add_argument("--input-len", type=int, default=128, help="random: prompt length in tokens")
    d.add_argument("--dataset-path", default=None, help="sharegpt: a local ShareGPT-format JSON file")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--tokenizer",
        default=None,
        help="client tokenizer: local HF dir, tpfuse preset, or none (default: the served model's name)",
    )
    o = p.add_argument_group("measurement and output")
    o.add_argument("--gpu-telemetry", choices=("auto", "on", "off"), default="auto")
    o.add_argument("--gpus", type=_gpu_list, default=None, help="GPU indices for telemetry, e.g. 0,1")
    o.add_argument("--confidence", type=float, default=0.95)
    o.add_argument("--label", default=None, help="configuration name in tables and plots")
    o.add_argument("--output-dir", default=None, help="default: bench-out/<mode>-<time>")


def _add_sweep_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--concurrency", type=_concurrency_list, default=None, help="levels (default 1,2,4,...,256)"
    )
    g.add_argument("--requests-per-level", type=int, default=None, help="per repeat; at least 5 x C are sent")
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--warmup-requests", type=int, default=None, help="per level (default: C)")


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server")
    modes = bench.add_subparsers(dest="bench_mode", metavar="MODE")
    bench.set_defaults(handler=lambda args: (bench.print_help(), 2)[1])

    single = modes.add_parser("single", help="W warm-ups, then N single-stream runs of L tokens")
    _add_common(single)
    single.add_argument("--warmups", type=int, default=2)
    single.add_argument("--runs", type=int, default=5)
    single.add_argument("--max-tokens", type=int, default=2048)
    single.set_defaults(handler=_handle_single)

    sweep = modes.add_parser("sweep", help="closed-loop concurrency sweep")
    _add_common(sweep)
    _add_sweep_args(sweep)
    sweep.set_defaults(handler=_handle_sweep)

    compare = modes.add_parser("compare", help="paired sweeps of two servers, or two saved sweeps")
    _add_common(compare, url_required=False)
    _add_sweep_args(compare)
    compare.add_argument("--url-b", default=None, help="second server (run both sweeps interleaved)")
    compare.add_argument("--model-b", default=None)
    compare.add_argument("--label-b", default=None)
    compare.add_argument(
        "--a", dest="saved_a", default=None, help="saved sweep A (directory or summary.json)"
    )
    compare.add_argument("--b", dest="saved_b", default=None, help="saved sweep B")
    compare.set_defaults(handler=_handle_compare)


def _options(args, url: str | None = None, model: str | None = None, label: str | None = None):
    from tpfuse.bench.client import ClientConfig
    from tpfuse.bench.prompts import PromptConfig
    from tpfuse.bench.session import BenchOptions

    client = ClientConfig(
        url=url or args.url,
        model=model or args.model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        temperature=args.temperature,
        length_controls=not args.no_length_controls,
        request_timeout_s=args.request_timeout,
        connect_timeout_s=args.connect_timeout,
    )
    prompts = PromptConfig(args.dataset, args.input_len, args.dataset_path, args.seed)
    return BenchOptions(
        client,
        prompts,
        tokenizer=args.tokenizer,
        ready_timeout_s=args.ready_timeout,
        gpu_telemetry=args.gpu_telemetry,
        gpus=args.gpus,
        confidence=args.confidence,
        label=label or args.label,
    )


def _sweep_config(args):
    from tpfuse.bench.sweep import DEFAULT_CONCURRENCIES, SweepConfig

    return SweepConfig(
        concurrencies=args.concurrency or DEFAULT_CONCURRENCIES,
        requests_per_level=args.requests_per_level,
        repeats=args.repeats,
        max_tokens=args.max_tokens,
        warmup_requests=args.warmup_requests,
    )


def _output_dir(args, mode: str) -> str:
    return args.output_dir or f"bench-out/{mode}-{time.strftime('%Y%m%d-%H%M%S')}"


def _error(mode: str, message: str) -> None:
    print(f"tpfuse bench {mode}: error: {message}", file=sys.stderr)


def _handle_single(args) -> int:
    from rich.console import Console

    from tpfuse.bench.client import ServerRejected, ServerUnreachable
    from tpfuse.bench.outputs import write_single
    from tpfuse.bench.report import format_run_line, print_single
    from tpfuse.bench.runs import SingleConfig, run_single

    try:
        options = _options(args)
        config = SingleConfig(args.warmups, args.runs, args.max_tokens)
    except ValueError as e:
        _error("single", str(e))
        return 2
    console = Console()
    try:
        result = run_single(
            options,
            config,
            on_run=lambda run, total: console.print(format_run_line(run, total), highlight=False),
            on_note=lambda text: console.print(f"[dim]{text}[/dim]"),
        )
    except (ServerUnreachable, ServerRejected) as e:
        _error("single", str(e))
        return 1
    except ValueError as e:  # the prompt set (--dataset-path) is read when the run starts
        _error("single", str(e))
        return 2
    print_single(result, console, show_notes=False)
    out = _output_dir(args, "single")
    write_single(result, out)
    console.print(f"results in {out}/ (summary.json, requests.jsonl, runs.csv, plots)")
    return 130 if result.interrupted else (0 if any(r.ok for r in result.runs) else 1)


def _handle_sweep(args) -> int:
    from rich.console import Console

    from tpfuse.bench.client import ServerRejected, ServerUnreachable
    from tpfuse.bench.outputs import write_sweep
    from tpfuse.bench.report import SweepProgress, print_sweep
    from tpfuse.bench.sweep import run_sweep

    try:
        options = _options(args)
        config = _sweep_config(args)
    except ValueError as e:
        _error("sweep", str(e))
        return 2
    console, out = Console(), _output_dir(args, "sweep")
    try:
        with SweepProgress() as progress:
            result = run_sweep(
                options,
                config,
                progress,
                on_point=lambda partial: write_sweep(partial, out, with_plots=False),
            )
    except (ServerUnreachable, ServerRejected) as e:
        _error("sweep", str(e))
        return 1
    except ValueError as e:  # the prompt set (--dataset-path) is read when the run starts
        _error("sweep", str(e))
        return 2
    print_sweep(result, console)
    write_sweep(result, out)
    console.print(f"results in {out}/ (summary.json, requests.jsonl, sweep.csv, plots)")
    return 130 if result.interrupted else (0 if result.points else 1)


def _handle_compare(args) -> int:
    from rich.console import Console

    from tpfuse.bench.client import ServerRejected, ServerUnreachable
    from tpfuse.bench.compare import find_crossover, load_saved_sweep, throughputs_from_points
    from tpfuse.bench.outputs import write_compare, write_sweep
    from tpfuse.bench.report import SweepProgress, print_crossover, print_sweep
    from tpfuse.bench.sweep import run_paired_sweeps

    console, out = Console(), _output_dir(args, "compare")
    if args.saved_a or args.saved_b:
        if not (args.saved_a and args.saved_b):
            _error("compare", "saved sweeps need both --a DIR_A and --b DIR_B")
            return 2
        try:
            label_a, points_a, summary_a = load_saved_sweep(args.saved_a)
            label_b, points_b, summary_b = load_saved_sweep(args.saved_b)
        except ValueError as e:
            _error("compare", str(e))
            return 2
        label_a, label_b = args.label or label_a, args.label_b or label_b
        if label_a == label_b:
            label_a, label_b = f"A: {label_a}", f"B: {label_b}"
        crossover = find_crossover(points_a, points_b, args.confidence)
        print_crossover(label_a, label_b, crossover, console)
        by_label = {label_a: summary_a["points"], label_b: summary_b["points"]}
        write_compare({"a": summary_a, "b": summary_b}, crossover, by_label, [], out)
        console.print(f"results in {out}/ (summary.json, compare.csv, plots)")
        return 0
    if not (args.url and args.url_b):
        _error("compare", "pass --url URL_A --url-b URL_B (live) or --a DIR_A --b DIR_B (saved sweeps)")
        return 2
    try:
        options_a = _options(args)
        options_b = _options(args, url=args.url_b, model=args.model_b, label=args.label_b)
        config = _sweep_config(args)
    except ValueError as e:
        _error("compare", str(e))
        return 2

    def save(a, b, with_plots: bool = False) -> None:
        write_sweep(a, f"{out}/a", with_plots)
        write_sweep(b, f"{out}/b", with_plots)

    try:
        with SweepProgress() as progress:
            a, b, interrupted = run_paired_sweeps(options_a, options_b, config, progress, on_point=save)
    except (ServerUnreachable, ServerRejected) as e:
        _error("compare", str(e))
        return 1
    except ValueError as e:  # the prompt set (--dataset-path) is read when the run starts
        _error("compare", str(e))
        return 2
    print_sweep(a, console)
    print_sweep(b, console)
    save(a, b, with_plots=True)
    crossover = find_crossover(
        throughputs_from_points(a.points), throughputs_from_points(b.points), args.confidence
    )
    print_crossover(a.label, b.label, crossover, console)
    summary = {"a": a.summary_dict(), "b": b.summary_dict(), "interrupted": interrupted}
    write_compare(summary, crossover, {a.label: a.points, b.label: b.points}, a.records + b.records, out)
    console.print(f"results in {out}/ (summary.json, compare.csv, plots; each sweep in a/ and b/)")
    return 130 if interrupted else 0
