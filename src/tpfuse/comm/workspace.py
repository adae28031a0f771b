"""Peer-visible buffers: one per rank, every rank holding a table of all ranks' buffer addresses.

Layout of each rank's buffer (bytes; every region 256-byte aligned):

    control  [64 x int32]                      epoch, finished-program count, error word (local use)
    probe    [MAX_WORLD x uint32]               written by peers in the peer-access test
    flags    [kinds][max_programs][world] u32   set by peers with release stores
    data     [2 parities][world][slot_bytes]   one-shot pushes, two-shot scatter, all-gather
    gather   [2 parities][slot_bytes]          two-shot: reduced chunks pushed by their owners

The data and gather regions alternate by the parity of the epoch, so a rank that is one call ahead
never overwrites what a slower rank is still reading.

Three ways to build the set of buffers, one class for all of them (RankWorkspace):
- virtual ranks: N ranks of one process (streams of one GPU, or CPU tensors under the interpreter);
- one process per rank: torch symmetric memory where it works, CUDA IPC handles otherwise (the same
  code serves several processes sharing one GPU). Which one was used, and why not the other, is kept.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from tpfuse.comm.sync import CTRL_ERROR, NUM_FLAG_KINDS

MAX_WORLD = 31  # error word bits name ranks
DEFAULT_TIMEOUT_S = 30.0

# torch symmetric memory keeps process-wide rendezvous state (a map from group name to the store it
# rendezvouses through, never replaced). A second engine created in the same process, after the first
# one's group was destroyed, hung in symm_mem.rendezvous on the H200 while its fresh workers waited;
# keying the rule on the group name did not prevent it (the hang came back with a name check in
# place), so any earlier group rules symm_mem out for every later one in this process. Group name ->
# a weak reference to each group that used it here (weak, so no destroyed group is kept alive).
_SYMMETRIC_GROUPS: dict[str, weakref.ref] = {}
# Which peer-memory backend to try first. Ranks on separate GPUs: torch symmetric memory, which maps
# each buffer for every device (an IPC mapping needs peer access from the reading device). Ranks that
# all share one GPU (tests, `--devices 0,0`): CUDA IPC, which keeps no process-wide state.
PEER_MEMORY_ORDER = ("symm_mem", "cuda_ipc")
PEER_MEMORY_ORDER_ONE_GPU = ("cuda_ipc", "symm_mem")


def _align(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class WorkspaceLayout:
    world_size: int
    slot_bytes: int  # largest message (bytes) the kernels can carry
    max_programs: int  # most programs a launch may use (flags are per program)
    ctrl_off: int = 0
    probe_off: int = 256
    flag_off: int = 0
    data_off: int = 0
    gather_off: int = 0
    total_bytes: int = 0

    @classmethod
    def build(cls, world_size: int, slot_bytes: int, max_programs: int) -> WorkspaceLayout:
        if not 1 <= world_size <= MAX_WORLD:
            raise ValueError(f"world size {world_size} is not supported by tpfuse's kernels (1..{MAX_WORLD})")
        slot_bytes = _align(max(slot_bytes, 256))
        flag_off = _align(256 + 4 * MAX_WORLD)
        data_off = flag_off + _align(NUM_FLAG_KINDS * max_programs * world_size * 4)
        gather_off = data_off + 2 * world_size * slot_bytes
        total = gather_off + 2 * slot_bytes
        return cls(world_size, slot_bytes, max_programs, 0, 256, flag_off, data_off, gather_off, total)


@dataclass
class RankWorkspace:
    """One rank's view of the workspace: its own buffer and the address of every rank's buffer.

    buffer: [total_bytes] uint8 on this rank's device (zeroed before first use);
    peer_table: [world_size] int64 on the same device, byte address of rank j's buffer as seen here.
    """

    rank: int
    layout: WorkspaceLayout
    buffer: torch.Tensor
    peer_table: torch.Tensor
    backend: str  # "virtual", "symm_mem" or "cuda_ipc"
    timeout_s: float = DEFAULT_TIMEOUT_S
    notes: list[str] = field(default_factory=list)  # why other backends were not used
    keep_alive: list = field(default_factory=list)  # peer tensors / handles the addresses point into
    islands: tuple | None = None  # rank islands for the hierarchical schedule (set_islands); None: none
    island_plan: torch.Tensor | None = None  # [world_size + 3] int32 on the device, islands.island_plan

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def words(self) -> torch.Tensor:
        """The buffer as int32 words (the kernels' handle on the control block)."""
        return self.buffer.view(torch.int32)

    def timeout_for_kernel(self, interpret: bool) -> int:
        """Spin bound passed to kernels: nanoseconds on the GPU, iterations under the interpreter."""
        return 2 if interpret else int(self.timeout_s * 1e9)

    def set_islands(self, islands) -> None:
        """Use `islands` (a partition of the ranks, every rank the same) for the hierarchical schedule.
        Call before any CUDA graph capture: it copies the plan table to the device."""
        from tpfuse.comm.islands import island_plan, validate_islands

        self.islands = validate_islands(islands, self.world_size)
        plan = island_plan(self.islands, self.rank, self.world_size)
        self.island_plan = torch.tensor(plan, dtype=torch.int32, device=self.device)

    def error_mask(self) -> int:
        """Bitmask of ranks whose flags never arrived (synchronises with the device)."""
        return int(self.words[CTRL_ERROR.value].item()) & 0xFFFFFFFF

    def check(self) -> None:
        """Raises RuntimeError naming the ranks that never arrived, if a spin timed out on this rank."""
        mask = self.error_mask()
        if mask:
            missing = [r for r in range(self.world_size) if mask >> r & 1]
            who = ", ".join(str(r) for r in missing)
            raise RuntimeError(
                f"tpfuse all-reduce on rank {self.rank}: rank {who} never arrived within {self.timeout_s:g}s "
                "(their flags in this rank's buffer were not set); the peer process has probably crashed or "
                "hung. The communicator is unusable: restart the tensor-parallel group."
            )


def _new_buffer(layout: WorkspaceLayout, device: torch.device) -> torch.Tensor:
    return torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)


