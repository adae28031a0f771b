"""The executor seam: what LLMEngine drives, for one rank (ModelRunner) or a tensor-parallel group
(worker.TensorParallelExecutor) alike.

A step is packed on the host (`pack`), launched (`launch` enqueues the forward, the sampling, the
token-table writes and the copy of the ids to the host, and returns at once) and read (`wait`).
Rows with logits processing (grammar, penalties, logprobs) are chosen on rank 0 after the step
before is read (`complete`) and reach the other ranks by broadcast, so those steps overlap too.
Launches are in order: at any TP size the engine may launch step n+1 before it waits for step n;
the ids step n samples reach step n+1 through the device's token table (step_inputs.py).
Speculative steps are not part of this seam: spec_forward.step_executor runs them on every rank (the
runner's SpecWorker hook at one rank, TensorParallelExecutor.execute_spec for a group).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from tpfuse.engine.batch import Batch
    from tpfuse.engine.runner import ModelRunner, ProcessedStep
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

    def launch(self, batch: Batch, packed: torch.Tensor) -> PendingStep | ProcessedStep:
        """Enqueues packed on every rank and returns without waiting. A batch whose rows need logits
        processing is launched up to its logits (a ProcessedStep): see complete."""

    def complete(self, pending: PendingStep | ProcessedStep) -> None:
        """Enqueues the rest of a ProcessedStep (its token choice, which reads the tokens of the
        step before) once the engine has appended those; before the step after it is launched.
        A no-op for other steps (wait completes a step itself if need be)."""

    def wait(self, pending: PendingStep | ProcessedStep) -> list[int | None]:
        """The sampled id of each batch row of a launched step (None: the row did not sample)."""

    def shutdown(self) -> None:
        """Stops every rank and releases the device memory held; safe to call twice."""
