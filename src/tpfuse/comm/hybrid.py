"""CustomCommunicator: tpfuse's peer-memory kernels per size bucket, a fallback communicator for the rest.

Built by create_communicator (one process per rank) or create_virtual_communicators (N ranks on N
streams of one process; no fallback there, every message must fit the workspace).
"""

from __future__ import annotations

import torch

from tpfuse import knobs
from tpfuse.comm import launch, moe_finalize, schedules
from tpfuse.comm.communicator import Communicator
from tpfuse.comm.plan import FALLBACK, Plan, unmeasured_plan
from tpfuse.comm.workspace import RankWorkspace, create_virtual_workspaces


class CustomCommunicator(Communicator):
    """One rank of a group whose small messages go through tpfuse's kernels over `workspace`.

    fallback: the communicator for messages the plan (or the workspace size) sends elsewhere; None
    means there is none (virtual ranks), and such a message raises ValueError.
    candidates: the schedules the start-up measurement may choose from (default: every schedule the
    workspace can run; the link probe removes some, `removed` says why).
    """

    def __init__(
        self,
        workspace: RankWorkspace,
        plan: Plan,
        fallback: Communicator | None = None,
        checked: bool | None = None,
    ):
        self.workspace = workspace
        self.plan = plan
        self.fallback = fallback
        self.rank = workspace.rank
        self.world_size = workspace.world_size
        self.checked = knobs.current.comm_check if checked is None else checked
        self.candidates: tuple[str, ...] = tuple(schedules.available(workspace))
        self.removed: dict[str, str] = {}  # schedule -> why it is not a candidate (link probe findings)
        self.externals: dict = {}  # name -> another library's all-reduce raced as a candidate (external.py)
        self.links = None  # link_decision.LinkMeasurements when the link probe ran
        self.probe_decision = None  # link_decision.ProbeDecision when the link probe ran

    @property
    def fallback_name(self) -> str:
        return self.plan.fallback_name

    def _algorithm(self, op: str, x: torch.Tensor) -> str:
        if x.device != self.workspace.device or not launch.fits(self.workspace, x):
            return FALLBACK
        algorithm = self.plan.choose(op, x.numel() * x.element_size())
        if algorithm in self.externals:
            return algorithm if self.externals[algorithm].fits(x) else FALLBACK
        if algorithm != FALLBACK and not launch.fits(self.workspace, x, algorithm):
            return FALLBACK
        return algorithm

    def _fallback(self, what: str, x: torch.Tensor) -> Communicator:
        if self.fallback is None:
            raise ValueError(
                f"{what} of {tuple(x.shape)} {x.dtype} does not fit the peer workspace "
                f"({self.workspace.layout.slot_bytes} bytes per slot) and this communicator has no fallback; "
                "create it for more tokens"
            )
        return self.fallback

    def _done(self, result):
        if self.checked:
            if self.workspace.device.type == "cuda":
                torch.cuda.synchronize(self.workspace.device)
            self.workspace.check()
        return result

    def all_reduce(self, x):
        algorithm = self._algorithm("all_reduce", x)
        if algorithm == FALLBACK:
            return self._fallback("all_reduce", x).all_reduce(x)
        if algorithm in self.externals:
            return self.externals[algorithm].all_reduce(x)
        return self._done(launch.all_reduce(self.workspace, x, algorithm))

    def fused_add_rmsnorm_all_reduce(self, x, residual, weight, eps):
        algorithm = self._algorithm("fused", x)
        if algorithm == FALLBACK:
            return self._fallback("fused all-reduce", x).fused_add_rmsnorm_all_reduce(
                x, residual, weight, eps
            )
        if algorithm in self.externals:
            return self.externals[algorithm].fused_add_rmsnorm(x, residual, weight, eps)
        return self._done(launch.fused_add_rmsnorm(self.workspace, x, residual, weight, eps, algorithm))

    def moe_finalize_all_reduce(self, slot_out, top_k, residual, weight, eps):
        # fused where the plan runs one-shot and no peer process shares this GPU (lazy module loading)
        fusable = moe_finalize.usable(self.workspace)
        if fusable and self._algorithm("fused", residual) == moe_finalize.ALGORITHM:
            return self._done(
                moe_finalize.moe_finalize_all_reduce(self.workspace, slot_out, top_k, residual, weight, eps)
            )
        return super().moe_finalize_all_reduce(slot_out, top_k, residual, weight, eps)

    def _fused_with_epilogue(self, x, residual, weight, eps, on_fallback, **form):
        """The fused op with an output form only tpfuse's kernels write (form: launch.fused_add_rmsnorm's
        fp8_scale, fp8_group or half2x); where the plan takes the fallback or an external library, which
        have no such epilogue here, on_fallback(the fallback communicator) instead."""
        algorithm = self._algorithm("fused", x)
        if algorithm == FALLBACK or algorithm in self.externals:
            return on_fallback(self._fallback("fused all-reduce", x))
        ws = self.workspace
        return self._done(launch.fused_add_rmsnorm(ws, x, residual, weight, eps, algorithm, **form))

    def fused_add_rmsnorm_all_reduce_fp8(self, x, residual, weight, eps, scale):
        on_fallback = lambda comm: comm.fused_add_rmsnorm_all_reduce_fp8(  # noqa: E731
            x, residual, weight, eps, scale
        )
        return self._fused_with_epilogue(x, residual, weight, eps, on_fallback, fp8_scale=scale)

    def fused_add_rmsnorm_all_reduce_fp8_rows(self, x, residual, weight, eps, group):
        on_fallback = lambda comm: comm.fused_add_rmsnorm_all_reduce_fp8_rows(  # noqa: E731
            x, residual, weight, eps, group
        )
        return self._fused_with_epilogue(x, residual, weight, eps, on_fallback, fp8_group=group)

    def fused_add_rmsnorm_all_reduce_half2x(self, x, residual, weight, eps):
        on_fallback = lambda comm: comm.fused_add_rmsnorm_all_reduce_half2x(  # noqa: E731
            x, residual, weight, eps
        )
        return self._fused_with_epilogue(x, residual, weight, eps, on_fallback, half2x=True)

    def all_gather(self, x, dim=-1):
        # not in the plan: the custom gather whenever it fits (decode-sized), the fallback otherwise
        if x.device != self.workspace.device or not launch.fits(self.workspace, x):
            return self._fallback("all_gather", x).all_gather(x, dim)
        # the kernel writes the concatenation itself: no op after it (see create_virtual_communicators)
        return self._done(launch.all_gather(self.workspace, x, dim=dim))

    def check(self) -> None:
        self.workspace.check()

    def describe(self) -> str:
        ws = self.workspace
        head = (
            f"tpfuse custom all-reduce, rank {self.rank}/{self.world_size}, workspace {ws.backend} "
            f"({ws.layout.slot_bytes} bytes per slot, spin timeout {ws.timeout_s:g}s)"
        )
        notes = "".join(f"\nnote: {n}" for n in ws.notes)
        notes += "".join(f"\nnot a candidate: {name}: {why}" for name, why in self.removed.items())
        return f"{head}\n{self.plan.describe()}{notes}"


