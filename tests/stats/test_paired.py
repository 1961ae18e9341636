import numpy as np
import pytest

from outlierscope.stats.paired import mcnemar_exact, paired_bootstrap


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
