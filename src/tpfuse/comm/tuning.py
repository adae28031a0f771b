"""The start-up measurement: time every algorithm per size bucket on this machine, agree across ranks.

Runs before any model CUDA graph is captured (it captures and replays graphs of its own). Every rank
runs the same calls in the same order; each bucket's times are all-reduced with MAX (the slowest rank
speaks for the group), so all ranks reach the same plan.
"""

from __future__ import annotations

import statistics

import torch

from tpfuse.comm import launch
from tpfuse.comm.plan import FALLBACK, OPS, Bucket, Plan, bucket_tokens, decide


def agree_max(values: list[float], group) -> list[float]:
    """Element-wise maximum over the group (same list on every rank)."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu().tolist()


def time_per_call_us(fn, iters: int = 50, repeats: int = 5, use_graph: bool = True, barrier=None) -> float:
    """Median over `repeats` of the mean time of `iters` back-to-back calls of fn, in microseconds.

    With use_graph the calls are captured in one CUDA graph and replayed, so host launch cost is not
    measured. barrier() (if given) runs before every timed replay, to line the ranks up."""
    fn()
    torch.cuda.synchronize()
    graph = None
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        torch.cuda.synchronize()
    samples = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(iters):
                fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def candidates(comm, op: str, x, residual, weight):
    """name -> zero-argument call, for one op: the custom algorithms still in comm.candidates that can
    carry x, and (if any) the fallback."""
    ws = comm.workspace
    calls = {}
    for algorithm in comm.candidates:
        if not launch.fits(ws, x, algorithm):
            continue
        if op == "all_reduce":
            calls[algorithm] = lambda a=algorithm: launch.all_reduce(ws, x, a)
        else:
            calls[algorithm] = lambda a=algorithm: launch.fused_add_rmsnorm(ws, x, residual, weight, 1e-6, a)
    for name, external in comm.externals.items():
        if external.fits(x):
            calls[name] = (
                (lambda e=external: e.all_reduce(x))
                if op == "all_reduce"
                else (lambda e=external: e.fused_add_rmsnorm(x, residual, weight, 1e-6))
            )
    if comm.fallback is not None:
        fb = comm.fallback
        calls[FALLBACK] = (
            (lambda: fb.all_reduce(x))
            if op == "all_reduce"
            else (lambda: fb.fused_add_rmsnorm_all_reduce(x, residual, weight, 1e-6))
        )
    return calls


def measure_plan(
    comm, group, hidden: int, dtype: torch.dtype, max_tokens: int, fallback_graphs: bool
) -> Plan:
    """Measure every bucket of 1, 2, 4 ... max_tokens rows of `hidden` (those that fit the workspace).

    comm: a CustomCommunicator whose fallback (if any) is included in the race. fallback_graphs: whether
    the fallback can be captured in a CUDA graph (NCCL can; gloo through CPU copies cannot, and is then
    timed eagerly)."""
    import torch.distributed as dist

    ws = comm.workspace
    row_bytes = hidden * torch.tensor([], dtype=dtype).element_size()
    plan = Plan(comm.fallback_name)
    generator = torch.Generator(device=ws.device).manual_seed(1234)
    for op in OPS:
        for tokens in bucket_tokens(max_tokens):
            if tokens * row_bytes > ws.layout.slot_bytes:
                break
            x = torch.randn(tokens, hidden, device=ws.device, dtype=dtype, generator=generator)
            residual = torch.randn(tokens, hidden, device=ws.device, dtype=dtype, generator=generator)
            weight = torch.ones(hidden, device=ws.device, dtype=dtype)
            calls = candidates(comm, op, x, residual, weight)
            local = [
                time_per_call_us(
                    fn,
                    use_graph=name != FALLBACK or fallback_graphs,
                    barrier=lambda: dist.barrier(group=group),
                )
                for name, fn in calls.items()
            ]
            ws.check()
            timings = dict(zip(calls, agree_max(local, group), strict=True))
            algorithm, reason = decide(timings)
            plan.buckets.append(Bucket(op, tokens * row_bytes, tokens, algorithm, timings, reason))
    return plan
