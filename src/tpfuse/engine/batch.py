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
    """One step's work: seqs[i] computes num_new_tokens[i] tokens from position begin(i).
    bans: row -> the ids it must not emit yet, decided by the scheduler (the packers only lay them out).
    begins: each row's first position when the batch was scheduled while the step before it ran
    (Scheduler.schedule_following), so a row may start at the token that step is sampling, which
    only the device knows yet; None: every row starts at its num_computed_tokens."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    bans: dict[int, Ban] = field(default_factory=dict)
    begins: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)

    def begin(self, i: int) -> int:
        """The position of row i's first token this step."""
        return self.begins[i] if self.begins is not None else self.seqs[i].num_computed_tokens

    def samples(self, i: int) -> bool:
        """Whether seqs[i] reaches its last token this step, so a new token is sampled for it (a row
        that starts at a token still on the device reaches past the known ones)."""
        return self.begin(i) + self.num_new_tokens[i] >= len(self.seqs[i])

    def decodes_first(self) -> Batch:
        """This batch with its one-token rows moved ahead of its prompt chunks (stable), so that
        attention runs them with the decode kernel (AttentionMetadata.num_decode_rows); bans follow
        their rows. Returns self when the one-token rows already lead."""
        counts = self.num_new_tokens
        first_chunk = next((i for i, n in enumerate(counts) if n != 1), len(counts))
        if all(n != 1 for n in counts[first_chunk:]):
            return self
        order = [i for i, n in enumerate(counts) if n == 1] + [i for i, n in enumerate(counts) if n != 1]
        row_of = {old: new for new, old in enumerate(order)}
        return Batch(
            [self.seqs[i] for i in order],
            [counts[i] for i in order],
            {row_of[row]: ban for row, ban in self.bans.items()},
            None if self.begins is None else [self.begins[i] for i in order],
        )
