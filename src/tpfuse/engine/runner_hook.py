"""RunnerHook: what an extension adds to one rank's plain ModelRunner, at fixed points of its life.

The runner and its decode graphs (cuda_graphs.py) call a hook without knowing what it is; speculative
decoding is the one extension (engine/spec_worker.py: SpecWorker) and reaches its own state through
runner.hook on its side. A runner without an extension has hook None and does none of this.

Order inside ModelRunner.__init__ (the same on every tensor-parallel rank, so collectives pair up):
the hook is built right after the target model (HookFactory), its models() are timed with the
target's projections, position_margin / max_positions bound max_model_len, bytes_per_block() joins the
KV sizing, allocate() follows the KV cache, and the decode graphs are captured with it. After that,
after_forward() sees every target forward, eager or inside a graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from tpfuse.model.config import ModelConfig


class RunnerHook(Protocol):
    max_positions: int  # positions the extension's own modules cover (their rotary caches)
    position_margin: int  # positions past max_model_len a step may reach; the runner keeps them in range
    # Decode graphs are also captured with r = 1..max_extra_query_rows extra query rows per sequence
    # (r + 1 query tokens each, prefill attention over static offsets (r + 1) * b).
    max_extra_query_rows: int
    fills_extra_rows: bool  # graphs with r > 0 call fill_extra_rows inside; False: the caller fills them
    tree_attention: bool  # steps may carry a tree mask (prefill attention is warmed up for it)

    def models(self) -> list[torch.nn.Module]:
        """The extension's modules whose projections start-up timing routes with the target's."""

    def bytes_per_block(self, tp_size: int, block_size: int) -> int:
        """Device bytes the extension holds per target KV block on this rank."""

    def allocate(
        self, num_blocks: int, block_size: int, tp_size: int, max_rows: int, max_seq_len: int
    ) -> None:
        """Called once the KV cache is allocated: num_blocks of block_size (shared block tables),
        max_rows the most rows of a step, max_seq_len a bound of any position + 1."""

    def fill_extra_rows(self, batch_size: int, extra_rows: int, block_tables: torch.Tensor) -> torch.Tensor:
        """Inside a graph with extra_rows r > 0, before the forward: ids [batch_size, r] for query rows
        1..r of each sequence (row 0 is the packed newest token). block_tables [B, W] int32. Graph-safe."""

    def after_forward(self, aux: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
        """After every target forward (eager or captured): the model's aux output [T, ...] or None and
        the step's KV slots [T] (slot < 0: padding). Graph-safe."""


# (target model, its ModelConfig, ParallelContext, device) -> the hook; called once per runner.
HookFactory = Callable[[torch.nn.Module, ModelConfig, object, torch.device], RunnerHook]
