"""What the link probe's measurements mean for the schedules: a pure function, no GPU.

Two findings remove schedules from the candidate set (the measured race against the fallback still
decides among the rest, and the fallback always stays):
- write collapse: a rank writing to all its peers at once gets far less aggregate bandwidth than it
  gets writing to one (fan-out < COLLAPSE_FRACTION x its median pairwise write bandwidth). Removes the
  fan-out writers (one-shot, two-shot), and the hierarchical schedule unless writes fanned out inside
  the island do not collapse. Read collapse, the same test on reads, removes pull.
- peer stores through system memory: a peer write behaves like a write to pinned host memory
  (latency >= SYSMEM_LATENCY_FRACTION x the host-write latency while its bandwidth is no better than
  HOST_LIKE_BANDWIDTH x the host-write bandwidth; NVLink peers are far faster than host memory, so a
  fence-dominated latency there does not trigger it), or is far slower than a peer read of the same
  bytes (bandwidth < SYSMEM_BANDWIDTH_FRACTION x read bandwidth). Removes every schedule that stores data
  into peers (all but pull).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from tpfuse.comm.schedules import FAN_OUT_WRITES, ONE_WRITE_STREAM, READS, SCHEDULES

COLLAPSE_FRACTION = 0.5
SYSMEM_LATENCY_FRACTION = 0.8
SYSMEM_BANDWIDTH_FRACTION = 0.25
HOST_LIKE_BANDWIDTH = 1.25


@dataclass
class LinkMeasurements:
    """Matrices are [writer or reader rank][peer rank], None on the diagonal; per-rank lists by rank.
    Bandwidths in GB/s (1e9 bytes/s), latencies in microseconds."""

    world_size: int
    write_gbps: list[list[float | None]]
    read_gbps: list[list[float | None]]
    write_latency_us: list[list[float | None]]
    read_latency_us: list[list[float | None]]
    fanout_write_gbps: list[float]  # rank writes to every peer at once (aggregate)
    fanout_read_gbps: list[float]  # rank reads from every peer at once (aggregate)
    island_fanout_write_gbps: list[float | None] = field(default_factory=list)  # to its island peers
    host_write_gbps: list[float | None] = field(default_factory=list)  # into pinned host memory
    host_write_latency_us: list[float | None] = field(default_factory=list)
    bytes_per_transfer: int = 0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> LinkMeasurements:
        return cls(**data)


@dataclass
class ProbeDecision:
    findings: list[str]  # what was detected, with the numbers
    removed: dict[str, str]  # schedule -> why it left the candidate set
    kept: list[str]

    def to_json(self) -> dict:
        return asdict(self)


def _peers_of(row: list[float | None]) -> list[float]:
    return [v for v in row if v is not None]


def _collapsed(fanout: list[float | None], pairwise: list[list[float | None]], what: str) -> list[str]:
    found = []
    for rank, aggregate in enumerate(fanout):
        pairs = _peers_of(pairwise[rank])
        if aggregate is None or not pairs:
            continue
        single = statistics.median(pairs)
        if aggregate < COLLAPSE_FRACTION * single:
            found.append(
                f"{what} collapse on rank {rank}: {aggregate:.1f} GB/s to all peers at once vs "
                f"{single:.1f} GB/s to one (median), {100 * (1 - aggregate / single):.0f}% lost"
            )
    return found


def _through_system_memory(m: LinkMeasurements) -> list[str]:
    found = []
    for i in range(m.world_size):
        for j in range(m.world_size):
            w_lat, r_bw, w_bw = m.write_latency_us[i][j], m.read_gbps[i][j], m.write_gbps[i][j]
            host_lat = m.host_write_latency_us[i] if m.host_write_latency_us else None
            host_bw = m.host_write_gbps[i] if m.host_write_gbps else None
            if i == j or w_lat is None:
                continue
            host_like = host_bw is None or w_bw is None or w_bw <= HOST_LIKE_BANDWIDTH * host_bw
            if host_lat is not None and host_like and w_lat >= SYSMEM_LATENCY_FRACTION * host_lat:
                found.append(
                    f"peer stores {i}->{j} look routed through system memory: write latency {w_lat:.2f} us "
                    f"vs {host_lat:.2f} us into pinned host memory"
                )
            elif w_bw is not None and r_bw is not None and w_bw < SYSMEM_BANDWIDTH_FRACTION * r_bw:
                found.append(
                    f"peer stores {i}->{j} look routed through system memory: write {w_bw:.1f} GB/s vs read "
                    f"{r_bw:.1f} GB/s"
                )
    return found


def decide_candidates(m: LinkMeasurements, candidates: list[str] | tuple[str, ...]) -> ProbeDecision:
    """Which of `candidates` (schedule names) stay, from the measurements; the findings and reasons."""
    write_collapse = _collapsed(m.fanout_write_gbps, m.write_gbps, "write")
    read_collapse = _collapsed(m.fanout_read_gbps, m.read_gbps, "read")
    island_collapse = (
        _collapsed(m.island_fanout_write_gbps, m.write_gbps, "island write")
        if m.island_fanout_write_gbps
        else write_collapse
    )
    sysmem = _through_system_memory(m)
    removed: dict[str, str] = {}
    for name in candidates:
        traffic = SCHEDULES[name].traffic
        if sysmem and traffic in (FAN_OUT_WRITES, ONE_WRITE_STREAM):
            removed[name] = f"stores data into peers, and {sysmem[0]}"
        elif write_collapse and traffic == FAN_OUT_WRITES:
            if name == "hierarchical" and not island_collapse:
                continue
            removed[name] = f"writes to many peers at once, and {write_collapse[0]}"
        elif read_collapse and traffic == READS:
            removed[name] = f"reads many peers at once, and {read_collapse[0]}"
    findings = (
        write_collapse + [f for f in island_collapse if f not in write_collapse] + read_collapse + sysmem
    )
    kept = [n for n in candidates if n not in removed]
    return ProbeDecision(findings or ["no write collapse, read collapse or system-memory routing seen"],
                         removed, kept)  # fmt: skip
