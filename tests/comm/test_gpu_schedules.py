"""The PCIe-class schedules on one GPU: virtual ranks (streams of one process, real concurrent spins) and
processes sharing the GPU, against float64, under repetition and graph replay, and with a crashed peer.

Every schedule of comm/schedules.py runs here (one_shot / two_shot again beside the new ones), the
hierarchical one over unequal islands. Virtual ranks: 2, 4 and 8; 10,000 back-to-back calls and 1,000
replays of a captured graph per schedule at 4 ranks. Processes (2, time-sliced, ~2 ms a call): float64
at 1, 5 and 31 rows (31: the most whose float32 partials fit), 1,000 calls and 100 graph replays per schedule.
"""

from __future__ import annotations

import pytest
import torch

from tests.comm.reference import assert_close_to, fused64, poisoned, sum64
from tests.comm.virtual_ranks import (
    assert_a_missing_peer_is_named,
    calls_on_streams,
    check_fused,
    cuda_randn,
    load_counting_kernels,
    on_streams,
    replays_on_streams,
)
from tests.helpers.dist import run_distributed
from tpfuse.comm import launch
from tpfuse.comm.hybrid import create_virtual_communicators, programs_per_rank
from tpfuse.comm.plan import OPS, Bucket, Plan, bucket_tokens
from tpfuse.comm.schedules import ALGORITHMS
from tpfuse.comm.workspace import create_virtual_workspaces

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
EPS = 1e-5
DEVICE = "cuda"
ISLANDS = {2: ((0,), (1,)), 3: ((0, 1), (2,)), 4: ((0, 1, 2), (3,)), 8: ((0, 1, 2, 3, 4), (5, 6, 7))}


def _workspaces(world_size, max_tokens, hidden, timeout_s=10.0):
    programs = programs_per_rank(torch.device(DEVICE), world_size)
    wss = create_virtual_workspaces(world_size, DEVICE, max_tokens * hidden * 4, programs, timeout_s)
    for ws in wss:
        ws.set_islands(ISLANDS[world_size])
    return wss


def forced_plan(algorithm, row_bytes, max_tokens):
    """Every bucket up to max_tokens rows on `algorithm` (virtual ranks have no fallback)."""
    buckets = [
        Bucket(op, t * row_bytes, t, algorithm, reason="forced")
        for op in OPS
        for t in bucket_tokens(max_tokens)
    ]
    return Plan("none", buckets)


def _fused(wss, xs, residual, weight, algorithm):
    outputs = [
        (poisoned(xs[0].shape, xs[0].dtype).cuda(), poisoned(xs[0].shape, xs[0].dtype).cuda()) for _ in wss
    ]
    return on_streams(
        len(wss),
        lambda r: launch.fused_add_rmsnorm(
            wss[r], xs[r], residual, weight, EPS, algorithm, outputs=outputs[r]
        ),
    )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_every_schedule_matches_float64_and_is_bit_identical(world_size, algorithm):
    hidden = 6144 if world_size == 8 else 4097
    wss = _workspaces(world_size, 64, hidden)
    weight = cuda_randn(hidden, dtype=torch.bfloat16)
    for tokens in (1, 3, 17, 64):
        xs = [cuda_randn(tokens, hidden, dtype=torch.bfloat16) for _ in range(world_size)]
        residual = cuda_randn(tokens, hidden, dtype=torch.bfloat16)
        check_fused(_fused(wss, xs, residual, weight, algorithm), xs, residual, weight)
        outs = [poisoned(xs[0].shape, torch.bfloat16).cuda() for _ in wss]
        on_streams(world_size, lambda r: launch.all_reduce(wss[r], xs[r], algorithm, out=outs[r]))  # noqa: B023
        for out in outs:
            assert_close_to(out, sum64(xs))
            assert torch.equal(out, outs[0])
    for ws in wss:
        ws.check()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_ten_thousand_calls_and_a_thousand_graph_replays_stay_exact(algorithm):
    world_size, tokens, hidden = 4, 4, 4096
    comms = create_virtual_communicators(world_size, DEVICE, 64, hidden, torch.bfloat16)
    for comm in comms:
        comm.workspace.set_islands(ISLANDS[world_size])
        comm.plan = forced_plan(algorithm, hidden * 2, 64)
    sets = [[cuda_randn(tokens, hidden, dtype=torch.bfloat16) for _ in range(world_size)] for _ in range(4)]
    residual, weight = (
        cuda_randn(tokens, hidden, dtype=torch.bfloat16),
        cuda_randn(hidden, dtype=torch.bfloat16),
    )
    expected = []
    for xs in sets:
        outs = on_streams(
            world_size, lambda r, xs=xs: comms[r].fused_add_rmsnorm_all_reduce(xs[r], residual, weight, EPS)
        )
        check_fused(outs, xs, residual, weight)
        expected.append(outs[0])
    mismatches = torch.zeros(world_size, dtype=torch.int64, device=DEVICE)
    load_counting_kernels(mismatches, expected)  # every rank's counting kernel, before any rank spins
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in range(world_size)]
    for s in streams:
        s.wait_stream(main)
    calls_on_streams(comms, streams, sets, residual, weight, expected, mismatches)
    for comm in comms:  # a spin that timed out names the rank it waited for, before the counts
        comm.check()
    assert mismatches.tolist() == [0] * world_size, "back-to-back calls"
    static_x = [sets[0][r].clone() for r in range(world_size)]
    graphs, graph_outs = [], []
    for r in range(world_size):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=streams[r]):
            graph_outs.append(comms[r].fused_add_rmsnorm_all_reduce(static_x[r], residual, weight, EPS))
        graphs.append(graph)
    epoch_before = [int(c.workspace.words[0]) for c in comms]
    mismatches.zero_()
    torch.cuda.synchronize()
    replays_on_streams(graphs, streams, static_x, graph_outs, sets, expected, mismatches)
    for comm in comms:
        comm.check()
    assert mismatches.tolist() == [0] * world_size, "graph replays"
    assert [int(c.workspace.words[0]) - e for c, e in zip(comms, epoch_before, strict=True)] == [
        1000
    ] * world_size


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_peer_that_never_arrives_times_out_and_is_named(algorithm):
    assert_a_missing_peer_is_named(_workspaces(3, 4, 256, timeout_s=0.5), algorithm)


