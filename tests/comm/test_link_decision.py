"""The link probe's decisions from injected measurements (the measuring part runs on the GPU)."""

from __future__ import annotations

from tpfuse.comm.link_decision import LinkMeasurements, decide_candidates
from tpfuse.comm.schedules import ALGORITHMS


def _links(world=8, write=55.0, read=52.0, write_lat=0.4, read_lat=0.9, fanout_write=56.0, fanout_read=54.0,
           island_write=56.0, host_gbps=50.0, host_lat=1.6):  # fmt: skip
    def matrix(v):
        return [[None if i == j else v for j in range(world)] for i in range(world)]

    return LinkMeasurements(
        world, matrix(write), matrix(read), matrix(write_lat), matrix(read_lat), [fanout_write] * world,
        [fanout_read] * world, [island_write] * world, [host_gbps] * world, [host_lat] * world, 1 << 20,
    )  # fmt: skip


def test_healthy_links_keep_every_candidate():
    decision = decide_candidates(_links(), ALGORITHMS)
    assert decision.kept == list(ALGORITHMS) and decision.removed == {}
    assert "no write collapse" in decision.findings[0]


def test_write_collapse_removes_the_fan_out_writers_and_keeps_staged_and_pull():
    # 75-93% of the bandwidth lost on all-to-all writes (the published hosts); reads fine
    links = _links(fanout_write=8.0, island_write=8.0)
    decision = decide_candidates(links, ALGORITHMS)
    assert set(decision.removed) == {"one_shot", "two_shot", "hierarchical"}
    assert decision.kept == ["staged", "ordered_push", "pull"]
    assert "write collapse on rank 0: 8.0 GB/s to all peers at once vs 55.0 GB/s" in decision.findings[0]
    assert "85% lost" in decision.removed["one_shot"]


def test_hierarchical_stays_when_writes_inside_an_island_do_not_collapse():
    decision = decide_candidates(_links(fanout_write=8.0, island_write=50.0), ALGORITHMS)
    assert "hierarchical" in decision.kept and "one_shot" in decision.removed


def test_read_collapse_removes_pull_only():
    decision = decide_candidates(_links(fanout_read=3.0), ALGORITHMS)
    assert list(decision.removed) == ["pull"]


def test_peer_stores_as_slow_as_host_memory_leave_only_pull():
    # stores routed through system memory: peer write latency like a host write, bandwidth down
    decision = decide_candidates(_links(write=45.0, write_lat=1.5), ALGORITHMS)
    assert decision.kept == ["pull"]
    assert "routed through system memory" in decision.removed["staged"]
    assert "1.50 us vs 1.60 us" in decision.findings[0]


def test_nvlink_peers_far_faster_than_host_memory_are_not_flagged_for_a_slow_fence():
    decision = decide_candidates(_links(write=300.0, read=300.0, write_lat=1.7, fanout_write=600.0,
                                        fanout_read=600.0, island_write=600.0), ALGORITHMS)  # fmt: skip
    assert decision.removed == {}


def test_write_bandwidth_far_below_read_bandwidth_is_also_system_memory_routing():
    decision = decide_candidates(_links(write=3.5, read=52.0, host_lat=None), ALGORITHMS)
    assert decision.kept == ["pull"]
    assert "write 3.5 GB/s vs read 52.0 GB/s" in decision.findings[0]


def test_only_the_given_candidates_are_considered():
    decision = decide_candidates(_links(fanout_write=8.0), ("one_shot", "pull"))
    assert decision.kept == ["pull"] and list(decision.removed) == ["one_shot"]


def test_measurements_round_trip_through_json():
    links = _links(world=3)
    assert LinkMeasurements.from_json(links.to_json()) == links
