"""Timing of GPU work: by CUDA-graph replay (graph_us: the kernel micro-benchmarks under benchmarks/
and the start-up choices of decode-sized products, model/linear_choice.py), or as the host issues it
(stream_us: start-up choices between a graph replay and eager launches, where the launches are part
of the cost, and of the prefill routes, which run eagerly).

At batch 1 a Triton launch from Python costs more than the kernel it launches, so timing eager calls
measures the launcher. Capturing the calls in one graph and replaying it measures the GPU alone.
"""

from __future__ import annotations

import statistics


def graph_us(calls, min_launches: int = 64, replays: int = 10, samples: int = 5) -> float:
    """Microseconds per call: the zero-argument `calls` captured round-robin into one CUDA graph
    (at least min_launches launches), replayed `replays` times per sample; the median of `samples`."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:  # compile and autotune outside the capture
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    launches = -(-min_launches // len(calls)) * len(calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * launches))
    del graph
    return statistics.median(times)


def stream_us(fn, repeats: int) -> float:
    """Microseconds per call of the zero-argument fn as the stream sees it, host launches included:
    CUDA events around `repeats` calls, after one untimed call."""
    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats
