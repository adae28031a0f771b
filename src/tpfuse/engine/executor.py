"""The executor seam: what LLMEngine drives, for one rank (ModelRunner) or a tensor-parallel group
(worker.TensorParallelExecutor) alike.

A step is packed on the host (`pack`, or `pack_next_decode` for a decode step whose input ids are the
previous step's sampled ids, still on the device), launched (`launch` enqueues the forward, the
sampling and the copy of the ids to the host, and returns at once) and read (`wait`). Launches are
in order: at any TP size the engine may launch step n+1, with previous = step n, before it waits for
step n. Speculative steps are not part of this seam: spec_forward.step_executor runs them on every
rank (the runner's SpecWorker hook at one rank, TensorParallelExecutor.execute_spec for a group).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from tpfuse.engine.batch import Batch
    from tpfuse.engine.runner import ModelRunner
    from tpfuse.engine.token_readback import PendingStep
    from tpfuse.model.config import ModelConfig


class Executor(Protocol):
    runner: ModelRunner  # rank 0's runner (graphs, its hook, readback live there)
    model_config: ModelConfig
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int

    def pack(self, batch: Batch, engine_seed: int) -> torch.Tensor:
        """The CPU packed step of batch, its bans included (padded to its CUDA-graph bucket when it is
        a decode)."""

    def pack_next_decode(self, batch: Batch, engine_seed: int) -> torch.Tensor:
        """The packed decode step of batch whose input ids launch(..., previous) fills on the device."""

    def launch(self, batch: Batch, packed: torch.Tensor, previous: PendingStep | None = None) -> PendingStep:
        """Enqueues packed on every rank and returns without waiting. previous: the step launched just
        before, whose sampled ids (every row sampled) become this step's input ids."""

    def wait(self, pending: PendingStep) -> list[int | None]:
        """The sampled id of each batch row of a launched step (None: the row did not sample)."""

    def shutdown(self) -> None:
        """Stops every rank and releases the device memory held; safe to call twice."""
