"""AcceptanceEstimate: per draft position, the rate at which drafts are accepted (adaptive k).

r_i = P(draft i accepted | drafts before it accepted) is a ratio of time-decayed row counts (rows
that passed position i over rows that tested it; each row's weight halves every half_life decode
steps), shrunk towards the rate before it (the first towards prior_rate) as if prior_rows more
rows had shown that rate. E[accepted | k] = sum_{j<=k} prod_{i<=j} r_i. docs/ADAPTIVE.md says why.
"""

from __future__ import annotations

from collections.abc import Sequence


class AcceptanceEstimate:
    """max_num_draft_tokens: K (positions 1..K); half_life: decode steps after which an observed row
    counts half; prior_rate, prior_rows: the shrinkage target and weight. Raises ValueError naming a
    bad setting."""

    def __init__(self, max_num_draft_tokens: int, half_life: float, prior_rate: float, prior_rows: float):
        if half_life <= 0.0:
            raise ValueError(f"acceptance_half_life must be > 0 steps, got {half_life}")
        if prior_rows < 0.0:
            raise ValueError(f"prior_acceptance_rows must be >= 0, got {prior_rows}")
        if not 0.0 <= prior_rate <= 1.0:
            raise ValueError(f"prior_acceptance_rate must lie in [0, 1], got {prior_rate}")
        self.max_num_draft_tokens = max_num_draft_tokens
        self.half_life = half_life
        self.prior_rate = prior_rate
        self.prior_rows = prior_rows
        self.rates = [prior_rate] * max_num_draft_tokens
        self.length: float | None = None  # decayed mean tokens per verify row, steps with k > 0
        self._tested = [0.0] * max_num_draft_tokens  # decayed rows that tested position i
        self._passed = [0.0] * max_num_draft_tokens  # ... and passed it
        self._length_sums = [0.0, 0.0]  # decayed tokens per verify row, rows
        self._recorded_at = 0  # the step clock at the last record

    def expected_accepted(self, num_draft_tokens: int) -> float:
        """E[accepted drafts | k drafts] under the current rates."""
        total, chain = 0.0, 1.0
        for rate in self.rates[:num_draft_tokens]:
            chain *= rate
            total += chain
        return total

    def record(self, num_draft_tokens: int | Sequence[int], num_accepted: Sequence[int], now: int) -> None:
        """Folds one verify step in. num_draft_tokens: the k of the step, or one count per row;
        num_accepted: drafts accepted per row; now: the decode-step clock (decays older rows)."""
        rows = list(num_accepted)
        drafted = (
            [num_draft_tokens] * len(rows) if isinstance(num_draft_tokens, int) else list(num_draft_tokens)
        )
        if not rows or max(drafted) == 0:
            return
        decay = 0.5 ** ((now - self._recorded_at) / self.half_life)
        self._recorded_at = now
        for sums in (self._tested, self._passed, self._length_sums):
            sums[:] = [x * decay for x in sums]
        for i in range(1, min(max(drafted), self.max_num_draft_tokens) + 1):
            tested = passed = 0
            for a, d in zip(rows, drafted, strict=True):
                if d >= i and a >= i - 1:
                    tested += 1
                    passed += a >= i
            if tested == 0:
                break
            self._tested[i - 1] += tested
            self._passed[i - 1] += passed
        shrink_to, m = self.prior_rate, self.prior_rows
        for i, (tested, passed) in enumerate(zip(self._tested, self._passed, strict=True)):
            if tested + m > 0.0:
                self.rates[i] = (passed + m * shrink_to) / (tested + m)
            shrink_to = self.rates[i]
        self._length_sums[0] += len(rows) + sum(rows)
        self._length_sums[1] += len(rows)
        self.length = self._length_sums[0] / self._length_sums[1]
