"""The one seam the model calls for tensor-parallel communication.

A Communicator belongs to one tensor-parallel group and one rank. The model uses only these three
operations; which algorithm runs (tpfuse's Triton kernels over peer memory, NCCL, or gloo on CPU) is
the Communicator's business, decided per message size at start-up, before any CUDA graph capture.
"""

from __future__ import annotations

import abc

import torch

from tpfuse.kernels import fused_add_rmsnorm


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


class SingleRankCommunicator(Communicator):
    """World size 1: all-reduce is the identity."""

    rank = 0
    world_size = 1

    def all_reduce(self, x):
        return x

    def fused_add_rmsnorm_all_reduce(self, x, residual, weight, eps):
        return fused_add_rmsnorm(x, residual, weight, eps)

    def all_gather(self, x, dim=-1):
        return x


class TorchDistributedCommunicator(Communicator):
    """Plain torch.distributed collectives (gloo on CPU, NCCL on GPU), then the local fused norm.

    The fallback every other path is measured against, and the CPU path of tensor parallelism.
    """

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, x):
        out = x.clone()
        self._dist.all_reduce(out, group=self.group)
        return out

    def fused_add_rmsnorm_all_reduce(self, x, residual, weight, eps):
        return fused_add_rmsnorm(self.all_reduce(x), residual, weight, eps)

    def all_gather(self, x, dim=-1):
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)
