"""What the GPUs can do, found by asking them: a real peer write/readback test, the link of each pair.

The gate for tpfuse's kernels is `gate_process_workspace`: every rank writes a pattern into every
peer's buffer through the mapped addresses and reads it back, then runs one fused all-reduce of each
algorithm against a torch reference; all ranks vote. No architecture lists: if it works, it is used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.comm import launch
from tpfuse.comm.host_topology import LEVEL_NAMES
from tpfuse.comm.workspace import RankWorkspace


@triton.jit
def _probe_write_kernel(peer_table, rank, probe_off, token, WS: tl.constexpr):
    for j in tl.static_range(WS):
        word = (tl.load(peer_table + j) + probe_off + rank * 4).to(tl.pointer_type(tl.int32))
        tl.store(word, token * 256 + rank)


@triton.jit
def _probe_read_kernel(peer_table, rank, probe_off, out_ptr, WS: tl.constexpr):
    for j in tl.static_range(WS):
        word = (tl.load(peer_table + j) + probe_off + rank * 4).to(tl.pointer_type(tl.int32))
        tl.store(out_ptr + j, tl.load(word, volatile=True))


def _write(ws: RankWorkspace, token: int) -> None:
    _probe_write_kernel[(1,)](ws.peer_table, ws.rank, ws.layout.probe_off, token, WS=ws.world_size)


def _inspect(ws: RankWorkspace, token: int) -> list[str]:
    """Problems seen by this rank after every rank wrote `token`: missing writes, bad readbacks."""
    problems = []
    start = ws.layout.probe_off // 4
    received = ws.words[start : start + ws.world_size].tolist()
    for s, value in enumerate(received):
        if value != token * 256 + s:
            problems.append(f"rank {ws.rank} did not receive rank {s}'s write (found {value:#x})")
    readback = torch.empty(ws.world_size, dtype=torch.int32, device=ws.device)
    _probe_read_kernel[(1,)](ws.peer_table, ws.rank, ws.layout.probe_off, readback, WS=ws.world_size)
    for j, value in enumerate(readback.tolist()):
        if value != token * 256 + ws.rank:
            problems.append(f"rank {ws.rank} read back {value:#x} from rank {j}'s buffer")
    return problems


def peer_write_test_virtual(workspaces: list[RankWorkspace]) -> list[str]:
    """The write/readback test for ranks of one process. Returns the problems found (empty: fine)."""
    problems = []
    for token in (0x5A, 0xA5):
        for ws in workspaces:
            _write(ws, token)
        if workspaces[0].device.type == "cuda":
            torch.cuda.synchronize(workspaces[0].device)
        for ws in workspaces:
            problems += _inspect(ws, token)
    return problems


GATE_SCHEDULES = ("one_shot", "two_shot")  # the gate's self-test; link_setup tests each other schedule


def _self_test(
    ws: RankWorkspace, group, algorithms=GATE_SCHEDULES, dtype=torch.bfloat16, tokens=3
) -> list[str]:
    """One fused all-reduce per algorithm on seeded inputs; the new residual must match a torch fp32 sum
    in rank order bit for bit (to rounding for the hierarchical schedule, whose island partials sum in
    another order), the normed output to rounding."""
    import torch.distributed as dist

    hidden = min(520, ws.layout.slot_bytes // (tokens * 4))  # odd sizes; room for float32 partials

    def seeded(seed, *shape):
        g = torch.Generator(device="cpu").manual_seed(seed)
        return torch.randn(*shape, generator=g).to(dtype).to(ws.device)

    xs = [seeded(100 + r, tokens, hidden) for r in range(ws.world_size)]
    residual, weight = seeded(7, tokens, hidden), seeded(8, hidden)
    total = residual.float() * 0
    for x in xs:
        total = total + x.float()
    expected_residual = (total + residual.float()).to(dtype)
    problems = []
    for algorithm in algorithms:
        if not launch.fits(ws, xs[ws.rank], algorithm):
            continue
        dist.barrier(group=group)
        normed, new_residual = launch.fused_add_rmsnorm(ws, xs[ws.rank], residual, weight, 1e-6, algorithm)
        torch.cuda.synchronize(ws.device)
        try:
            ws.check()
        except RuntimeError as exc:
            return [f"{algorithm} self-test: {exc}"]
        if algorithm == "hierarchical":
            exact = torch.allclose(new_residual.float(), expected_residual.float(), rtol=1e-2, atol=1e-2)
        else:
            exact = torch.equal(new_residual, expected_residual)
        if not exact:
            problems.append(f"rank {ws.rank}: {algorithm} self-test sum differs from the reference")
        reference = torch.nn.functional.rms_norm(expected_residual.float(), (hidden,), weight.float(), 1e-6)
        if not torch.allclose(normed.float(), reference, rtol=2e-2, atol=2e-2):
            problems.append(f"rank {ws.rank}: {algorithm} self-test norm differs from the reference")
    return problems


def self_test_vote(ws: RankWorkspace, group, algorithms: list[str]) -> list[tuple[int, str]]:
    """Collective: the kernel self-test of `algorithms` only (the schedules beyond the gate's, once the
    islands are known); [(rank, problem)], the same on every rank. After a failure every rank clears
    its error word and takes the group's largest epoch (a rank that could not launch would be one
    behind; epochs are small at start-up, far from wrapping), so the caller can drop the schedule and
    keep the workspace for the others."""
    import torch.distributed as dist

    from tpfuse.comm.peer_memory import vote_failures
    from tpfuse.comm.sync import CTRL_EPOCH, CTRL_ERROR

    try:
        problems = _self_test(ws, group, algorithms)
    except Exception as exc:  # noqa: BLE001 - a schedule that cannot run fails its test, with the reason
        problems = [f"self-test of {algorithms} failed on rank {ws.rank}: {type(exc).__name__}: {exc}"]
    failures = vote_failures("; ".join(problems) or None, group)
    if failures:
        torch.cuda.synchronize(ws.device)
        epochs: list = [None] * ws.world_size
        dist.all_gather_object(epochs, int(ws.words[CTRL_EPOCH.value].item()), group=group)
        ws.words[CTRL_EPOCH.value] = max(epochs)
        ws.words[CTRL_ERROR.value] = 0
        torch.cuda.synchronize(ws.device)
        dist.barrier(group=group)
    return failures


def gate_process_workspace(ws: RankWorkspace, group) -> list[tuple[int, str]]:
    """Collective: the write/readback test, then the kernel self-test. Returns [(rank, problem)], the
    same list on every rank; empty means every rank may use tpfuse's kernels."""
    import torch.distributed as dist

    from tpfuse.comm.peer_memory import vote_failures

    problems: list[str] = []
    try:
        for token in (0x5A, 0xA5):
            _write(ws, token)
            torch.cuda.synchronize(ws.device)
            dist.barrier(group=group)
            problems += _inspect(ws, token)
            dist.barrier(group=group)
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot run is a failed gate, with its reason
        problems.append(f"peer write test failed on rank {ws.rank}: {type(exc).__name__}: {exc}")
    failures = vote_failures("; ".join(problems) or None, group)
    if failures:
        return failures
    try:
        problems = _self_test(ws, group)
    except Exception as exc:  # noqa: BLE001
        problems = [f"kernel self-test failed on rank {ws.rank}: {type(exc).__name__}: {exc}"]
    return vote_failures("; ".join(problems) or None, group)


def link_types(device_count: int) -> dict[tuple[int, int], str]:
    """NVLink or PCIe (with the PCIe path) for every pair of CUDA devices, from NVML. Empty when NVML is
    not available (the reason goes to doctor through nvml_error())."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handles = [
            pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(i).uuid}")
            for i in range(device_count)
        ]
        links = {}
        for i in range(device_count):
            for j in range(i + 1, device_count):
                nvlink = pynvml.nvmlDeviceGetP2PStatus(
                    handles[i], handles[j], pynvml.NVML_P2P_CAPS_INDEX_NVLINK
                )
                if nvlink == pynvml.NVML_P2P_STATUS_OK:
                    links[(i, j)] = "NVLink"
                else:
                    level = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                    links[(i, j)] = f"PCIe ({LEVEL_NAMES.get(level, f'level {level}')})"
        return links
    finally:
        pynvml.nvmlShutdown()


def peer_access_matrix(device_count: int) -> list[list[bool]]:
    """cuda can_device_access_peer for every ordered pair (True on the diagonal)."""
    return [
        [i == j or torch.cuda.can_device_access_peer(i, j) for j in range(device_count)]
        for i in range(device_count)
    ]
