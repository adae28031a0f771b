"""comm/spawn_ranks.py (comm-bench over processes and doctor --tp-size share it) on CPU: every rank is
started with its rank, the world size, one port and the config, and the first report comes back."""

from __future__ import annotations

from tpfuse.comm.spawn_ranks import run_spawned_ranks


def _report(rank, world_size, port, cfg, queue):
    if rank == world_size - 1:
        queue.put(("ok", {"rank": rank, "world_size": world_size, "port": port, "cfg": cfg}))


def test_the_ranks_get_rank_world_size_port_and_config_and_one_report_returns():
    status, payload = run_spawned_ranks(_report, 3, {"hidden": 64}, timeout_s=120)
    assert status == "ok"
    assert payload["rank"] == 2 and payload["world_size"] == 3 and payload["cfg"] == {"hidden": 64}
    assert 0 < payload["port"] < 65536
