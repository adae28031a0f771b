"""Other libraries' all-reduce as one more measured candidate: FlashInfer's fused all-reduce (+ residual
+ RMSNorm), when it is installed. tpfuse never needs it: without FlashInfer (or with a version lacking
the unified `allreduce_fusion` API) this module reports why and nothing else changes.

An external candidate is raced against tpfuse's schedules and the fallback per size bucket like any
schedule (tuning.py); the plan then names it, and CustomCommunicator calls it for those sizes. It has
no FP8 epilogue here: FP8 calls of such a bucket go to the fallback.
"""

from __future__ import annotations

import torch

FLASHINFER = "flashinfer"


def flashinfer_comm():
    """(flashinfer.comm, None) when its unified fusion API can be imported, else (None, why not)."""
    try:
        import flashinfer.comm as fc
    except Exception as exc:  # noqa: BLE001 - not installed, or broken: say which and go on without it
        return None, f"flashinfer not importable ({type(exc).__name__}: {exc})"
    if not (hasattr(fc, "allreduce_fusion") and hasattr(fc, "create_allreduce_fusion_workspace")):
        return None, "flashinfer.comm has no allreduce_fusion API (a version before the unified API)"
    return fc, None


class FlashInferAllReduce:
    """One rank's FlashInfer workspace (TensorRT-LLM backend: IPC peer buffers, 2-16 ranks); built
    collectively before any graph capture. Messages up to max_tokens x hidden of dtype fit."""

    name = FLASHINFER

    def __init__(self, fc, group, rank: int, world_size: int, max_tokens: int, hidden: int, dtype):
        self.fc, self.max_tokens, self.hidden, self.dtype = fc, max_tokens, hidden, dtype
        self.workspace = fc.create_allreduce_fusion_workspace(
            backend="trtllm", world_size=world_size, rank=rank, max_token_num=max_tokens, hidden_dim=hidden,
            dtype=dtype, group=group,
        )  # fmt: skip

    def fits(self, x: torch.Tensor) -> bool:
        rows = x.numel() // max(1, x.shape[-1]) if x.dim() else 1
        return (
            x.dim() >= 1 and x.shape[-1] == self.hidden and x.dtype == self.dtype and rows <= self.max_tokens
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.hidden).contiguous()
        out = torch.empty_like(rows)
        self.fc.allreduce_fusion(
            input=rows,
            workspace=self.workspace,
            pattern=self.fc.AllReduceFusionPattern.kAllReduce,
            output=out,
        )
        return out.view(x.shape)

    def fused_add_rmsnorm(self, x, residual, weight, eps):
        rows, res = x.reshape(-1, self.hidden).contiguous(), residual.reshape(-1, self.hidden).contiguous()
        normed, res_out = torch.empty_like(rows), torch.empty_like(rows)
        self.fc.allreduce_fusion(
            input=rows, workspace=self.workspace, pattern=self.fc.AllReduceFusionPattern.kARResidualRMSNorm,
            residual_out=res_out, norm_out=normed, residual_in=res, rms_gamma=weight, rms_eps=eps,
        )  # fmt: skip
        return normed.view(x.shape), res_out.view(x.shape)


def create_externals(
    group, rank: int, world_size: int, max_tokens: int, hidden: int, dtype
) -> tuple[dict, list]:
    """Collective: {name: candidate} of the external all-reduces every rank could build, and notes on
    those that could not (all ranks vote, so all agree)."""
    from tpfuse.comm.peer_memory import vote_failures

    fc, why = flashinfer_comm()
    if fc is None:
        return {}, [f"{FLASHINFER}: {why}"]
    candidate, error = None, None
    try:
        candidate = FlashInferAllReduce(fc, group, rank, world_size, max_tokens, hidden, dtype)
    except Exception as exc:  # noqa: BLE001 - any failure means "not a candidate here", with its reason
        error = f"{type(exc).__name__}: {exc}"
    failures = vote_failures(error, group)
    if failures:
        return {}, [f"{FLASHINFER} not a candidate: rank {failures[0][0]}: {failures[0][1]}"]
    return {FLASHINFER: candidate}, [f"{FLASHINFER} all-reduce fusion is a measured candidate"]
