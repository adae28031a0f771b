"""AdaptivePolicy: how many draft tokens to use in the next decode step, zero included.

Each step the engine asks `choose(decode_batch_size)` and later reports what happened:
`record_step` with the measured wall time of the whole speculative step (draft + verify + draft
extend) and `record_acceptance` with how many drafts each row accepted. The policy keeps

- per (batch bucket, k) an exponential moving average (EMA) of the step time; the bucket is the
  CUDA-graph batch size the decode batch is padded to, so the cost of a bucket does not depend on
  the exact batch inside it. The first sample of each (bucket, k) is dropped (the first replay of a
  captured graph uploads it to the device, a one-off cost) and the estimate is the median of the
  next ones until about 1 / alpha have been seen, then the EMA takes over, so a one-off slow step
  (a JIT compile, a page fault) among the first samples does not move it. A bucket where k was
  never measured borrows a cost interpolated linearly in batch size from the nearest buckets on
  either side where it was (decode step time grows smoothly with the batch);
- per draft position i an EMA of the conditional acceptance rate r_i = P(draft i accepted | drafts
  before it accepted), so E[accepted | k] = sum_{j<=k} prod_{i<=j} r_i; until a position has seen
  about 1 / alpha rows the estimate is the running mean of what it saw (the prior counting as
  `prior_acceptance_rows` rows), so a fresh policy leaves its prior within a few steps;

and picks the k that maximises expected tokens per second, (1 + E[accepted | k]) * batch / cost.
Guards against the ways such controllers fail in practice:

- exploration: a k with neither a measured nor an interpolated cost in this bucket is tried
  `min_cost_samples` times (the first dropped, the median of the others) before the bucket commits
  to a choice (or seed costs from a start-up
  profile, `set_cost`); a bucket between explored ones needs no exploration;
- hysteresis: a bucket switches k only after some other k beats the committed one by more than
  `switch_margin` on `switch_patience` consecutive steps, so noisy costs do not flip CUDA graphs.
  The margin is small (2 %): it bounds how far below the best (by the estimates) a bucket may sit
  for good, and the patience, not the margin, is what absorbs noise;
- no switch on stale evidence: the cost of a k that is not being run stops being measured while the
  context grows and the committed k's cost grows with it, so an old sample makes it look cheaper than
  it is. When a challenger has won `switch_patience` steps but its cost in this bucket is older than
  `stale_after` of the bucket's steps (or was only interpolated), the bucket runs it once to measure
  it afresh (that sample replaces the aged estimate: `refresh_weight` 1) and the streak starts over;
- probing: while a bucket sits at k = 0 no acceptance is observed, so every `probe_interval`
  steps it drafts the maximum k once to refresh the acceptance estimates; speculation comes back
  when acceptance improves (the engine keeps the draft KV current at k = 0 for exactly this).

Pure Python, no torch: the engine times steps itself (after a device synchronisation) and passes
only decode steps (steps with prefill chunks are excluded; they would bias the cost).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence


class AdaptivePolicy:
    def __init__(
        self,
        max_num_draft_tokens: int,
        batch_buckets: Sequence[int],
        cost_ema_alpha: float = 0.1,
        acceptance_ema_alpha: float = 0.02,
        max_acceptance_step_weight: float = 0.25,
        prior_acceptance_rate: float = 0.7,
        prior_acceptance_rows: int = 4,
        switch_margin: float = 0.02,
        switch_patience: int = 16,
        min_cost_samples: int = 4,
        probe_interval: int = 256,
        stale_after: int = 64,
        refresh_weight: float = 1.0,
    ):
        """max_num_draft_tokens: K, the largest k (k = 0..K are candidates); batch_buckets: the
        sorted decode batch sizes with captured CUDA graphs (a batch beyond the last uses the last).
        acceptance_ema_alpha is the weight of one verified row: a step that tests n rows at a
        position moves that position's estimate by 1 - (1 - alpha)^n, at most
        max_acceptance_step_weight, so batch-1 steps (one noisy observation each) move it little.
        Raises ValueError naming a bad setting."""
        if max_num_draft_tokens < 1:
            raise ValueError(f"max_num_draft_tokens must be >= 1, got {max_num_draft_tokens}")
        if not batch_buckets or any(b < 1 for b in batch_buckets):
            raise ValueError(f"batch_buckets must be positive batch sizes, got {list(batch_buckets)}")
        for name, value in (
            ("cost_ema_alpha", cost_ema_alpha),
            ("acceptance_ema_alpha", acceptance_ema_alpha),
        ):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must lie in (0, 1], got {value}")
        if not 0.0 <= prior_acceptance_rate <= 1.0:
            raise ValueError(f"prior_acceptance_rate must lie in [0, 1], got {prior_acceptance_rate}")
        self.max_num_draft_tokens = max_num_draft_tokens
        self.batch_buckets = sorted(set(batch_buckets))
        self.cost_ema_alpha = cost_ema_alpha
        self.acceptance_ema_alpha = acceptance_ema_alpha
        self.max_acceptance_step_weight = max_acceptance_step_weight
        self.switch_margin = switch_margin
        self.switch_patience = switch_patience
        self.min_cost_samples = min_cost_samples
        self.probe_interval = probe_interval
        self.stale_after = stale_after
        self.refresh_weight = refresh_weight
        self.acceptance_rates = [prior_acceptance_rate] * max_num_draft_tokens
        self._rows_seen = [max(prior_acceptance_rows, 1)] * max_num_draft_tokens  # prior included
        self.acceptance_length: float | None = None  # EMA of tokens per step, steps with k > 0
        self.current_num_draft_tokens = max_num_draft_tokens  # the last choice, for /metrics
        self._cost: dict[tuple[int, int], float] = {}
        self._early: dict[tuple[int, int], list[float]] = {}  # the first samples (their median is the cost)
        self.early_samples = max(1, round(1.0 / cost_ema_alpha))
        self._samples: dict[tuple[int, int], int] = {}
        self._committed: dict[int, int] = {}
        self._better_streak: dict[int, int] = {}
        self._steps_at_zero: dict[int, int] = {}
        self._clock: dict[int, int] = {}  # choose() calls per bucket
        self._sampled_at: dict[tuple[int, int], int] = {}  # the bucket's clock at a key's last sample

    def bucket_of(self, decode_batch_size: int) -> int:
        """The CUDA-graph batch size a decode batch of this size runs in."""
        i = bisect.bisect_left(self.batch_buckets, decode_batch_size)
        return self.batch_buckets[min(i, len(self.batch_buckets) - 1)]

    def expected_accepted(self, num_draft_tokens: int) -> float:
        """E[accepted drafts | k drafts] under the current per-position acceptance estimates."""
        total, chain = 0.0, 1.0
        for rate in self.acceptance_rates[:num_draft_tokens]:
            chain *= rate
            total += chain
        return total

    def step_cost(self, decode_batch_size: int, num_draft_tokens: int) -> float | None:
        """Seconds per step in this batch's bucket: measured there, else interpolated from the
        nearest measured buckets on either side; None when neither exists."""
        return self._estimated_cost(self.bucket_of(decode_batch_size), num_draft_tokens)

    def expected_tokens_per_second(self, decode_batch_size: int, num_draft_tokens: int) -> float | None:
        cost = self.step_cost(decode_batch_size, num_draft_tokens)
        if cost is None or cost <= 0:
            return None
        return (1.0 + self.expected_accepted(num_draft_tokens)) * decode_batch_size / cost

    def _measured(self, bucket: int, k: int) -> bool:
        return self._samples.get((bucket, k), 0) >= self.min_cost_samples

    def _estimated_cost(self, bucket: int, k: int) -> float | None:
        if self._measured(bucket, k):
            return self._cost[(bucket, k)]
        below = [b for b in self.batch_buckets if b < bucket and self._measured(b, k)]
        above = [b for b in self.batch_buckets if b > bucket and self._measured(b, k)]
        if not below or not above:
            return None
        lo, hi = below[-1], above[0]
        t = (bucket - lo) / (hi - lo)
        return self._cost[(lo, k)] + t * (self._cost[(hi, k)] - self._cost[(lo, k)])

    def choose(self, decode_batch_size: int) -> int:
        """The number of draft tokens for the next decode step of this many sequences (0..K)."""
        choice = self._choose(decode_batch_size, self.bucket_of(decode_batch_size))
        self.current_num_draft_tokens = choice
        return choice

    def _aged(self, bucket: int, k: int) -> bool:
        """Measured in this bucket, but not within its last stale_after steps."""
        age = self._clock.get(bucket, 0) - self._sampled_at.get((bucket, k), 0)
        return self._measured(bucket, k) and age > self.stale_after

    def _stale(self, bucket: int, k: int) -> bool:
        return not self._measured(bucket, k) or self._aged(bucket, k)  # interpolated or aged

    def _choose(self, batch: int, bucket: int) -> int:
        self._clock[bucket] = self._clock.get(bucket, 0) + 1
        candidates = range(self.max_num_draft_tokens + 1)
        costs = {k: self._estimated_cost(bucket, k) for k in candidates}
        for k in candidates:
            if costs[k] is None:
                return k  # explore
        scores = {k: (1.0 + self.expected_accepted(k)) * batch / costs[k] for k in candidates}
        best = max(candidates, key=lambda k: scores[k])
        committed = self._committed.setdefault(bucket, best)
        if best != committed and scores[best] > scores[committed] * (1.0 + self.switch_margin):
            self._better_streak[bucket] = self._better_streak.get(bucket, 0) + 1
            if self._better_streak[bucket] >= self.switch_patience:
                self._better_streak[bucket] = 0
                if self._stale(bucket, best):
                    return best  # measure the challenger afresh before switching to it
                self._committed[bucket] = committed = best
        else:
            self._better_streak[bucket] = 0
        if committed == 0:
            self._steps_at_zero[bucket] = self._steps_at_zero.get(bucket, 0) + 1
            if self._steps_at_zero[bucket] >= self.probe_interval:
                self._steps_at_zero[bucket] = 0
                return self.max_num_draft_tokens
        return committed

    def snapshot(self, decode_batch_size: int) -> dict:
        """What the policy believes for this batch's bucket (for benchmark records and debugging):
        the committed k, each k's cost estimate in ms (None: unknown; measured or interpolated) and
        expected tokens per second, and the per-position acceptance rates."""
        bucket = self.bucket_of(decode_batch_size)
        costs = {k: self._estimated_cost(bucket, k) for k in range(self.max_num_draft_tokens + 1)}
        return {
            "bucket": bucket,
            "committed_k": self._committed.get(bucket),
            "cost_ms": {k: None if c is None else round(1e3 * c, 3) for k, c in costs.items()},
            "measured": [k for k in costs if self._measured(bucket, k)],
            "tok_s": {k: self.expected_tokens_per_second(decode_batch_size, k) for k in costs},
            "acceptance_rates": [round(r, 4) for r in self.acceptance_rates],
        }

    def set_cost(self, decode_batch_size: int, num_draft_tokens: int, seconds: float) -> None:
        """Seeds the cost of (bucket, k) from a start-up profile, so it needs no exploration."""
        key = (self.bucket_of(decode_batch_size), num_draft_tokens)
        self._cost[key] = seconds
        self._early[key] = [seconds]
        self._samples[key] = max(self._samples.get(key, 0), self.min_cost_samples)

    def record_step(self, decode_batch_size: int, num_draft_tokens: int, seconds: float) -> None:
        """Folds the measured wall time of one decode step (drafting, verifying, draft extend) in."""
        bucket = self.bucket_of(decode_batch_size)
        key = (bucket, num_draft_tokens)
        aged = self._aged(bucket, num_draft_tokens)
        samples = self._samples[key] = self._samples.get(key, 0) + 1
        self._sampled_at[key] = self._clock.get(bucket, 0)
        if samples == 1:
            return  # the first replay of a graph pays its upload: not what the next steps cost
        early = self._early.setdefault(key, [])
        if aged and self.refresh_weight >= 1.0:
            early.clear()  # the aged estimate is replaced, not averaged with the new sample
        if len(early) < self.early_samples:
            early.append(seconds)
            self._cost[key] = statistics.median(early)
            return
        weight = max(self.cost_ema_alpha, self.refresh_weight) if aged else self.cost_ema_alpha
        self._cost[key] += weight * (seconds - self._cost[key])

    def record_acceptance(self, num_draft_tokens: int | Sequence[int], num_accepted: Sequence[int]) -> None:
        """Folds one verify step in. num_draft_tokens: the k of the step, or one count per row (a
        drafter may propose fewer); num_accepted: drafts accepted per row."""
        rows = list(num_accepted)
        drafted = (
            [num_draft_tokens] * len(rows) if isinstance(num_draft_tokens, int) else list(num_draft_tokens)
        )
        if not rows or max(drafted) == 0:
            return
        for i in range(1, min(max(drafted), self.max_num_draft_tokens) + 1):
            tested = passed = 0
            for a, d in zip(rows, drafted, strict=True):
                if d >= i and a >= i - 1:
                    tested += 1
                    passed += a >= i
            if tested == 0:
                break
            self._rows_seen[i - 1] += tested
            weight = max(self._weight(tested), tested / self._rows_seen[i - 1])  # running mean at first
            self.acceptance_rates[i - 1] += weight * (passed / tested - self.acceptance_rates[i - 1])
        mean_length = 1.0 + sum(rows) / len(rows)
        old = self.acceptance_length
        weight = self._weight(len(rows))
        self.acceptance_length = mean_length if old is None else old + weight * (mean_length - old)

    def _weight(self, num_rows: int) -> float:
        return min(1.0 - (1.0 - self.acceptance_ema_alpha) ** num_rows, self.max_acceptance_step_weight)