def create_virtual_workspaces(
    world_size: int,
    device: torch.device | str,
    slot_bytes: int,
    max_programs: int = 32,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[RankWorkspace]:
    """Workspaces for world_size ranks living in this process on one device (streams of one GPU, or
    CPU tensors for the Triton interpreter). Returns one RankWorkspace per rank, in rank order."""
    device = torch.device(device)
    layout = WorkspaceLayout.build(world_size, slot_bytes, max_programs)
    buffers = [_new_buffer(layout, device) for _ in range(world_size)]
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)
    return [
        RankWorkspace(r, layout, buffers[r], table.clone(), "virtual", timeout_s, keep_alive=buffers)
        for r in range(world_size)
    ]


def create_process_workspace(
    group,
    device: torch.device,
    slot_bytes: int,
    max_programs: int = 32,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backends: tuple[str, ...] = PEER_MEMORY_ORDER,
) -> RankWorkspace:
    """Collective over `group` (every rank calls it): allocates this rank's buffer and maps every peer's.

    Tries the backends in order; all ranks must succeed with the same one (they vote). Raises
    RuntimeError listing why each backend failed when none works.
    """
    import torch.distributed as dist

    from tpfuse.comm import peer_memory

    group = dist.group.WORLD if group is None else group
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    # every rank must launch the same grids, so the layout (and the program limit) must agree
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, (slot_bytes, max_programs), group=group)
    slot_bytes, max_programs = min(s for s, _ in everyone), min(p for _, p in everyone)
    layout = WorkspaceLayout.build(world_size, slot_bytes, max_programs)
    notes: list[str] = []
    if "symm_mem" in backends:
        reused = peer_memory.vote_failures(_symmetric_memory_used_before(group), group)
        if reused:
            backends = tuple(b for b in backends if b != "symm_mem")
            notes.append("symm_mem not used: " + "; ".join(f"rank {r}: {msg}" for r, msg in reused))
    for backend in backends:
        opener = {"symm_mem": peer_memory.open_symmetric, "cuda_ipc": peer_memory.open_ipc}[backend]
        try:
            buffer, addresses, keep_alive = opener(layout.total_bytes, device, group)
            error = None
        except Exception as exc:  # noqa: BLE001 - any failure means "this backend does not work here"
            buffer, addresses, keep_alive, error = None, None, None, f"{type(exc).__name__}: {exc}"
        failures = peer_memory.vote_failures(error, group)
        if not failures:
            if backend == "symm_mem":
                _SYMMETRIC_GROUPS[group.group_name] = weakref.ref(group)
            table = torch.tensor(addresses, dtype=torch.int64, device=device)
            return RankWorkspace(rank, layout, buffer, table, backend, timeout_s, notes, keep_alive)
        notes.append(f"{backend} not used: " + "; ".join(f"rank {r}: {msg}" for r, msg in failures))
    raise RuntimeError("no peer-memory backend works for this group: " + " | ".join(notes))


def _symmetric_memory_used_before(group) -> str | None:
    """Why this process cannot use symm_mem for group (None: it can): another process group (alive
    or destroyed) used torch symmetric memory in this process before."""
    earlier = [name for name, holder in _SYMMETRIC_GROUPS.items() if holder() is not group]
    if not earlier:
        return None
    return (
        f"an earlier process group ({', '.join(map(repr, earlier))}) used torch symmetric memory in "
        "this process, and a later group can hang in its rendezvous; CUDA IPC instead"
    )
