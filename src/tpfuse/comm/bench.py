"""`tpfuse comm-bench`: all-reduce latency of every path, side by side, median over CUDA-graph replays.

Columns (microseconds per call): NCCL all_reduce; NCCL all_reduce + the separate fused add+RMSNorm
kernel; torch symmetric-memory one_shot / two_shot (and one_shot + norm) where available; tpfuse
one-shot, two-shot, fused one-shot, fused two-shot; and `chosen`, the path the Communicator's rule
picks for the fused op (a custom kernel only where it beats NCCL + norm).

Ranks are one process per GPU, N processes over the GPUs (several per GPU when N exceeds them), or N
virtual ranks on N streams of one process. When ranks share a GPU the numbers are kernel latency
under sharing, not a link measurement, and the output says so.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from tpfuse.comm.bench_rows import (  # noqa: F401 (METHODS, SHARED_WARNING, chosen_method: the results' vocabulary)
    METHODS,
    SHARED_WARNING,
    _inputs,
    _row,
    chosen_method,
    environment,
    tpfuse_calls,
)


@dataclass
class BenchConfig:
    tokens: list[int]
    hiddens: list[int]
    dtype: str = "bfloat16"
    iters: int = 50  # calls per captured graph
    repeats: int = 10  # graph replays; the median is reported
    nproc: int = 0  # processes (0: one per GPU)
    virtual_ranks: int = 0  # > 0: this many ranks on streams of GPU 0, one process

    @property
    def max_bytes(self) -> int:
        import torch

        return (
            max(self.tokens)
            * max(self.hiddens)
            * torch.tensor([], dtype=getattr(torch, self.dtype)).element_size()
        )


def time_virtual(calls_per_rank: list, iters: int, repeats: int) -> float:
    """All ranks' calls concurrently, each rank on its own stream and graph; microseconds per call."""
    import torch

    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in calls_per_rank]
    for fn, stream in zip(calls_per_rank, streams, strict=True):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            fn()
    torch.cuda.synchronize()
    graphs = []
    for fn, stream in zip(calls_per_rank, streams, strict=True):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(iters):
                fn()
        graphs.append(graph)
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        for graph, stream in zip(graphs, streams, strict=True):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                graph.replay()
        for stream in streams:
            main.wait_stream(stream)
        end.record(main)
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def bench_virtual(cfg: BenchConfig) -> dict:
    import torch

    from tpfuse.comm.workspace import create_virtual_workspaces

    n = cfg.virtual_ranks
    dtype = getattr(torch, cfg.dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wss = create_virtual_workspaces(n, "cuda:0", cfg.max_bytes, max(1, min(64, sms // n)), timeout_s=30.0)
    rows = []
    for hidden in cfg.hiddens:
        for tokens in cfg.tokens:
            inputs = [_inputs(tokens, hidden, dtype, "cuda:0", r) for r in range(n)]
            calls = [tpfuse_calls(wss[r], *inputs[r]) for r in range(n)]
            row = _row(n, tokens, hidden, dtype)
            for name in calls[0]:
                row[name] = round(time_virtual([c[name] for c in calls], cfg.iters, cfg.repeats), 2)
            for ws in wss:
                ws.check()
            row["chosen"] = chosen_method(row)
            rows.append(row)
    unavailable = {m: "virtual ranks live in one process: no process group" for m in METHODS[:5]}
    return {"environment": environment(n, "virtual ranks on streams of GPU 0", True), "rows": rows,
            "unavailable": unavailable, "config": asdict(cfg)}  # fmt: skip


def format_table(result: dict) -> str:
    """The rows as a fixed-width table (us; '-' where a method is unavailable), warning first."""
    env = result["environment"]
    lines = []
    if env.get("warning"):
        lines += ["!" * 72, f"!! {env['warning'].upper()}", "!" * 72]
    lines.append(f"{env['gpu']} x{env['gpus']}  {env['layout']}  world size {env['world_size']}  "
                 f"torch {env['torch']}  triton {env['triton']}")  # fmt: skip
    header = ["tp", "tokens", "hidden", "bytes", *METHODS, "chosen"]
    widths = [max(len(h), 8) for h in header]
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in result["rows"]:
        cells = [("-" if row.get(h) is None else str(row[h])) for h in header]
        lines.append("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    for method, why in result.get("unavailable", {}).items():
        lines.append(f"{method}: {why}")
    return "\n".join(lines)


def bench_processes(cfg: BenchConfig, timeout_s: float = 3600.0) -> dict:
    """One process per rank (cfg.nproc, default one per GPU); rank 0's result."""
    import torch

    from tpfuse.comm.bench_ranks import rank_main
    from tpfuse.comm.spawn_ranks import run_spawned_ranks

    world_size = cfg.nproc or torch.cuda.device_count()
    status, payload = run_spawned_ranks(rank_main, world_size, asdict(cfg), timeout_s)
    if status != "ok":
        raise RuntimeError(f"comm-bench rank failed: {payload}")
    return payload


def run(cfg: BenchConfig, as_json: bool) -> int:
    """The comm-bench command: exit code 0, or 2 (with a message) when there is no GPU."""
    import json
    import sys

    import torch

    if not torch.cuda.is_available():
        print("tpfuse comm-bench needs CUDA GPUs and found none (run `tpfuse doctor`)", file=sys.stderr)
        return 2
    if cfg.virtual_ranks and cfg.nproc:
        print("give either --virtual-ranks or --nproc/--ranks-per-gpu, not both", file=sys.stderr)
        return 2
    if not cfg.virtual_ranks and (cfg.nproc or torch.cuda.device_count()) < 2:
        print(
            "one GPU: run ranks on it with --virtual-ranks N (streams of one process) or --nproc N "
            "(processes sharing it)",
            file=sys.stderr,
        )
        return 2
    result = bench_virtual(cfg) if cfg.virtual_ranks else bench_processes(cfg)
    print(json.dumps(result, indent=1) if as_json else format_table(result))
    return 0