def create_virtual_communicators(
    world_size: int,
    device: torch.device | str,
    max_tokens: int,
    hidden_size: int,
    dtype: torch.dtype,
    timeout_s: float = 30.0,
    max_programs: int | None = None,
    checked: bool | None = None,
) -> list[CustomCommunicator]:
    """world_size communicators of one process sharing one workspace (for tests and comm-bench on one
    GPU). Call rank r's operations on its own CUDA stream; all ranks must make the same calls. Messages
    up to max_tokens x hidden_size of dtype fit; there is no fallback.

    Between the ranks' launches of one collective, run only kernels already loaded: with lazy CUDA module
    loading (the default), the first use of a kernel loads its module, and loading waits until running
    kernels end, while rank 0's kernel spins until the host launches the other ranks, so it times out.
    Run each torch op once beforehand (outside any rank launch) to load it."""
    device = torch.device(device)
    row_bytes = hidden_size * torch.tensor([], dtype=dtype).element_size()
    if max_programs is None:
        max_programs = programs_per_rank(device, world_size)
    workspaces = create_virtual_workspaces(
        world_size, device, max_tokens * row_bytes, max_programs, timeout_s
    )
    plan = unmeasured_plan(
        "none", world_size, row_bytes, max_tokens, "virtual ranks: default rule, not measured",
        notes=["virtual ranks share one GPU: kernel latency, not a link measurement"],
    )  # fmt: skip
    return [CustomCommunicator(ws, plan, None, checked) for ws in workspaces]


def programs_per_rank(device: torch.device, ranks_on_device: int) -> int:
    """Enough programs for the largest decode batches, few enough that every rank's grid is resident
    at once on a shared GPU (a spinning program must never wait for a program that cannot start)."""
    if device.type != "cuda":
        return 8
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(64, sms // max(1, ranks_on_device)))
