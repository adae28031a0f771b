"""AdaptivePolicy: how many draft tokens to use in the next decode step, zero included.

Each step the engine asks `choose(decode_batch_size)` and later reports what happened:
`record_step` with the measured wall time of the whole step (scheduling, draft, verify,
postprocessing), `record_catch_up` with a catch-up step's, and `record_acceptance` with how many
drafts each row accepted. The policy keeps per (batch bucket, k) a robust estimate of the step cost
(median of the first samples, then an outlier-clipped EMA; unmeasured buckets borrow interpolated
costs) and per draft position a decayed acceptance rate (spec/acceptance.py), and picks the k that
maximises expected tokens per second, (1 + E[accepted | k]) * batch / cost, with exploration,
hysteresis, re-measurement of stale costs, a catch-up payback rule when leaving k = 0, and backed-off
probes while at k = 0. docs/ADAPTIVE.md gives each rule and why it exists.

Pure Python, no torch: the engine times steps itself and passes only decode steps (steps with
prefill chunks are excluded; they would bias the cost).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence

from tpfuse.spec.acceptance import AcceptanceEstimate


class AdaptivePolicy:
    CATCH_UP_SAMPLES = 5  # catch-up costs kept per bucket; their lower median is the estimate
    # A sample enters the moving average at most this many times the estimate: a one-off stall (on
    # the H200 a 106 ms step among 6.5 ms ones) moves it by at most 5 %, a lasting change is followed
    OUTLIER_RATIO = 1.5

    def __init__(
        self,
        max_num_draft_tokens: int,
        batch_buckets: Sequence[int],
        cost_ema_alpha: float = 0.1,
        acceptance_half_life: float = 64.0,
        prior_acceptance_rate: float = 0.7,
        prior_acceptance_rows: float = 4.0,
        switch_margin: float = 0.02,
        switch_patience: int = 16,
        min_cost_samples: int = 4,
        probe_interval: int = 256,
        stale_after: int = 64,
        refresh_weight: float = 1.0,
        refresh_steps: int = 3,
        recheck_interval: int = 512,
        plain_recheck_interval: int = 64,
        recheck_margin: float = 0.2,
        payback_steps: int = 64,
        max_backoff: int = 8,
    ):
        """max_num_draft_tokens: K, the largest k (k = 0..K are candidates); batch_buckets: the
        sorted decode batch sizes with captured CUDA graphs (a batch beyond the last uses the last).
        acceptance_half_life: decode steps (choose() calls) after which an observed row counts half.
        Raises ValueError naming a bad setting."""
        if max_num_draft_tokens < 1:
            raise ValueError(f"max_num_draft_tokens must be >= 1, got {max_num_draft_tokens}")
        if not batch_buckets or any(b < 1 for b in batch_buckets):
            raise ValueError(f"batch_buckets must be positive batch sizes, got {list(batch_buckets)}")
        if not 0.0 < cost_ema_alpha <= 1.0:
            raise ValueError(f"cost_ema_alpha must lie in (0, 1], got {cost_ema_alpha}")
        for name, count in (
            ("refresh_steps", refresh_steps),
            ("recheck_interval", recheck_interval),
            ("plain_recheck_interval", plain_recheck_interval),
            ("payback_steps", payback_steps),
            ("max_backoff", max_backoff),
        ):
            if count < 1:
                raise ValueError(f"{name} must be >= 1, got {count}")
        self.max_num_draft_tokens = max_num_draft_tokens
        self.batch_buckets = sorted(set(batch_buckets))
        self.cost_ema_alpha = cost_ema_alpha
        self.switch_margin = switch_margin
        self.switch_patience = switch_patience
        self.min_cost_samples = min_cost_samples
        self.probe_interval = probe_interval
        self.stale_after = stale_after
        self.refresh_weight = refresh_weight
        self.refresh_steps = refresh_steps
        self.recheck_interval = recheck_interval
        self.plain_recheck_interval = plain_recheck_interval
        self.recheck_margin = recheck_margin
        self.payback_steps = payback_steps
        self.max_backoff = max_backoff
        self._backoff: dict[int, int] = {}  # bucket at k = 0 -> factor on its probe and recheck intervals
        # bucket -> the last few seconds a catch-up step added to a plain one (_catch_up_extra)
        self._catch_up_samples: dict[int, list[float]] = {}
        self.acceptance = AcceptanceEstimate(
            max_num_draft_tokens, acceptance_half_life, prior_acceptance_rate, prior_acceptance_rows
        )
        self._steps = 0  # choose() calls, the clock of the acceptance decay
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
        self._refreshing: dict[int, tuple[int, int]] = {}  # bucket -> (k being re-measured, steps left)

    def bucket_of(self, decode_batch_size: int) -> int:
        """The CUDA-graph batch size a decode batch of this size runs in."""
        i = bisect.bisect_left(self.batch_buckets, decode_batch_size)
        return self.batch_buckets[min(i, len(self.batch_buckets) - 1)]

    @property
    def acceptance_rates(self) -> list[float]:
        return self.acceptance.rates

    @property
    def acceptance_length(self) -> float | None:
        return self.acceptance.length

    def expected_accepted(self, num_draft_tokens: int) -> float:
        """E[accepted drafts | k drafts] under the current per-position acceptance estimates."""
        return self.acceptance.expected_accepted(num_draft_tokens)

    def step_cost(self, decode_batch_size: int, num_draft_tokens: int) -> float | None:
        """Seconds per step in this batch's bucket: measured there, else interpolated from the
        nearest measured buckets on either side, else the nearest measured bucket's above; None
        when no bucket at or above it was measured."""
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
        if not above:
            return None
        if not below:
            return self._cost[(above[0], k)]
        lo, hi = below[-1], above[0]
        t = (bucket - lo) / (hi - lo)
        return self._cost[(lo, k)] + t * (self._cost[(hi, k)] - self._cost[(lo, k)])

    def choose(self, decode_batch_size: int) -> int:
        """The number of draft tokens for the next decode step of this many sequences (0..K)."""
        self._steps += 1
        choice = self._choose(decode_batch_size, self.bucket_of(decode_batch_size))
        self.current_num_draft_tokens = choice
        return choice

    def _aged(self, bucket: int, k: int) -> bool:
        """Measured in this bucket, but not within its last stale_after steps."""
        age = self._clock.get(bucket, 0) - self._sampled_at.get((bucket, k), 0)
        return self._measured(bucket, k) and age > self.stale_after

    def _stale(self, bucket: int, k: int) -> bool:
        return not self._measured(bucket, k) or self._aged(bucket, k)  # borrowed or aged

    def _choose(self, batch: int, bucket: int) -> int:
        self._clock[bucket] = self._clock.get(bucket, 0) + 1
        if bucket in self._refreshing:  # the rest of a refresh run
            k, left = self._refreshing.pop(bucket)
            if left > 1:
                self._refreshing[bucket] = (k, left - 1)
            return k
        candidates = range(self.max_num_draft_tokens + 1)
        costs = {k: self._estimated_cost(bucket, k) for k in candidates}
        for k in candidates:
            if costs[k] is None:
                return k  # explore
        scores = {k: (1.0 + self.expected_accepted(k)) * batch / costs[k] for k in candidates}
        best = max(candidates, key=lambda k: scores[k])
        committed = self._committed.setdefault(bucket, best)
        margin = self.switch_margin
        if committed == 0 and best != 0:  # the switch must pay back the catch-up it costs
            margin = max(margin, self._catch_up_extra(bucket, 0.0) / (self.payback_steps * costs[0]))
        if best != committed and scores[best] > scores[committed] * (1.0 + margin):
            self._better_streak[bucket] = self._better_streak.get(bucket, 0) + 1
            if self._better_streak[bucket] >= self.switch_patience:
                self._better_streak[bucket] = 0
                if self._stale(bucket, best):  # measure the challenger afresh before switching to it
                    return self._refresh(bucket, best)
                self._committed[bucket] = committed = best
                self._backoff.pop(bucket, None)  # probes and rechecks start over at their base
                self._steps_at_zero.pop(bucket, None)
        else:
            self._better_streak[bucket] = 0
        clock = self._clock[bucket]
        floor = (1.0 - self.recheck_margin) * scores[committed]
        if (
            committed
            and clock % self.plain_recheck_interval == 0
            and scores[0] >= floor
            and self._stale(bucket, 0)
        ):
            return self._refresh(bucket, 0)
        backoff = self._backoff.get(bucket, 1) if committed == 0 else 1
        if clock % (self.recheck_interval * backoff) == 0:
            rivals = [
                k for k in candidates if k != committed and scores[k] >= floor and self._stale(bucket, k)
            ]
            if rivals:  # the one measured longest ago, so each rival gets its turn
                oldest = min(rivals, key=lambda k: self._sampled_at.get((bucket, k), -1))
                self._back_off_at_zero(bucket, committed)
                return self._refresh(bucket, oldest)
        if committed == 0:
            self._steps_at_zero[bucket] = self._steps_at_zero.get(bucket, 0) + 1
            if self._steps_at_zero[bucket] >= self.probe_interval * backoff:
                self._steps_at_zero[bucket] = 0
                self._back_off_at_zero(bucket, committed)
                return self.max_num_draft_tokens
        return committed

    def _back_off_at_zero(self, bucket: int, committed: int) -> None:
        """A probe or recheck fires in bucket: at k = 0 the next ones wait twice as long (capped)."""
        if committed == 0:
            self._backoff[bucket] = min(2 * self._backoff.get(bucket, 1), self.max_backoff)

    def _refresh(self, bucket: int, k: int) -> int:
        """Starts a refresh run of k in bucket; returns k for its first step."""
        if self.refresh_steps > 1:
            self._refreshing[bucket] = (k, self.refresh_steps - 1)
        return k

    def committed(self, decode_batch_size: int) -> int | None:
        """The k this batch's bucket settled on (refresh runs and probes aside); None before exploring."""
        return self._committed.get(self.bucket_of(decode_batch_size))

    def snapshot(self, decode_batch_size: int) -> dict:
        """What the policy believes for this batch's bucket (for benchmark records and debugging):
        the committed k, each k's cost estimate in ms (None: unknown; measured or borrowed) and
        expected tokens per second, and the per-position acceptance rates."""
        bucket = self.bucket_of(decode_batch_size)
        costs = {k: self._estimated_cost(bucket, k) for k in range(self.max_num_draft_tokens + 1)}
        return {
            "bucket": bucket,
            "committed_k": self.committed(decode_batch_size),
            "cost_ms": {k: None if c is None else round(1e3 * c, 3) for k, c in costs.items()},
            "measured": [k for k in costs if self._measured(bucket, k)],
            "tok_s": {k: self.expected_tokens_per_second(decode_batch_size, k) for k in costs},
            "acceptance_rates": [round(r, 4) for r in self.acceptance_rates],
            "catch_up_extra_ms": (
                round(1e3 * self._catch_up_extra(bucket), 3) if bucket in self._catch_up_samples else None
            ),
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
        if aged:  # re-measured: the sample replaces (refresh_weight 1) or outweighs the old estimate
            weight = max(self.cost_ema_alpha, self.refresh_weight)
        else:
            weight, seconds = self.cost_ema_alpha, min(seconds, self.OUTLIER_RATIO * self._cost[key])
        self._cost[key] += weight * (seconds - self._cost[key])

    def record_catch_up(self, decode_batch_size: int, seconds: float) -> None:
        """Folds in the wall time of a catch-up step (a k = 0 step that extends lagging drafters, run
        when drafting resumes after plain steps): what it costs beyond a plain step, taken as the
        lower median of the bucket's last CATCH_UP_SAMPLES (a lone first sample stands alone)."""
        bucket = self.bucket_of(decode_batch_size)
        plain = self._estimated_cost(bucket, 0)
        if plain is None:
            return
        recent = self._catch_up_samples.setdefault(bucket, [])
        recent.append(max(0.0, seconds - plain))
        del recent[: -self.CATCH_UP_SAMPLES]

    def _catch_up_extra(self, bucket: int, default: float | None = None) -> float | None:
        """Seconds a catch-up step adds to a plain one in bucket: the lower median of its recent ones,
        so a one-off stall (on the H200 one catch-up step took 0.7 s where they cost 4-15 ms) does
        not pin the bucket at k = 0 through the payback rule."""
        recent = self._catch_up_samples.get(bucket)
        return statistics.median_low(recent) if recent else default

    def record_acceptance(self, num_draft_tokens: int | Sequence[int], num_accepted: Sequence[int]) -> None:
        """Folds one verify step in. num_draft_tokens: the k of the step, or one count per row (a
        drafter may propose fewer); num_accepted: drafts accepted per row."""
        self.acceptance.record(num_draft_tokens, num_accepted, self._steps)
