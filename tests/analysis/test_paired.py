import numpy as np
import pytest

from outlierscope.analysis.paired import mcnemar_exact, paired_bootstrap


def test_statistics():
    a = np.array([1, 1, 0, 0, 1, 0, 1, 1, 0, 1] * 10, bool)
    b = a.copy()
    b[:7] = ~b[:7]
    lo, hi = paired_bootstrap(a, b, reps=2000, seed=1)
    d = b.mean() - a.mean()
    assert lo <= d <= hi
    n01 = int((a & ~b).sum())
    n10 = int((~a & b).sum())
    from scipy.stats import binom

    k = min(n01, n10)
    expected = min(1.0, 2 * binom.cdf(k, n01 + n10, 0.5))
    assert mcnemar_exact(a, b) == pytest.approx(expected)
    assert mcnemar_exact(a, a) == 1.0


def test_mean_stderr_matches_scipy():
    from scipy.stats import sem

    from outlierscope.analysis.paired import mean_stderr

    x = (np.arange(57) % 3 == 0).astype(float)
    m, s = mean_stderr(x)
    assert m == pytest.approx(x.mean()) and s == pytest.approx(sem(x, ddof=1))


def test_compare_against_numpy_reference():
    from outlierscope.analysis.paired import compare

    rng = np.random.default_rng(3)
    label = rng.integers(0, 4, 300)
    p0, p1 = rng.integers(0, 4, 300), rng.integers(0, 4, 300)
    c0, c1 = p0 == label, p1 == label
    got = compare(c0, c1, p0, p1, seed=5)
    assert got["delta"] == pytest.approx(c1.mean() - c0.mean())
    assert got["flip_rate"] == pytest.approx((p0 != p1).mean())
    rng2 = np.random.default_rng(5)  # independent loop over the same seeded resamples
    d = c1.astype(float) - c0.astype(float)
    means = np.concatenate([d[rng2.integers(0, 300, (200, 300))].mean(1) for _ in range(10)])
    lo, hi = np.percentile(means, [2.5, 97.5])
    assert (got["ci_low"], got["ci_high"]) == pytest.approx((lo, hi))
