"""After the gate, before the measured plan: which schedules a TP group may race.

configure_schedules (collective) gives the workspace its islands (`--allreduce-islands`, else derived
from the host topology), runs the link probe where the ranks have GPUs of their own, and removes from
the communicator's candidates the schedules the probe's findings rule out (link_decision.py).
"""

from __future__ import annotations

import torch

from tpfuse.comm import schedules
from tpfuse.comm.islands import Islands, format_islands, parse_islands


def _gpu_identity(device: torch.device) -> tuple[str, str]:
    import socket

    return socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid)


def derive_group_islands(identities: list[tuple[str, str]]) -> tuple[Islands | None, str]:
    """Islands of the ranks whose GPUs have these (host, uuid) identities, from NVML; (None, why) when
    the topology cannot be read or the ranks span hosts."""
    from tpfuse.comm.host_topology import derive_islands, read_host_topology

    if len({host for host, _ in identities}) > 1:
        return None, "ranks on several hosts: no islands derived"
    try:
        topology = read_host_topology()
    except RuntimeError as exc:
        return None, f"no islands: {exc}"
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(len(topology.gpus))]
    try:
        devices = [uuids.index(uuid) for _, uuid in identities]
    except ValueError:
        return None, "no islands: a rank's GPU is not visible to this process (CUDA_VISIBLE_DEVICES)"
    return derive_islands(topology, devices)


def resolve_islands(group, device: torch.device, override: str | None) -> tuple[Islands | None, str]:
    """Collective: the group's islands and why; the same on every rank (rank 0's view is used)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if override:
        return parse_islands(override, world), "from --allreduce-islands"
    identities: list = [None] * world
    dist.all_gather_object(identities, _gpu_identity(device), group=group)
    mine = derive_group_islands(identities)
    views: list = [None] * world
    dist.all_gather_object(views, mine, group=group)
    return views[0]


def configure_schedules(comm, group, device: torch.device, islands: str | None, probe: bool,
                        externals: tuple[int, int, torch.dtype] | None = None) -> None:  # fmt: skip
    """Collective: islands, then (probe=True) the link probe and its removals, on comm (a
    CustomCommunicator); with externals=(max_tokens, hidden, dtype), other libraries' all-reduces
    (external.py) join the candidates. Notes on comm.workspace.notes say what was found."""
    ws = comm.workspace
    if externals is not None:
        from tpfuse.comm.external import create_externals

        comm.externals, notes = create_externals(group, ws.rank, ws.world_size, *externals)
        ws.notes += notes
    found, why = resolve_islands(group, device, islands)
    if found is not None and len(found) >= 2:
        ws.set_islands(found)
        ws.notes.append(f"islands {format_islands(found)}: {why}")
    else:
        ws.notes.append(f"hierarchical schedule not a candidate: {why}")
    comm.candidates = tuple(schedules.available(ws))
    from tpfuse.comm.topology import GATE_SCHEDULES, self_test_vote

    for name in [c for c in comm.candidates if c not in GATE_SCHEDULES]:  # the gate tested the others
        failures = self_test_vote(ws, group, [name])
        if failures:
            comm.removed[name] = f"self-test failed: rank {failures[0][0]}: {failures[0][1]}"
            comm.candidates = tuple(c for c in comm.candidates if c != name)
    if not probe:
        return
    from tpfuse.comm.link_decision import decide_candidates
    from tpfuse.comm.link_probe import probe_links

    try:
        comm.links = probe_links(ws, group)
    except Exception as exc:  # noqa: BLE001 - a probe that cannot run leaves the candidates to measurement
        ws.notes.append(f"link probe failed ({type(exc).__name__}: {exc}); every schedule stays a candidate")
        return
    decision = decide_candidates(comm.links, comm.candidates)
    comm.probe_decision = decision
    comm.candidates = tuple(decision.kept)
    comm.removed.update(decision.removed)
    ws.notes += [f"link probe: {f}" for f in decision.findings]