def _shared_rank(rank, world_size):
    import torch.distributed as dist

    from tests.comm.reference import repeat_and_replay_mismatches
    from tpfuse.comm.factory import create_communicator

    torch.cuda.set_device(0)
    hidden = 4096
    comm = create_communicator(device="cuda:0", max_tokens=64, hidden_size=hidden, dtype=torch.bfloat16)
    comm.workspace.set_islands(ISLANDS[world_size])
    results = {}
    for algorithm in ALGORITHMS:
        comm.plan = forced_plan(algorithm, hidden * 2, 64)
        calls = {}
        for tokens in (1, 5, 31):
            g = torch.Generator().manual_seed(1000 * tokens + rank)
            x = torch.randn(tokens, hidden, generator=g).bfloat16()
            residual = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).bfloat16()
            weight = torch.randn(hidden, generator=torch.Generator().manual_seed(7)).bfloat16()
            normed, new_residual = comm.fused_add_rmsnorm_all_reduce(
                x.cuda(), residual.cuda(), weight.cuda(), EPS
            )
            calls[tokens] = (x, residual, weight, normed.cpu(), new_residual.cpu())
        x, residual, weight = (t.cuda() for t in calls[5][:3])
        repeats = repeat_and_replay_mismatches(comm, x, residual, weight, EPS, calls=1000, replays=100)
        comm.check()
        results[algorithm] = (calls, repeats)
    dist.barrier()
    return results


def test_processes_sharing_the_gpu_run_every_schedule_exactly():
    world_size = 2
    results = run_distributed(_shared_rank, world_size, timeout=280)
    for algorithm in ALGORITHMS:
        for tokens in (1, 5, 31):
            xs = [results[r][algorithm][0][tokens][0] for r in range(world_size)]
            _, residual, weight, _, _ = results[0][algorithm][0][tokens]
            normed64, residual64 = fused64(xs, residual, weight, EPS)
            for r in range(world_size):
                normed, new_residual = results[r][algorithm][0][tokens][3:]
                assert_close_to(new_residual, residual64)
                assert_close_to(normed, normed64, ulps=3)
                assert torch.equal(normed, results[0][algorithm][0][tokens][3]), (algorithm, "ranks disagree")
        assert [results[r][algorithm][1] for r in range(world_size)] == [(0, 0)] * world_size, algorithm


def test_link_probe_over_virtual_ranks_measures_every_pair_and_keeps_every_schedule():
    from tpfuse.comm.link_decision import decide_candidates
    from tpfuse.comm.link_probe import probe_virtual

    wss = _workspaces(4, 64, 4096)
    links = probe_virtual(wss)
    for matrix in (links.write_gbps, links.read_gbps, links.write_latency_us, links.read_latency_us):
        values = [v for i, row in enumerate(matrix) for j, v in enumerate(row) if i != j]
        assert len(values) == 12 and all(0 < v < 1e6 for v in values), matrix
    assert all(v > 0 for v in links.fanout_write_gbps + links.fanout_read_gbps + links.host_write_gbps)
    # one GPU's own memory: far faster than pinned host memory over PCIe, no collapse, no host routing
    assert min(v for row in links.write_gbps for v in row if v) > max(links.host_write_gbps)
    assert decide_candidates(links, ALGORITHMS).removed == {}, decide_candidates(links, ALGORITHMS).findings
