import math
import random
import statistics

import numpy as np
import pytest

from tpfuse.bench.stats import percentile, ratio_ci, summarize, t_cdf, t_quantile


def test_percentile_matches_numpy_linear_interpolation_on_random_data():
    rng = random.Random(1)
    for _ in range(100):
        values = [rng.uniform(-5, 5) for _ in range(rng.randint(1, 40))]
        q = rng.uniform(0, 100)
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-12)


def test_weighted_percentile_equals_percentile_of_values_repeated_by_weight():
    rng = random.Random(2)
    for _ in range(100):
        n = rng.randint(1, 15)
        values = [rng.random() for _ in range(n)]
        weights = [rng.randint(0, 4) for _ in range(n)]
        if sum(weights) == 0:
            continue
        repeated = [v for v, w in zip(values, weights, strict=True) for _ in range(w)]
        q = rng.uniform(0, 100)
        assert percentile(values, q, weights) == pytest.approx(float(np.percentile(repeated, q)), abs=1e-12)


def test_percentile_of_nothing_is_nan_and_bad_q_is_refused():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must lie in"):
        percentile([1.0], 101)


@pytest.mark.parametrize(
    "df, p, published",  # two-sided 95% and 99% critical values from standard t tables
    [(1, 0.975, 12.706), (4, 0.975, 2.776), (9, 0.975, 2.262), (30, 0.975, 2.042), (4, 0.995, 4.604)],
)
def test_t_quantile_matches_published_critical_values(df, p, published):
    assert t_quantile(p, df) == pytest.approx(published, abs=1e-3)


def test_t_quantile_inverts_t_cdf_and_is_symmetric():
    for df in (1.5, 3, 17, 200):
        for p in (0.01, 0.3, 0.5, 0.8, 0.999):
            assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-10)
            assert t_quantile(1 - p, df) == pytest.approx(-t_quantile(p, df), abs=1e-9)


def test_summarize_mean_stdev_cv_agree_with_statistics_module():
    values = [random.Random(3).gauss(90, 2) for _ in range(7)]
    s = summarize(values)
    assert s.mean == pytest.approx(statistics.fmean(values))
    assert s.stdev == pytest.approx(statistics.stdev(values))
    assert s.cv == pytest.approx(statistics.stdev(values) / statistics.fmean(values))
    half = t_quantile(0.975, 6) * statistics.stdev(values) / math.sqrt(7)
    assert (s.ci_low, s.ci_high) == pytest.approx((s.mean - half, s.mean + half))


def test_summarize_of_one_value_has_unbounded_interval():
    s = summarize([5.0])
    assert (s.mean, s.stdev) == (5.0, 0.0)
    assert s.ci_low == -math.inf and s.ci_high == math.inf


def test_t_interval_covers_the_true_mean_about_95_percent_of_the_time():
    rng = random.Random(4)
    covered = 0
    for _ in range(2000):
        s = summarize([rng.gauss(10.0, 3.0) for _ in range(5)])
        covered += s.ci_low <= 10.0 <= s.ci_high
    assert 0.93 <= covered / 2000 <= 0.97


def test_paired_ratio_interval_is_the_t_interval_of_per_pair_ratios():
    a, b = [100.0, 110.0, 95.0], [80.0, 90.0, 78.0]
    r = ratio_ci(a, b)
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    expected = summarize(ratios)
    assert r.paired
    assert (r.ratio, r.ci_low, r.ci_high) == pytest.approx((expected.mean, expected.ci_low, expected.ci_high))


def test_unpaired_ratio_uses_ratio_of_means_with_an_interval_around_it():
    r = ratio_ci([100.0, 102.0, 98.0, 101.0], [50.0, 52.0])
    assert not r.paired
    assert r.ratio == pytest.approx(51.0 / 100.25)
    assert r.ci_low < r.ratio < r.ci_high
