"""Statistics for benchmark results: percentiles, mean/stdev/CV, Student-t confidence intervals.

Pure Python (no scipy, which the GPU machine lacks). The t quantile inverts the t CDF, computed from
the regularized incomplete beta function by a continued fraction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def percentile(values: Sequence[float], q: float, weights: Sequence[float] | None = None) -> float:
    """The q-th percentile (q in [0, 100]) with linear interpolation between order statistics.

    With `weights` (non-negative, e.g. tokens per chunk) each value counts as that many observations;
    integer weights give the same result as repeating each value. Returns NaN for no values.
    Raises ValueError when q lies outside [0, 100] or the lengths differ.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    if weights is None:
        weights = [1.0] * len(values)
    if len(weights) != len(values):
        raise ValueError(f"{len(values)} values but {len(weights)} weights")
    pairs = sorted((v, w) for v, w in zip(values, weights, strict=True) if w > 0)
    if not pairs:
        return math.nan
    total = sum(w for _, w in pairs)
    # Observation k (0-based, fractional) of a sample of size `total`; value i covers [start, start + w).
    rank = q / 100.0 * (total - 1) if total > 1 else 0.0
    cumulative = 0.0
    for i, (value, weight) in enumerate(pairs):
        if rank <= cumulative + weight - 1:
            return value
        if rank < cumulative + weight:
            following = pairs[i + 1][0] if i + 1 < len(pairs) else value
            fraction = rank - (cumulative + weight - 1)
            return value + fraction * (following - value)
        cumulative += weight
    return pairs[-1][0]


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return result


def regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for a, b > 0 and x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t value with P(T <= t) = p, for p in (0, 1) and df > 0. Raises ValueError otherwise."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t quantile needs p in (0, 1), got {p}")
    if df <= 0:
        raise ValueError(f"t quantile needs df > 0, got {df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


@dataclass(slots=True)
class Summary:
    """n, mean, sample stdev, coefficient of variation (stdev / mean) and a t-based CI of the mean.

    With one value stdev is 0 and the CI is unbounded (-inf, inf): one run says nothing about spread.
    """

    n: int
    mean: float
    stdev: float
    cv: float
    ci_low: float
    ci_high: float
    confidence: float

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(values: Sequence[float], confidence: float = 0.95) -> Summary:
    """Mean, stdev, CV and the two-sided `confidence` t interval of the mean of `values`.

    Raises ValueError for no values or a confidence outside (0, 1).
    """
    if not values:
        raise ValueError("cannot summarize an empty list of values")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return Summary(n, mean, 0.0, 0.0, -math.inf, math.inf, confidence)
    stdev = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half_width = t_quantile(0.5 + confidence / 2.0, n - 1) * stdev / math.sqrt(n)
    cv = stdev / abs(mean) if mean != 0 else math.inf
    return Summary(n, mean, stdev, cv, mean - half_width, mean + half_width, confidence)


@dataclass(slots=True)
class RatioEstimate:
    """b / a with a two-sided CI; `paired` says whether it came from per-repeat ratios."""

    ratio: float
    ci_low: float
    ci_high: float
    paired: bool


def ratio_ci(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> RatioEstimate:
    """The ratio mean(b) / mean(a) with a t-based `confidence` interval.

    Equal lengths are treated as paired repeats (repeat i of a ran next to repeat i of b): the CI is
    the t interval of the per-pair ratios. Otherwise the delta method on the two means, with
    min(n) - 1 degrees of freedom. One value on either side gives an unbounded CI.
    Raises ValueError for an empty side or a non-positive mean of a.
    """
    if not a or not b:
        raise ValueError("ratio_ci needs at least one value on each side")
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    if mean_a <= 0:
        raise ValueError(f"ratio_ci needs a positive baseline mean, got {mean_a}")
    if len(a) == len(b) and all(x > 0 for x in a):
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        s = summarize(ratios, confidence)
        return RatioEstimate(s.mean, s.ci_low, s.ci_high, True)
    ratio = mean_b / mean_a
    n = min(len(a), len(b))
    if n < 2:
        return RatioEstimate(ratio, -math.inf, math.inf, False)
    sa, sb = summarize(a, confidence), summarize(b, confidence)
    rel_se = math.sqrt((sa.stdev**2 / len(a)) / mean_a**2 + (sb.stdev**2 / len(b)) / max(mean_b, 1e-300) ** 2)
    half_width = t_quantile(0.5 + confidence / 2.0, n - 1) * ratio * rel_se
    return RatioEstimate(ratio, ratio - half_width, ratio + half_width, False)
