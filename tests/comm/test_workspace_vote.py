"""create_process_workspace's collective decisions, over gloo on CPU with stand-in peer-memory openers:
the backend is chosen by a vote of all ranks, and every rank gets the same layout."""

from __future__ import annotations

import weakref

import pytest
import torch

from tests.helpers.dist import run_distributed


def _fake_opener(nbytes, device, group):
    import torch.distributed as dist

    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    return buffer, [buffer.data_ptr()] * dist.get_world_size(group), []


def _failing_on_rank_1(nbytes, device, group):
    import torch.distributed as dist

    if dist.get_rank(group) == 1:
        raise OSError("no peer access on this rank")
    return _fake_opener(nbytes, device, group)


def _with_openers(rank, symm, ipc):
    from tpfuse.comm import peer_memory
    from tpfuse.comm.workspace import create_process_workspace

    peer_memory.open_symmetric = {"fake": _fake_opener, "flaky": _failing_on_rank_1}[symm]
    peer_memory.open_ipc = {"fake": _fake_opener, "flaky": _failing_on_rank_1}[ipc]
    try:
        # ranks ask for different sizes on purpose: the layout must still agree
        ws = create_process_workspace(
            None, torch.device("cpu"), 4096 * (rank + 1), 8 + rank, backends=SYMM_FIRST
        )
    except RuntimeError as exc:
        return str(exc)
    return ws.backend, ws.layout, ws.notes


SCENARIOS = (("flaky", "fake"), ("fake", "fake"), ("flaky", "flaky"))
SYMM_FIRST = ("symm_mem", "cuda_ipc")  # the vote is tested with symm_mem failing first


def _all_scenarios(rank, world_size):
    return [_with_openers(rank, symm, ipc) for symm, ipc in SCENARIOS]


@pytest.fixture(scope="module")
def outcomes():
    per_rank = run_distributed(_all_scenarios, 2)
    return {scenario: [r[i] for r in per_rank] for i, scenario in enumerate(SCENARIOS)}


def test_a_backend_that_fails_on_one_rank_is_used_by_no_rank(outcomes):
    results = outcomes[("flaky", "fake")]
    assert [r[0] for r in results] == ["cuda_ipc", "cuda_ipc"]
    assert all("symm_mem not used: rank 1: OSError: no peer access" in r[2][0] for r in results)


def test_every_rank_gets_the_same_layout_from_the_smallest_request(outcomes):
    results = outcomes[("fake", "fake")]
    layouts = [r[1] for r in results]
    assert layouts[0] == layouts[1]
    assert layouts[0].max_programs == 8 and layouts[0].slot_bytes == 4096


def test_when_no_backend_works_every_rank_raises_with_each_reason(outcomes):
    results = outcomes[("flaky", "flaky")]
    for message in results:
        assert "no peer-memory backend works" in message
        assert "symm_mem not used" in message and "cuda_ipc not used" in message


class _EarlierGroup:
    """Stands for a process group of the same name, created (and destroyed) before this one."""


def _after_an_earlier_group(rank, world_size):
    """Rank 0's process saw symm_mem used by another (since destroyed) group, as when a second engine
    starts in the process of the first; its workers are fresh processes. The name does not matter:
    on the H200 the hang came back with the new group under a name check."""
    import torch.distributed as dist

    from tpfuse.comm import peer_memory, workspace

    peer_memory.open_symmetric = peer_memory.open_ipc = _fake_opener
    name = dist.group.WORLD.group_name + "-of-an-earlier-engine"
    earlier = _EarlierGroup()
    if rank == 0:
        workspace._SYMMETRIC_GROUPS[name] = weakref.ref(earlier)
    del earlier  # destroyed and collected: torch still holds its store under the name
    cpu = torch.device("cpu")
    stale = workspace.create_process_workspace(None, cpu, 4096, 8, backends=SYMM_FIRST)
    workspace._SYMMETRIC_GROUPS.clear()
    fresh = workspace.create_process_workspace(None, cpu, 4096, 8, backends=SYMM_FIRST)
    again = workspace.create_process_workspace(None, cpu, 4096, 8, backends=SYMM_FIRST)  # same live group
    return stale.backend, stale.notes, fresh.backend, again.backend


def test_an_earlier_group_in_a_process_moves_every_rank_off_symmetric_memory():
    results = run_distributed(_after_an_earlier_group, 2)
    assert [r[0] for r in results] == ["cuda_ipc", "cuda_ipc"]
    for _, notes, _, _ in results:
        assert "symm_mem not used: rank 0: an earlier process group" in notes[0]
    assert [(r[2], r[3]) for r in results] == [("symm_mem", "symm_mem")] * 2


def test_ranks_sharing_one_gpu_try_cuda_ipc_first_and_separate_gpus_symmetric_memory():
    # IPC keeps no process-wide state (symmetric memory's made a second engine in a process hang on
    # one GPU); across GPUs symmetric memory maps every buffer for every device
    from tpfuse.comm.workspace import PEER_MEMORY_ORDER, PEER_MEMORY_ORDER_ONE_GPU

    assert PEER_MEMORY_ORDER_ONE_GPU == ("cuda_ipc", "symm_mem")
    assert PEER_MEMORY_ORDER == ("symm_mem", "cuda_ipc")
