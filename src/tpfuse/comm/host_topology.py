"""Where each GPU sits: NUMA node, PCIe bus id, NVML common-ancestor level of each pair, NVLink; and the
islands derived from it.

NVML common-ancestor levels (nvmlGpuTopologyLevel_t; `nvidia-smi topo -m` letters):
0 same board, 10 one PCIe switch (PIX), 20 several switches (PXB), 30 one host bridge (PHB),
40 host bridges of one NUMA node (NODE), 50 across NUMA nodes / sockets (SYS).

Islands (derive_islands): the coarsest split that still separates the GPUs. Pairs joined by NVLink
count as level 0. For each level L in 40, 30, 20, 10 (coarsest first) the GPUs are grouped by "joined
by a path of pairs at level <= L"; the first L that gives two or more groups gives the islands (two
sockets: the sockets; two switches under one socket: the switches). If no level splits them (one
switch, NVLink everywhere), there is one island and the hierarchical schedule is not a candidate.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from tpfuse.comm.islands import Islands

LEVEL_NAMES = {
    0: "same board",
    10: "one PCIe switch",
    20: "several PCIe switches",
    30: "one PCIe host bridge",
    40: "host bridges of one NUMA node",
    50: "across NUMA nodes",
}
SPLIT_LEVELS = (40, 30, 20, 10)


@dataclass
class GpuPlacement:
    index: int
    bus_id: str  # PCI bus id as NVML gives it, e.g. "00000000:1B:00.0"
    numa_node: int | None  # None: unknown (no NUMA information)
    name: str = ""


@dataclass
class HostTopology:
    """gpus in CUDA index order; ancestor[i][j]: NVML level of GPUs i, j (0 on the diagonal);
    nvlink[i][j]: an NVLink path between them."""

    gpus: list[GpuPlacement]
    ancestor: list[list[int]]
    nvlink: list[list[bool]]
    source: str = "nvml"
    notes: list[str] = field(default_factory=list)

    def level(self, i: int, j: int) -> int:
        """Effective level: 0 for the same GPU or an NVLink pair, else the NVML level."""
        return 0 if i == j or self.nvlink[i][j] else self.ancestor[i][j]

    def describe_pair(self, i: int, j: int) -> str:
        if self.nvlink[i][j]:
            return "NVLink"
        level = self.ancestor[i][j]
        return f"PCIe ({LEVEL_NAMES.get(level, f'level {level}')})"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> HostTopology:
        gpus = [GpuPlacement(**g) for g in data["gpus"]]
        return cls(gpus, data["ancestor"], data["nvlink"], data.get("source", "json"), data.get("notes", []))

    @classmethod
    def load(cls, path: str) -> HostTopology:
        with open(path) as f:
            return cls.from_json(json.load(f))


def _groups(indices: list[int], joined) -> list[list[int]]:
    """Connected components of `indices` under joined(i, j), each sorted, ordered by first member."""
    groups: list[list[int]] = []
    for i in indices:
        touching = [g for g in groups if any(joined(i, j) for j in g)]
        merged = sorted({i, *(j for g in touching for j in g)})
        groups = [g for g in groups if g not in touching] + [merged]
    return sorted(groups, key=lambda g: g[0])


def derive_islands(topology: HostTopology, devices: list[int] | None = None) -> tuple[Islands, str]:
    """Islands of the ranks whose GPUs are `devices` (rank r on CUDA device devices[r]; default one rank
    per GPU) and the reason. Ranks that share a GPU are always in one island."""
    devices = list(range(len(topology.gpus))) if devices is None else list(devices)
    for d in devices:
        if not 0 <= d < len(topology.gpus):
            raise ValueError(f"device {d} is not in the topology ({len(topology.gpus)} GPUs)")
    ranks = list(range(len(devices)))
    for level in SPLIT_LEVELS:
        groups = _groups(ranks, lambda a, b, L=level: topology.level(devices[a], devices[b]) <= L)
        if len(groups) >= 2:
            worst = max(topology.level(devices[a], devices[b]) for a in ranks for b in ranks)
            reason = (
                f"GPUs joined at '{LEVEL_NAMES.get(level)}' or closer form {len(groups)} islands; "
                f"between them: '{LEVEL_NAMES.get(worst, worst)}'"
            )
            return tuple(tuple(g) for g in groups), reason
    return (tuple(ranks),), "one island: no PCIe level splits these GPUs (one switch, or NVLink)"


def _numa_node(pynvml, handle, bus_id: str) -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetNumaNodeId(handle))
    except Exception:  # noqa: BLE001 - older drivers / bindings: read sysfs instead
        pass
    short = bus_id.lower()[-12:]  # "0000:1b:00.0"
    try:
        with open(f"/sys/bus/pci/devices/{short}/numa_node") as f:
            node = int(f.read().strip())
        return None if node < 0 else node
    except (OSError, ValueError):
        return None


def read_host_topology(device_count: int | None = None) -> HostTopology:
    """The topology of the visible CUDA devices from NVML. Raises RuntimeError naming the problem when
    NVML is not usable (install nvidia-ml-py)."""
    import torch

    try:
        import pynvml
    except ImportError as exc:
        raise RuntimeError("NVML bindings missing: pip install nvidia-ml-py") from exc
    n = torch.cuda.device_count() if device_count is None else device_count
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no NVML library or driver: no topology, say why
        raise RuntimeError(f"NVML unavailable: {type(exc).__name__}: {exc}") from exc
    try:
        handles, gpus = [], []
        for i in range(n):
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(i).uuid}")
            bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
            bus = bus.decode() if isinstance(bus, bytes) else bus
            handles.append(handle)
            gpus.append(GpuPlacement(i, bus, _numa_node(pynvml, handle, bus), torch.cuda.get_device_name(i)))
        ancestor = [[0] * n for _ in range(n)]
        nvlink = [[False] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                level = int(pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j]))
                status = pynvml.nvmlDeviceGetP2PStatus(
                    handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK
                )
                ancestor[i][j] = ancestor[j][i] = level
                nvlink[i][j] = nvlink[j][i] = status == pynvml.NVML_P2P_STATUS_OK
        return HostTopology(gpus, ancestor, nvlink)
    except Exception as exc:  # noqa: BLE001 - any NVML failure: no topology, with the reason
        raise RuntimeError(f"NVML topology query failed: {type(exc).__name__}: {exc}") from exc
    finally:
        pynvml.nvmlShutdown()
