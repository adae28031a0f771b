"""Islands: `--allreduce-islands` parsing, the hierarchical plan table, and islands derived from NVML
topologies of the three host types (hand-written fixtures in the JSON format read_host_topology records).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tpfuse.comm.host_topology import HostTopology, derive_islands
from tpfuse.comm.islands import NO_ISLAND, OWN, island_plan, parse_islands

FIXTURES = Path(__file__).parent / "fixtures"


def _topology(name):
    return HostTopology.load(str(FIXTURES / f"{name}.json"))


def test_islands_flag_syntax_gives_the_partition():
    assert parse_islands("0,1,2,3;4,5,6,7", 8) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert parse_islands("0,2; 1", 3) == ((0, 2), (1,))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,1;1,2", r"repeated \[1\]"),
        ("0,1", r"missing \[2, 3\]"),
        ("0,1,2,3,4", r"out of range \[4\]"),
        ("0,a;1", "expected ranks separated by ','"),
    ],
)
def test_bad_islands_are_refused_naming_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        parse_islands(text, 4)


def test_plan_table_every_rank_hears_one_partial_per_other_island():
    islands = ((0, 1, 2), (3, 4))
    plans = {r: island_plan(islands, r, 5) for r in range(5)}
    # rank 2 (index 2 of a 3-island) hears island 1 from index 2 % 2 = 0, i.e. rank 3
    assert plans[2][3:] == [OWN, 3, NO_ISLAND, NO_ISLAND, NO_ISLAND]
    assert plans[3][3:5] == [0, OWN] and plans[4][3:5] == [1, OWN]
    for r, plan in plans.items():
        island_mask, send, receive = plan[:3]
        for y in range(5):
            heard_by_y = plans[y][2]
            assert bool(send >> y & 1) == bool(heard_by_y >> r & 1), (r, y)
        assert bin(receive).count("1") == 1
    assert plans[3][1] == (1 << 0) | (1 << 2), "rank 3 sends to ranks 0 and 2 of the larger island"


def test_one_switch_host_is_one_island():
    islands, reason = derive_islands(_topology("single_switch_4gpu"))
    assert islands == ((0, 1, 2, 3),) and "one island" in reason


def test_two_switches_under_one_socket_split_at_the_switches():
    islands, reason = derive_islands(_topology("two_switches_one_socket_8gpu"))
    assert islands == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert "one PCIe host bridge" in reason


def test_two_sockets_split_at_the_sockets_not_the_switches():
    topology = _topology("two_sockets_8gpu")
    islands, reason = derive_islands(topology)
    assert islands == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert "across NUMA nodes" in reason
    assert [g.numa_node for g in topology.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_islands_follow_the_ranks_gpus_and_ranks_sharing_a_gpu_stay_together():
    topology = _topology("two_sockets_8gpu")
    # TP 4 on GPUs 0, 5, 1, 5: ranks 0 and 2 on socket 0, ranks 1 and 3 (sharing GPU 5) on socket 1
    assert derive_islands(topology, [0, 5, 1, 5])[0] == ((0, 2), (1, 3))
    # TP 3 of one socket splits at its switches: GPUs 0, 1 share a switch, GPU 2 is on the other
    assert derive_islands(topology, [0, 1, 2])[0] == ((0, 1), (2,))


def test_nvlink_everywhere_is_one_island():
    topology = _topology("two_sockets_8gpu")
    topology.nvlink = [[True] * 8 for _ in range(8)]
    assert derive_islands(topology)[0] == (tuple(range(8)),)


def test_topology_round_trips_through_json():
    topology = _topology("two_switches_one_socket_8gpu")
    again = HostTopology.from_json(topology.to_json())
    assert again.ancestor == topology.ancestor and again.gpus == topology.gpus
    assert again.describe_pair(0, 4) == "PCIe (one PCIe host bridge)"


def test_without_nvml_the_topology_read_fails_with_a_reason_and_no_islands_are_derived(monkeypatch):
    import sys

    from tpfuse.comm.host_topology import read_host_topology
    from tpfuse.comm.link_setup import derive_group_islands

    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(RuntimeError, match="nvidia-ml-py"):
        read_host_topology(0)
    islands, why = derive_group_islands([("host", "uuid-a"), ("host", "uuid-b")])
    assert islands is None and "nvidia-ml-py" in why
    assert derive_group_islands([("a", "u"), ("b", "u")])[1] == "ranks on several hosts: no islands derived"
