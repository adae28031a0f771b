"""A cost model of the all-reduce schedules and NCCL on a described topology: the starting guess
before measurement (the start-up race decides; this never does). docs/PCIE.md lists every assumption,
the published figures it was checked against and how far each prediction falls.

Time of one all-reduce of n bytes per rank (W ranks, islands of sizes k_i), in microseconds:
  fan_out(T, b)  a rank writes b bytes to every rank of T at once: max(|T| b / B_out, b / B_pair(worst),
                 ingress) with B_out = the best pair write bandwidth of T, times collapse_factor when T
                 spans two or more islands (write collapse); ingress = the same bytes into one GPU's link
  one_shot       kernel + round + fan_out(all peers, n)
  two_shot       kernel + 2 round + 2 fan_out(all peers, n / W)
  staged         kernel + sum over the W - 1 stages of (round + latency + n / B_pair(stage)); a stage
                 that crosses islands for some rank moves at the across bandwidth and latency
  ordered_push   kernel + round + worst latency + sum over stages of n / B_pair(stage) (posted writes
                 pipeline: only one latency)
  hierarchical   kernel + 2 round + fan_out(island peers, n) + fan_out(exchange targets, 4 n / elem)
  pull           kernel + round + read latency + the fan-in of reads, W - 1 n at the read bandwidth
                 (times read_collapse_factor)
  nccl ring      min over LL, Simple of 2 (W - 1) step_p + 2 (W - 1) / W n / (ring_gbps eff_p)
  nccl tree      the same with 2 ceil(log2 W) steps and 2 n bytes per rank (for reference: NCCL
                 uses rings inside one node)
The fused path adds nothing (the epilogue is in the kernel); NCCL's path adds norm_kernel_us.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

SCHEDULE_ORDER = ("one_shot", "two_shot", "staged", "ordered_push", "hierarchical", "pull")


@dataclass(frozen=True)
class PathModel:
    write_gbps: float
    read_gbps: float
    write_latency_us: float
    read_latency_us: float


@dataclass(frozen=True)
class NcclModel:
    ring_gbps: float  # bandwidth of the ring's slowest hop
    ll_step_us: float
    simple_step_us: float
    ll_efficiency: float = 0.5  # LL moves 4 data bytes per 8-byte store
    simple_efficiency: float = 1.0


@dataclass(frozen=True)
class TopologyModel:
    name: str
    islands: tuple[tuple[int, ...], ...]
    inside: PathModel  # between GPUs of one island
    across: PathModel  # between islands
    link_gbps: float  # each GPU's own link, per direction
    kernel_us: float  # one kernel in a CUDA graph: launch gap + epilogue at decode sizes
    round_us: float  # one flag round: release fence, posted flag write, poll, skew between ranks
    nccl: NcclModel
    norm_kernel_us: float = 2.5  # the residual add + RMSNorm kernel after an unfused all-reduce
    collapse_factor: float = 1.0  # fan-out write bandwidth kept when the targets span islands
    read_collapse_factor: float = 1.0
    description: str = ""
    sources: list[str] = field(default_factory=list, compare=False)

    @property
    def world_size(self) -> int:
        return sum(len(i) for i in self.islands)

    def island_of(self, rank: int) -> int:
        return next(k for k, island in enumerate(self.islands) if rank in island)

    def path(self, a: int, b: int) -> PathModel:
        return self.inside if self.island_of(a) == self.island_of(b) else self.across

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TopologyModel:
        data = dict(data)
        data["islands"] = tuple(tuple(i) for i in data["islands"])
        data["inside"], data["across"] = PathModel(**data["inside"]), PathModel(**data["across"])
        data["nccl"] = NcclModel(**data["nccl"])
        return cls(**data)


def _us(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * 1e3)  # GB/s = 1e3 bytes per microsecond


def fan_out_us(t: TopologyModel, rank: int, targets: list[int], nbytes: float) -> float:
    if not targets:
        return 0.0
    best = max(t.path(rank, j).write_gbps for j in targets)
    spans = len({t.island_of(j) for j in targets} | {t.island_of(rank)}) > 1 and len(targets) > 1
    aggregate = min(best, t.link_gbps) * (t.collapse_factor if spans else 1.0)
    slowest = max(_us(nbytes, t.path(rank, j).write_gbps) for j in targets)
    ingress = _us(len(targets) * nbytes, t.link_gbps)
    worst_latency = max(t.path(rank, j).write_latency_us for j in targets)
    return worst_latency + max(_us(len(targets) * nbytes, aggregate), slowest, ingress)


def _worst(t: TopologyModel, per_rank) -> float:
    return max(per_rank(r) for r in range(t.world_size))


def _stage_us(t: TopologyModel, stage: int, nbytes: float, latency: bool = True) -> float:
    w = t.world_size
    paths = [t.path(r, (r + stage) % w) for r in range(w)]
    return max(p.write_latency_us * latency + _us(nbytes, p.write_gbps) for p in paths)


def _exchange_targets(t: TopologyModel, rank: int) -> list[int]:
    from tpfuse.comm.islands import exchange_source

    own = t.islands[t.island_of(rank)]
    return [y for other in t.islands if other is not own for y in other
            if exchange_source(t.islands, y, own) == rank]  # fmt: skip


def schedule_us(t: TopologyModel, name: str, nbytes: float, elem_bytes: int = 2) -> float:
    """Predicted microseconds of one all-reduce of nbytes per rank with schedule `name`."""
    w = t.world_size
    peers = lambda r: [j for j in range(w) if j != r]  # noqa: E731
    if name == "one_shot":
        return t.kernel_us + t.round_us + _worst(t, lambda r: fan_out_us(t, r, peers(r), nbytes))
    if name == "two_shot":
        return t.kernel_us + 2 * t.round_us + 2 * _worst(t, lambda r: fan_out_us(t, r, peers(r), nbytes / w))
    if name == "staged":
        return t.kernel_us + sum(t.round_us + _stage_us(t, s, nbytes) for s in range(1, w))
    if name == "ordered_push":
        latency = max(t.path(r, j).write_latency_us for r in range(w) for j in range(w) if j != r)
        return t.kernel_us + t.round_us + latency + sum(_stage_us(t, s, nbytes, False) for s in range(1, w))
    if name == "hierarchical":
        if len(t.islands) < 2:
            return math.inf
        island_peers = lambda r: [j for j in t.islands[t.island_of(r)] if j != r]  # noqa: E731
        partial = nbytes * 4 / elem_bytes
        return (t.kernel_us + 2 * t.round_us + _worst(t, lambda r: fan_out_us(t, r, island_peers(r), nbytes))
                + _worst(t, lambda r: fan_out_us(t, r, _exchange_targets(t, r), partial)))  # fmt: skip
    if name == "pull":

        def reads(r):
            sources = peers(r)
            best = max(t.path(r, j).read_gbps for j in sources)
            spans = len({t.island_of(j) for j in sources} | {t.island_of(r)}) > 1
            aggregate = min(best, t.link_gbps) * (t.read_collapse_factor if spans else 1.0)
            latency = max(t.path(r, j).read_latency_us for j in sources)
            return latency + max(_us(len(sources) * nbytes, aggregate),
                                 max(_us(nbytes, t.path(r, j).read_gbps) for j in sources))  # fmt: skip

        return t.kernel_us + t.round_us + _worst(t, reads)
    raise ValueError(f"no cost model for schedule {name!r}; known: {SCHEDULE_ORDER}")


def nccl_us(t: TopologyModel, nbytes: float, algorithm: str = "ring") -> float:
    """Predicted NCCL all-reduce microseconds (min over the LL and Simple protocols)."""
    w, n = t.world_size, t.nccl
    steps = 2 * (w - 1) if algorithm == "ring" else 2 * math.ceil(math.log2(w))
    moved = 2 * (w - 1) / w * nbytes if algorithm == "ring" else 2 * nbytes
    ll = steps * n.ll_step_us + _us(moved, n.ring_gbps * n.ll_efficiency)
    simple = steps * n.simple_step_us + _us(moved, n.ring_gbps * n.simple_efficiency)
    return min(ll, simple)


def predict(t: TopologyModel, rows: list[int], hidden: int, elem_bytes: int = 2) -> list[dict]:
    """One row per message: bytes, each schedule's time, NCCL ring / tree, the best fused schedule and
    its gain over NCCL + the norm kernel (microseconds)."""
    table = []
    for r in rows:
        nbytes = r * hidden * elem_bytes
        times = {name: round(schedule_us(t, name, nbytes, elem_bytes), 2) for name in SCHEDULE_ORDER}
        times = {k: v for k, v in times.items() if math.isfinite(v)}
        best = min(times, key=times.get)
        nccl = round(nccl_us(t, nbytes), 2)
        tree = round(nccl_us(t, nbytes, "tree"), 2)
        table.append({
            "rows": r, "bytes": nbytes, **times, "nccl_ring": nccl, "nccl_tree": tree, "best_fused": best,
            "fused_gain_us": round(nccl + t.norm_kernel_us - times[best], 2),
        })  # fmt: skip
    return table


def crossover_bytes(t: TopologyModel, a: str, b: str, lo: int = 256, hi: int = 64 << 20) -> int | None:
    """Smallest message (bytes, to 1%) from which schedule b is faster than a; None if never in range."""
    cost = lambda name, n: nccl_us(t, n) if name == "nccl" else schedule_us(t, name, n)  # noqa: E731
    if cost(b, hi) >= cost(a, hi):
        return None
    if cost(b, lo) < cost(a, lo):
        return lo
    while hi > lo * 1.01:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost(b, mid) >= cost(a, mid) else (lo, mid)
    return int(hi)
