"""Acceptance counters of a speculative engine (EngineStats' spec_* fields)."""

from __future__ import annotations


class SpecStats:
    """Cumulative acceptance counters over verify rows that carried at least one draft."""

    def __init__(self, max_num_draft_tokens: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.drafted_at = [0] * max_num_draft_tokens  # rows with a draft at position i
        self.accepted_at = [0] * max_num_draft_tokens  # rows that accepted position i

    def record(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        for drafted, accepted in zip(num_drafts, num_accepted, strict=True):
            if drafted == 0:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
            for i in range(drafted):
                self.drafted_at[i] += 1
                self.accepted_at[i] += i < accepted

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verify row with drafts: 1 + accepted drafts per row."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_rate_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]
