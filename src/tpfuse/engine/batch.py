"""One step's batch, as the scheduler decides it and the packers lay it out."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpfuse.engine.sequence import Sequence


@dataclass
class Ban:
    """Token ids a row must not emit for its next `count` tokens (min_tokens not reached yet)."""

    token_ids: list[int]
    count: int


@dataclass
class Batch:
    """One step's work: seqs[i] computes num_new_tokens[i] tokens from its num_computed_tokens.
    bans: row -> the ids it must not emit yet, decided by the scheduler (the packers only lay them out)."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    bans: dict[int, Ban] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether seqs[i] reaches its last token this step, so a new token is sampled for it."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == len(seq)
