"""The one seam the model calls for tensor-parallel communication.

A Communicator belongs to one tensor-parallel group and one rank. The model uses only the operations
below (all-reduce, the fused all-reduce + residual add + RMSNorm with its MoE-combine, FP8-rows
and Half2X forms, all-gather); which algorithm runs (tpfuse's Triton kernels over peer memory, NCCL,
or gloo on CPU) is the Communicator's business, decided per message size at start-up, before any
CUDA graph capture.
"""

from __future__ import annotations

import abc

import torch

from tpfuse.kernels import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_fp8_rows,
    fused_add_rmsnorm_half2x,
    quantize_fp8_rows,
)
from tpfuse.kernels.fp8_rows import Fp8Rows
from tpfuse.kernels.quant_int_half2 import Half2X


class Communicator(abc.ABC):
    rank: int
    world_size: int

    @abc.abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the group. x: [T, H] (any shape), unchanged; returns a new tensor."""

    @abc.abstractmethod
    def fused_add_rmsnorm_all_reduce(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """s = all_reduce(x) + residual, rounded to x.dtype; returns (rmsnorm(s) * weight, s).

        x, residual: [T, H]; weight: [H]. Numerics as tpfuse.kernels.rmsnorm says, bit-identical on
        every rank. Inputs are not modified; both outputs are new tensors.
        """

    @abc.abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation of every rank's x along dim, in rank order."""

    def moe_finalize_all_reduce(
        self, slot_out: torch.Tensor, top_k: int, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fused_add_rmsnorm_all_reduce of the MoE combine: x[t] = round(sum_j slot_out[t * k + j]) in
        float32, slot order. slot_out: [T * k, H], this rank's weighted expert outputs. A communicator
        may fuse the combine into its all-reduce (comm/moe_finalize.py); the results are the same."""
        from tpfuse.kernels import moe_combine

        return self.fused_add_rmsnorm_all_reduce(moe_combine(slot_out, top_k), residual, weight, eps)

    def fused_add_rmsnorm_all_reduce_fp8(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As fused_add_rmsnorm_all_reduce, but normed is float8_e4m3fn: the float32 norm divided by
        scale (a float32 tensor of one element), rounded to nearest and saturated at +-448."""
        new_residual = (self.all_reduce(x).float() + residual.float()).to(x.dtype)
        return quantize_fp8(rmsnorm_fp32(new_residual, weight, eps), scale), new_residual

    def fused_add_rmsnorm_all_reduce_fp8_rows(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int
    ) -> tuple[Fp8Rows, torch.Tensor]:
        """As fused_add_rmsnorm_all_reduce, but the normed rows come as kernels/fp8_rows.py's Fp8Rows,
        `group` columns a scale (the whole row, or 128): the bits a W8A8 product's own quantization
        would give them. A communicator may quantize inside its epilogue; this one quantizes after."""
        normed, new_residual = self.fused_add_rmsnorm_all_reduce(x, residual, weight, eps)
        data, scales = quantize_fp8_rows(normed, group)
        return Fp8Rows(data, scales, normed.dtype, group), new_residual

    def fused_add_rmsnorm_all_reduce_half2x(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[Half2X | torch.Tensor, torch.Tensor]:
        """As fused_add_rmsnorm_all_reduce of one row (x [1, H], H a multiple of 32, bf16 / fp16), the
        normed row as kernels/quant_int_half2.py's Half2X where this communicator writes it in its
        epilogue, else plain (a separate conversion would cost the launch the form saves)."""
        return self.fused_add_rmsnorm_all_reduce(x, residual, weight, eps)

    def check(self) -> None:
        """Raises RuntimeError if a peer never arrived in an earlier call (custom kernels only). Call it at
        a point that synchronises anyway; it waits for the device."""
        return None

    def describe(self) -> str:
        """Which path carries which message sizes, and why (for logs and `tpfuse doctor`)."""
        return f"{type(self).__name__}: rank {self.rank} of {self.world_size}"


FP8_E4M3_MAX = 448.0


def rmsnorm_fp32(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of s times weight, in float32, not rounded."""
    sf = s.float()
    return sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def quantize_fp8(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn of y / scale, saturated at +-448 (the per-tensor static-scale convention)."""
    return (y.float() / scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


class SingleRankCommunicator(Communicator):
    """World size 1: all-reduce is the identity."""

    rank = 0
    world_size = 1

    def all_reduce(self, x):
        return x

    def fused_add_rmsnorm_all_reduce(self, x, residual, weight, eps):
        return fused_add_rmsnorm(x, residual, weight, eps)

    def fused_add_rmsnorm_all_reduce_fp8_rows(self, x, residual, weight, eps, group):
        return fused_add_rmsnorm_fp8_rows(x, residual, weight, eps, group)

    def fused_add_rmsnorm_all_reduce_half2x(self, x, residual, weight, eps):
        return fused_add_rmsnorm_half2x(x, residual, weight, eps)

    def all_gather(self, x, dim=-1):
        return x


class TorchDistributedCommunicator(Communicator):
    """Plain torch.distributed collectives (gloo on CPU, NCCL on GPU), then the local fused norm.

    The fallback every other path is measured against, and the CPU path of tensor parallelism.
    """

    def __init__(self, group=None, notes: list[str] | None = None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.notes = list(notes or [])  # why this path (doctor and logs print them)

    def all_reduce(self, x):
        out = x.clone()
        self._dist.all_reduce(out, group=self.group)
        return out

    def fused_add_rmsnorm_all_reduce(self, x, residual, weight, eps):
        return fused_add_rmsnorm(self.all_reduce(x), residual, weight, eps)

    def fused_add_rmsnorm_all_reduce_fp8_rows(self, x, residual, weight, eps, group):
        return fused_add_rmsnorm_fp8_rows(self.all_reduce(x), residual, weight, eps, group)

    def fused_add_rmsnorm_all_reduce_half2x(self, x, residual, weight, eps):
        return fused_add_rmsnorm_half2x(self.all_reduce(x), residual, weight, eps)

    def all_gather(self, x, dim=-1):
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def describe(self):
        backend = self._dist.get_backend(self.group)
        lines = [f"torch.distributed {backend} for every message, rank {self.rank} of {self.world_size}"]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


class GlooCpuCopyCommunicator(TorchDistributedCommunicator):
    """GPU tensors through a gloo group by way of CPU copies, summed in float32.

    The fallback when ranks share one GPU (NCCL refuses that). Slow, and it cannot be captured in a
    CUDA graph, so the custom kernels carry every message that fits their workspace there."""

    def all_reduce(self, x):
        host = x.detach().float().cpu()
        self._dist.all_reduce(host, group=self.group)
        return host.to(device=x.device, dtype=x.dtype)

    def all_gather(self, x, dim=-1):
        host = x.detach().cpu().contiguous()
        parts = [torch.empty_like(host) for _ in range(self.world_size)]
        self._dist.all_gather(parts, host, group=self.group)
        return torch.cat(parts, dim=dim).to(x.device)

    def describe(self):
        return super().describe().replace("torch.distributed gloo", "gloo through CPU copies", 1)
