"""One process per GPU over NCCL (a multi-GPU machine): create_communicator end to end across real
links, against float64 references and NCCL, with bit-identical ranks, back-to-back calls, graph
replays and a peer that stops answering. World sizes 2, 4 and 8, as far as the GPUs allow.
"""

from __future__ import annotations

import pytest
import torch

from tests.comm.reference import assert_close_to, fused64, repeat_and_replay_mismatches, sum64
from tests.comm.test_gpu_shared_processes import _inputs
from tests.helpers.dist import from_bytes, run_distributed, to_bytes

pytestmark = [pytest.mark.multigpu, pytest.mark.timeout(600)]
EPS = 1e-5
HIDDEN = 4096
TOKENS = (1, 2, 3, 17, 64, 255, 256)
WORLD_SIZES = [n for n in (2, 4, 8) if n <= torch.cuda.device_count()] or [2]


def _rank(rank, world_size, mode):
    from tpfuse.comm.factory import create_communicator

    device = torch.device("cuda", rank)
    comm = create_communicator(
        device=device, mode=mode, max_tokens=256, hidden_size=HIDDEN, dtype=torch.bfloat16
    )
    result = {"type": type(comm).__name__, "describe": comm.describe(), "fused": {}, "sum": {}}
    for call, tokens in enumerate(TOKENS):
        xs, residual, weight = _inputs(world_size, tokens, call)
        x = xs[rank].to(device)
        normed, new_residual = comm.fused_add_rmsnorm_all_reduce(
            x, residual.to(device), weight.to(device), EPS
        )
        result["fused"][tokens] = (normed.cpu(), new_residual.cpu())
        result["sum"][tokens] = comm.all_reduce(x).cpu()
    gathered = comm.all_gather(torch.full((3, 7), float(rank), device=device), dim=-1)
    result["gathered"] = gathered.cpu()
    xs, residual_cpu, weight_cpu = _inputs(world_size, 4, 0)
    x, residual, weight = xs[rank].to(device), residual_cpu.to(device), weight_cpu.to(device)
    result["back_to_back_mismatches"], result["graph_mismatches"] = repeat_and_replay_mismatches(
        comm, x, residual, weight, EPS
    )
    if hasattr(comm, "check"):
        comm.check()
    torch.distributed.barrier()  # peers' memory stays mapped until every rank is done with it
    return to_bytes(result)


@pytest.fixture(scope="module", params=[(n, m) for n in WORLD_SIZES for m in ("fused", "auto")],
                ids=lambda p: f"tp{p[0]}-{p[1]}")  # fmt: skip
def run(request):
    world_size, mode = request.param
    return world_size, mode, from_bytes(run_distributed(_rank, world_size, mode, timeout=540, backend="nccl"))


def test_every_rank_gets_the_communicator_the_mode_asks_for_and_the_same_plan(run):
    _, mode, results = run
    expected = (
        {"CustomCommunicator"} if mode == "fused" else {"CustomCommunicator", "TorchDistributedCommunicator"}
    )
    for r in results:
        assert r["type"] in expected, r["describe"]
        # the plan (which sizes go to tpfuse, which to NCCL) follows the first line, which names the rank
        assert r["describe"].split("\n")[1:] == results[0]["describe"].split("\n")[1:]
    print(results[0]["describe"])


def test_fused_matches_float64_and_is_bit_identical_on_every_rank(run):
    world_size, _, results = run
    for call, tokens in enumerate(TOKENS):
        xs, residual, weight = _inputs(world_size, tokens, call)
        normed64, residual64 = fused64(xs, residual, weight, EPS)
        for r in results:
            normed, new_residual = r["fused"][tokens]
            assert_close_to(new_residual, residual64)
            assert_close_to(normed, normed64, ulps=3)
            assert torch.equal(normed, results[0]["fused"][tokens][0])
            assert torch.equal(new_residual, results[0]["fused"][tokens][1])


def test_all_reduce_matches_float64_and_all_gather_is_in_rank_order(run):
    world_size, _, results = run
    for call, tokens in enumerate(TOKENS):
        xs, _, _ = _inputs(world_size, tokens, call)
        for r in results:
            assert_close_to(r["sum"][tokens], sum64(xs))
    expected = torch.cat([torch.full((3, 7), float(rank)) for rank in range(world_size)], dim=-1)
    for r in results:
        assert torch.equal(r["gathered"], expected)


def test_ten_thousand_calls_and_a_thousand_graph_replays_reproduce_the_first_call(run):
    _, _, results = run
    assert [r["back_to_back_mismatches"] for r in results] == [0] * len(results)
    assert [r["graph_mismatches"] for r in results] == [0] * len(results)


def _silent_peer_rank(rank, world_size):
    import time

    from tpfuse.comm.factory import create_communicator

    device = torch.device("cuda", rank)
    comm = create_communicator(device=device, mode="fused", max_tokens=8, hidden_size=HIDDEN,
                               dtype=torch.bfloat16, timeout_s=2.0)  # fmt: skip
    if rank == world_size - 1:
        time.sleep(15)  # alive (its memory stays mapped) but never calls again: a hung peer
        return "silent"
    x = torch.randn(1, HIDDEN, device=device, dtype=torch.bfloat16)
    comm.fused_add_rmsnorm_all_reduce(x, x, torch.ones(HIDDEN, device=device, dtype=torch.bfloat16), EPS)
    torch.cuda.synchronize()
    try:
        comm.check()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_peer_that_stops_answering_is_named_instead_of_a_hang():
    world_size = WORLD_SIZES[0]
    results = run_distributed(_silent_peer_rank, world_size, timeout=120, backend="nccl")
    for message in results[:-1]:
        assert f"rank {world_size - 1}" in message, message
