"""GPU helpers of the virtual-rank tests (N ranks on N streams of one process, real concurrent spins):
running every rank at once, fresh inputs, checking the fused result against float64, and counting
mismatches over repeated calls and graph replays without a host sync per call."""

from __future__ import annotations

import time

import pytest
import torch

from tests.comm.reference import EPS, assert_close_to, fused64
from tpfuse.comm import launch

DEVICE = "cuda"


def on_streams(world_size, fn):
    """fn(rank) on rank's own stream, all ranks in flight together; returns the results in rank order."""
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in range(world_size)]
    results = []
    for rank, stream in enumerate(streams):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            results.append(fn(rank))
    for stream in streams:
        main.wait_stream(stream)
    torch.cuda.synchronize()
    return results


def cuda_randn(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def check_fused(outs, xs, residual, weight):
    """Every rank's (normed, new_residual) within ulps of float64, and bit-identical across ranks."""
    normed64, residual64 = fused64(xs, residual, weight, EPS)
    for normed, new_residual in outs:
        assert_close_to(new_residual, residual64)
        assert_close_to(normed, normed64, ulps=3)
        assert torch.equal(normed, outs[0][0]) and torch.equal(new_residual, outs[0][1]), "ranks disagree"


def count_mismatches(outs, expected):
    """Number of elements (a device tensor) where (normed, new_residual) differ from expected."""
    return (outs[0] != expected[0]).sum() + (outs[1] != expected[1]).sum()


def add_mismatches(mismatches, rank, outs, expected):
    """mismatches[rank] += count_mismatches(outs, expected): the counting the loops below run on each
    rank's stream. Rank r's slice starts 8 r bytes into the int64 counter, so the in-place add's kernel
    differs by rank (torch picks its vector width from pointer alignment: 16-byte aligned or not)."""
    mismatches[rank : rank + 1] += count_mismatches(outs, expected)


def load_counting_kernels(mismatches, expected):
    """Run add_mismatches once for every rank (adding 0) on the current stream, and synchronize.

    Call before calls_on_streams / replays_on_streams. With lazy CUDA module loading the first launch
    of a kernel blocks the host until the running kernels end; inside the loops rank 1's first count
    comes after ranks 0 and 1 launched their collectives, which spin until ranks 2.. launch, so an
    unloaded counting kernel there stalls them into their timeout and garbles that call. Every rank's
    own slice must be counted here, not only rank 0's: rank 1's (8 bytes in) needs a different kernel.
    """
    for rank in range(len(mismatches)):
        add_mismatches(mismatches, rank, expected[0], expected[0])
    if mismatches.is_cuda:
        torch.cuda.synchronize(mismatches.device)


def calls_on_streams(comms, streams, sets, residual, weight, expected, mismatches, calls=10_000):
    """`calls` back-to-back fused calls, interleaved rank by rank so that no rank's queue runs far ahead,
    call i on input set i % len(sets); adds each rank's mismatches against expected[i % len(sets)] into
    mismatches[rank] and synchronizes at the end. Run load_counting_kernels(mismatches, expected) first."""
    for i in range(calls):
        for r in range(len(comms)):
            with torch.cuda.stream(streams[r]):
                outs = comms[r].fused_add_rmsnorm_all_reduce(sets[i % len(sets)][r], residual, weight, EPS)
                add_mismatches(mismatches, r, outs, expected[i % len(sets)])
    torch.cuda.synchronize()


def replays_on_streams(graphs, streams, static_x, graph_outs, sets, expected, mismatches, replays=1000):
    """`replays` rounds: each rank copies input set i % len(sets) into its static input and replays its
    graph on its stream; adds its mismatches against expected into mismatches[rank]; synchronizes.
    Run load_counting_kernels(mismatches, expected) first."""
    for i in range(replays):
        for r in range(len(graphs)):
            with torch.cuda.stream(streams[r]):
                static_x[r].copy_(sets[i % len(sets)][r])
                graphs[r].replay()
                add_mismatches(mismatches, r, graph_outs[r], expected[i % len(sets)])
    torch.cuda.synchronize()


def assert_a_missing_peer_is_named(wss, algorithm):
    """Ranks 0 and 1 of three workspaces launch `algorithm` (rank 2 has crashed): the spin ends within
    20 s and both ranks' check() raises naming rank 2."""
    x = torch.randn(4, 256, device=DEVICE)
    started = time.monotonic()
    for rank in (0, 1):
        with torch.cuda.stream(torch.cuda.Stream()):
            launch.all_reduce(wss[rank], x, algorithm)
    torch.cuda.synchronize()
    assert time.monotonic() - started < 20, "the spin must be bounded"
    for ws in wss[:2]:
        with pytest.raises(RuntimeError, match="rank 2 never arrived"):
            ws.check()
