"""The interface every drafter (EAGLE-3, MTP, n-gram, draft model) offers the engine.

After each target step the engine calls `propose(inputs, num_draft_tokens)` for the sequences in the
decode batch. `inputs` describes what the step verified: for sequence b, the target processed
positions[query_start_loc[b]:query_start_loc[b+1]] (after rejection: only the accepted positions),
whose tokens are input_ids, and the token that followed each of them is next_token_ids (its last
entry is the token the step emitted last: the correction or bonus token). A drafter writes its KV for
these positions, then proposes num_draft_tokens tokens to follow next_token_ids' last entry.
propose(inputs, 0) still consumes the inputs, which keeps a drafter's KV current while adaptive
speculation has switched drafting off, so speculation can resume at any step.

A TreeDrafter (EAGLE-3) also proposes a draft tree (`propose_tree`, --speculative-eagle-topk > 1).
EAGLE-3 chain drafting inside CUDA graphs (spec/eagle3_window.py) runs the same passes as
Eagle3Drafter.propose over static buffers; it is a graph-capture form of that drafter with its own
load/draft contract, not another Drafter.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tpfuse.spec.tree import DraftTree


@dataclass
class DraftInputs:
    input_ids: torch.Tensor  # [T] int64: tokens at the verified positions
    positions: torch.Tensor  # [T] int64: contiguous per sequence, the last one the newest verified
    next_token_ids: torch.Tensor  # [T] int64: the token after each position
    query_start_loc: torch.Tensor  # [B + 1] int32
    block_tables: torch.Tensor | None = None  # [B, M] int32: the drafter's KV blocks (model drafters)
    block_size: int = 16
    target_features: torch.Tensor | None = None  # [T, n * H_target]: target aux states (EAGLE-3)
    hidden_states: torch.Tensor | None = None  # [T, H_head]: EAGLE-3 fc(target_features), if precomputed
    token_histories: list[list[int]] | None = None  # all tokens of each sequence so far (n-gram)
    temperatures: torch.Tensor | None = None  # [B]: > 0 draws drafts by sampling (and returns q)
    seeds: torch.Tensor | None = None  # [B] int64, with temperatures
    max_query_len: int | None = None  # host-known bound of tokens per sequence (no device read)
    max_seq_len: int | None = None  # host-known bound of positions[last] + 1 (no device read)

    def seq_len_bound(self, extra: int) -> int | None:
        """max_seq_len + extra, or None when the bound is unknown."""
        return None if self.max_seq_len is None else self.max_seq_len + extra

    @property
    def batch_size(self) -> int:
        return self.query_start_loc.shape[0] - 1

    def last_index(self) -> torch.Tensor:
        """[B] int64: index into the T tokens of each sequence's newest verified position."""
        return self.query_start_loc[1:].to(torch.int64) - 1

    def require(self, *names: str, drafter: str) -> None:
        """Raises ValueError naming the fields a drafter needs but the engine left empty."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(
                f"the {drafter} drafter needs DraftInputs.{', '.join(missing)}; the engine must fill it"
            )


@dataclass
class DraftProposal:
    """token_ids: [B, k] int64 target-vocabulary ids (padding past a row's count is 0);
    num_draft_tokens: [B] int64 drafts per row (a drafter may find fewer than k);
    probs: [B, k, V_target] float32 distribution each draft was drawn from, None for argmax drafts."""

    token_ids: torch.Tensor
    num_draft_tokens: torch.Tensor
    probs: torch.Tensor | None = None

    @classmethod
    def empty(cls, batch_size: int, device: torch.device | str = "cpu") -> DraftProposal:
        return cls(
            torch.zeros(batch_size, 0, dtype=torch.int64, device=device),
            torch.zeros(batch_size, dtype=torch.int64, device=device),
        )


class Drafter(abc.ABC):
    """Chain drafting: what every drafter implements (spec_worker.SpecWorker.propose calls it)."""

    @abc.abstractmethod
    def propose(self, inputs: DraftInputs, num_draft_tokens: int) -> DraftProposal:
        """Consumes the verified step described by inputs and proposes num_draft_tokens (>= 0) per
        sequence. Raises ValueError when inputs lack a field this drafter needs."""


class TreeDrafter(Drafter):
    """A drafter that also drafts trees (EAGLE-3)."""

    @abc.abstractmethod
    def propose_tree(self, inputs: DraftInputs, num_steps: int, topk: int, num_nodes: int) -> DraftTree:
        """Consumes inputs as propose does and returns a DraftTree of num_nodes nodes per sequence
        (root = the newest token), grown num_steps levels deep with topk children per expanded node."""
