"""`tpfuse doctor`, `tpfuse comm-bench` and `tpfuse comm-model` (argparse only here; torch and triton
load in the handlers)."""

from __future__ import annotations

import argparse

DEFAULT_TOKENS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"
DEFAULT_HIDDENS = "4096,5120,7168,8192"


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    """One integer >= 1 (a size, a rank count)."""
    values = _ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return values[0]


def register(subparsers) -> None:
    doctor = subparsers.add_parser(
        "doctor", help="what your GPUs, links and software can run, and what tpfuse uses"
    )
    doctor.add_argument("--json", action="store_true", help="one JSON document instead of text")
    doctor.add_argument("--no-self-test", action="store_true", help="skip the kernel self-test on GPU 0")
    doctor.add_argument(
        "--tp-size", type=_positive, default=None,
        help="also build the all-reduce N ranks would use here (gate, islands, link probe, measured plan) "
        "and show its plan per size bucket with the reason for each choice",
    )  # fmt: skip
    doctor.add_argument("--hidden", type=_positive, default=4096, help="hidden size of the plan's messages")
    doctor.add_argument("--max-tokens", type=_positive, default=256, help="largest decode batch of the plan")
    doctor.add_argument("--allreduce-islands", default=None, help="islands for the plan, e.g. '0,1;2,3'")
    doctor.set_defaults(handler=_doctor)

    bench = subparsers.add_parser(
        "comm-bench",
        help="all-reduce latency: NCCL, torch symmetric memory, tpfuse one-shot / two-shot / fused",
    )
    ranks = bench.add_argument_group("ranks (default: one process per GPU)")
    ranks.add_argument(
        "--nproc", type=int, default=0, help="processes; more than the GPUs means they share GPUs"
    )
    ranks.add_argument("--ranks-per-gpu", type=int, default=0, help="processes per GPU (sets --nproc)")
    ranks.add_argument("--virtual-ranks", type=int, default=0, help="ranks on streams of GPU 0, one process")
    bench.add_argument("--tokens", type=_ints, default=_ints(DEFAULT_TOKENS))
    bench.add_argument("--hidden", type=_ints, default=_ints(DEFAULT_HIDDENS))
    bench.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    bench.add_argument("--iters", type=int, default=50, help="calls per captured CUDA graph")
    bench.add_argument("--repeats", type=int, default=10, help="graph replays; the median is reported")
    bench.add_argument("--json", action="store_true", help="one JSON document (environment + rows)")
    bench.set_defaults(handler=_comm_bench)

    model = subparsers.add_parser(
        "comm-model", help="the all-reduce cost model's predictions for a named or described topology"
    )
    model.add_argument(
        "--topology",
        default="rtx-pro-6000-8x-2socket",
        help="a name (rtx-pro-6000-8x-2socket, rtx-pro-6000-8x-2socket-collapse, rtx-pro-6000-4x, "
        "h200-8x-nvlink) or a JSON file in the cost model's topology form",
    )
    model.add_argument("--rows", type=_ints, default=_ints("1,2,4,8,16,32,64,128,256,512"))
    model.add_argument("--hidden", type=_positive, default=6144)
    model.add_argument("--layers", type=_positive, default=61, help="decoder layers, for the per-step gain")
    model.add_argument("--json", action="store_true", help="one JSON document instead of text")
    model.set_defaults(handler=_comm_model)


def _doctor(args) -> int:
    import json

    from tpfuse.comm.doctor import doctor_report, format_report

    report = doctor_report(
        self_test=not args.no_self_test, tp_size=args.tp_size, hidden=args.hidden,
        max_tokens=args.max_tokens, islands=args.allreduce_islands,
    )  # fmt: skip
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def _comm_model(args) -> int:
    import json
    import sys

    from tpfuse.comm.model_report import format_text, model_json
    from tpfuse.comm.topologies import load_topology

    try:
        topology = load_topology(args.topology)
    except ValueError as exc:
        print(f"tpfuse comm-model: {exc}", file=sys.stderr)
        return 2
    report = model_json(topology, args.rows, args.hidden, args.layers)
    print(json.dumps(report, indent=1) if args.json else format_text(report))
    return 0


def _comm_bench(args) -> int:
    from tpfuse.comm.bench import BenchConfig, run

    nproc = args.nproc
    if args.ranks_per_gpu:
        import torch

        nproc = args.ranks_per_gpu * max(1, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    cfg = BenchConfig(
        tokens=args.tokens,
        hiddens=args.hidden,
        dtype=args.dtype,
        iters=args.iters,
        repeats=args.repeats,
        nproc=nproc,
        virtual_ranks=args.virtual_ranks,
    )
    return run(cfg, args.json)
