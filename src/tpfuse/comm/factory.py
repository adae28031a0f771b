"""create_communicator: the one call a tensor-parallel rank makes, after init_process_group and before
any CUDA graph capture.

    CPU                      -> TorchDistributedCommunicator (gloo)
    world size 1             -> SingleRankCommunicator
    GPU, mode "nccl"         -> TorchDistributedCommunicator (NCCL)
    GPU, mode "auto"/"fused" -> CustomCommunicator: peer workspace, gated by a real write/readback test
                                and kernel self-test (all ranks vote), then per size bucket the measured
                                faster of tpfuse's kernels and NCCL ("auto"), or tpfuse's kernels for
                                every message that fits ("fused").
Ranks sharing one GPU (a gloo group on CUDA tensors): NCCL cannot run, the fallback is gloo through
CPU copies, and tpfuse's kernels carry every message that fits (the fallback cannot be graph-captured).
"""

from __future__ import annotations

import socket

import torch

from tpfuse import knobs
from tpfuse.comm.communicator import (
    Communicator,
    GlooCpuCopyCommunicator,
    SingleRankCommunicator,
    TorchDistributedCommunicator,
)
from tpfuse.comm.hybrid import CustomCommunicator, programs_per_rank
from tpfuse.comm.link_setup import configure_schedules
from tpfuse.comm.plan import unmeasured_plan
from tpfuse.comm.topology import gate_process_workspace
from tpfuse.comm.tuning import measure_plan
from tpfuse.comm.workspace import (
    DEFAULT_TIMEOUT_S,
    PEER_MEMORY_ORDER,
    PEER_MEMORY_ORDER_ONE_GPU,
    create_process_workspace,
)

MODES = ("auto", "fused", "nccl")
DEFAULT_MAX_WORKSPACE_BYTES = 32 << 20  # per slot; the custom kernels are for decode-sized messages


def ranks_on_my_gpu(group, device: torch.device) -> int:
    """How many ranks of the group (this one included) use the same physical GPU as this rank."""
    import torch.distributed as dist

    me = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, me, group=group)
    return sum(1 for other in everyone if other == me)


def create_communicator(
    group=None,
    device: torch.device | str | None = None,
    mode: str = "auto",
    max_tokens: int = 256,
    hidden_size: int = 4096,
    dtype: torch.dtype = torch.bfloat16,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_workspace_bytes: int = DEFAULT_MAX_WORKSPACE_BYTES,
    islands: str | None = None,
) -> Communicator:
    """Collective over `group` (every rank calls it with the same arguments).

    max_tokens x hidden_size x dtype: the largest message the custom kernels should carry (decode
    batch); capped at max_workspace_bytes per slot. islands: `--allreduce-islands` ("0,1;2,3"), None to
    derive them from the topology (link_setup.py; the link probe runs there too). Raises ValueError for
    a mode that cannot work here (or bad islands) and RuntimeError when mode "fused" is asked for but
    the kernels cannot run (the reason included).
    """
    import torch.distributed as dist

    if mode not in MODES:
        raise ValueError(f"--allreduce must be one of {', '.join(MODES)}, got {mode!r}")
    if dist.get_world_size(group) == 1:
        return SingleRankCommunicator()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        if mode == "fused":
            raise ValueError(
                "--allreduce fused needs CUDA GPUs; on CPU tensor parallelism runs over gloo (use auto)"
            )
        return TorchDistributedCommunicator(group, notes=["CPU ranks: gloo"])
    nccl = dist.get_backend(group) == "nccl"
    sharing = ranks_on_my_gpu(group, device)
    if mode == "nccl":
        if not nccl:
            raise ValueError(
                "--allreduce nccl needs an NCCL process group; ranks that share a GPU cannot use NCCL "
                "(use auto or fused)"
            )
        return TorchDistributedCommunicator(group, notes=["forced by --allreduce nccl"])
    fallback = TorchDistributedCommunicator(group) if nccl else GlooCpuCopyCommunicator(group)
    fallback_name = "nccl" if nccl else "gloo (CPU copies)"
    row_bytes = hidden_size * torch.tensor([], dtype=dtype).element_size()
    slot_bytes = min(max_tokens * row_bytes, max_workspace_bytes)
    reason = None
    try:
        forced = knobs.current.peer_memory
        one_gpu = sharing == dist.get_world_size(group)
        backends = (forced,) if forced else (PEER_MEMORY_ORDER_ONE_GPU if one_gpu else PEER_MEMORY_ORDER)
        programs = programs_per_rank(device, sharing)
        ws = create_process_workspace(group, device, slot_bytes, programs, timeout_s, backends)
        failures = gate_process_workspace(ws, group)
        if failures:
            reason = "peer test failed: " + "; ".join(f"rank {r}: {msg}" for r, msg in failures)
    except RuntimeError as exc:
        reason = str(exc)
    if reason is not None:
        if mode == "fused":
            raise RuntimeError(f"--allreduce fused: tpfuse's kernels cannot run on this group: {reason}")
        fallback.notes.append(f"tpfuse kernels not used: {reason}")
        return fallback
    comm = CustomCommunicator(
        ws, unmeasured_plan(fallback_name, dist.get_world_size(group), row_bytes, 1, ""), fallback
    )
    separate_gpus = sharing == 1 and mode == "auto"
    externals = (max(1, slot_bytes // row_bytes), hidden_size, dtype) if separate_gpus else None
    configure_schedules(comm, group, device, islands, probe=separate_gpus, externals=externals)
    fitting_tokens = max(1, slot_bytes // row_bytes)
    if sharing > 1 or mode == "fused":
        why = (
            f"{sharing} ranks share one GPU: no NCCL, and the gloo fallback cannot be graph-captured"
            if sharing > 1
            else "forced by --allreduce fused"
        )
        comm.plan = unmeasured_plan(fallback_name, comm.world_size, row_bytes, fitting_tokens, why)
    else:
        comm.plan = measure_plan(comm, group, hidden_size, dtype, fitting_tokens, fallback_graphs=nccl)
    return comm
