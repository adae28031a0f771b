import random

from tpfuse.bench.compare import PointThroughput, find_crossover


def sweep(ratios_by_c, base=1000.0, noise=0.01, repeats=5, seed=0):
    """Paired synthetic sweeps: A runs at `base`, B at base * ratio, each with relative noise."""
    rng = random.Random(seed)
    a, b = [], []
    for c, ratio in ratios_by_c.items():
        drift = [base * (1 + rng.gauss(0, noise)) for _ in range(repeats)]
        a.append(PointThroughput(c, drift, True))
        b.append(PointThroughput(c, [x * ratio * (1 + rng.gauss(0, noise)) for x in drift], True))
    return a, b


def test_crossover_is_the_first_level_where_b_is_confidently_slower():
    a, b = sweep({1: 1.8, 2: 1.6, 4: 1.3, 8: 1.05, 16: 0.85, 32: 0.7})
    result = find_crossover(a, b)
    assert result.concurrency == 16
    assert [r.concurrency for r in result.rows] == [1, 2, 4, 8, 16, 32]


def test_a_ratio_below_one_whose_interval_reaches_one_is_not_a_crossover():
    a, b = sweep({1: 1.5, 2: 0.97, 4: 0.6}, noise=0.08, repeats=3, seed=5)
    result = find_crossover(a, b)
    row = next(r for r in result.rows if r.concurrency == 2)
    assert row.ratio < 1.0 < row.ci_high
    assert result.concurrency == 4


def test_no_crossover_when_b_stays_faster():
    a, b = sweep({1: 2.0, 4: 1.5, 16: 1.1})
    assert find_crossover(a, b).concurrency is None


def test_invalid_points_never_decide_the_crossover():
    a, b = sweep({1: 1.5, 2: 0.5, 4: 0.6})
    b[1].valid = False
    result = find_crossover(a, b)
    assert result.concurrency == 4
    assert not result.rows[1].valid


def test_only_levels_measured_by_both_sweeps_are_compared():
    a, b = sweep({1: 1.2, 2: 0.5})
    a.append(PointThroughput(64, [1.0, 1.0], True))
    assert [r.concurrency for r in find_crossover(a, b).rows] == [1, 2]


def test_unequal_repeat_counts_fall_back_to_an_unpaired_interval():
    a = [PointThroughput(1, [100.0, 101.0, 99.0, 100.5], True)]
    b = [PointThroughput(1, [60.0, 61.0, 59.5], True)]
    result = find_crossover(a, b)
    assert not result.rows[0].paired
    assert result.concurrency == 1
