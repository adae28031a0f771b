"""Every schedule over real links (one process per GPU, NCCL group): forced per schedule against
float64, islands from --allreduce-islands, and the link probe's record on the communicator."""

from __future__ import annotations

import pytest
import torch

from tests.comm.reference import assert_close_to, fused64
from tests.comm.test_gpu_schedules import forced_plan
from tests.comm.test_gpu_shared_processes import _inputs
from tests.helpers.dist import from_bytes, run_distributed, to_bytes
from tpfuse.comm.schedules import ALGORITHMS

pytestmark = [pytest.mark.multigpu, pytest.mark.timeout(600)]
EPS = 1e-5
HIDDEN = 4096
TOKENS = (1, 5, 31)
WORLD = min(8, torch.cuda.device_count()) if torch.cuda.is_available() else 2


def _rank(rank, world_size):
    from tpfuse.comm.factory import create_communicator

    device = torch.device("cuda", rank)
    half = world_size // 2
    islands = f"{','.join(map(str, range(half)))};{','.join(map(str, range(half, world_size)))}"
    comm = create_communicator(device=device, max_tokens=64, hidden_size=HIDDEN, dtype=torch.bfloat16,
                               islands=islands)  # fmt: skip
    result = {"describe": comm.describe(), "islands": comm.workspace.islands, "fused": {}}
    result["probe"] = comm.links.to_json() if comm.links is not None else None
    for algorithm in ALGORITHMS:
        comm.plan = forced_plan(algorithm, HIDDEN * 2, 64)
        for call, tokens in enumerate(TOKENS):
            xs, residual, weight = _inputs(world_size, tokens, call)
            normed, new_residual = comm.fused_add_rmsnorm_all_reduce(
                xs[rank].to(device), residual.to(device), weight.to(device), EPS
            )
            result["fused"][(algorithm, tokens)] = (normed.cpu(), new_residual.cpu())
        comm.check()
    torch.distributed.barrier()
    return to_bytes(result)


@pytest.fixture(scope="module")
def run():
    return from_bytes(run_distributed(_rank, WORLD, timeout=540, backend="nccl"))


def test_every_schedule_over_real_links_matches_float64_and_ranks_agree(run):
    for algorithm in ALGORITHMS:
        for call, tokens in enumerate(TOKENS):
            xs, residual, weight = _inputs(WORLD, tokens, call)
            normed64, residual64 = fused64(xs, residual, weight, EPS)
            for r in run:
                normed, new_residual = r["fused"][(algorithm, tokens)]
                assert_close_to(new_residual, residual64)
                assert_close_to(normed, normed64, ulps=3)
                assert torch.equal(normed, run[0]["fused"][(algorithm, tokens)][0]), algorithm


def test_the_islands_flag_reaches_the_workspace_and_the_probe_measured_every_pair(run):
    half = WORLD // 2
    assert run[0]["islands"] == (tuple(range(half)), tuple(range(half, WORLD)))
    probe = run[0]["probe"]
    assert probe is not None, run[0]["describe"]
    pairs = [v for i, row in enumerate(probe["write_gbps"]) for j, v in enumerate(row) if i != j]
    assert len(pairs) == WORLD * (WORLD - 1) and all(v > 0 for v in pairs)
    print(run[0]["describe"])
