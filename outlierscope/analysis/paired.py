"""Paired comparison of two evaluations of the same items: pure functions of 0/1 outcomes and scores.

* ``mean_stderr``: mean and standard error (sample std with n - 1, over sqrt(n)), lm-eval's ``stderr``;
* ``paired_bootstrap``: 95% percentile interval of mean(b - a), items resampled with replacement (seeded);
* ``mcnemar_exact``: two-sided exact McNemar p-value (binomial test on the discordant pairs);
* ``compare``: all of the above for one metric, plus the flip rate (share of changed predictions);
* ``mean_change``: mean(b - a) of per-item scores (a log-likelihood) with its paired bootstrap interval.

Tested against scipy and numpy re-computations in ``tests/stats/test_paired.py``.
"""

from __future__ import annotations

import numpy as np

BOOTSTRAP_REPS = 2000


def mean_stderr(correct) -> tuple[float, float]:
    """The mean and standard error (sample std with n - 1, over sqrt(n)) of 0/1 outcomes.

    Args:
        correct: the outcomes."""
    c = np.asarray(correct, dtype=np.float64)
    if len(c) < 2:
        return float(c.mean()) if len(c) else float("nan"), float("nan")
    return float(c.mean()), float(c.std(ddof=1) / np.sqrt(len(c)))


def paired_bootstrap(a, b, reps: int = BOOTSTRAP_REPS, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile interval of mean(b - a) over items resampled with replacement, seeded.

    Args:
        a: the reference's per-item values.
        b: the other's, on the same items in the same order.
        reps: resamples.
        seed: the seed."""
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(reps)
    for i in range(0, reps, 200):
        k = min(200, reps - i)
        idx = rng.integers(0, len(d), (k, len(d)))  # (k, n) resampled item indices
        means[i : i + k] = d[idx].mean(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def mcnemar_exact(a, b) -> float:
    """The two-sided exact McNemar p-value of paired 0/1 outcomes (a binomial test on the discordant pairs).

    Args:
        a: one evaluation's outcomes.
        b: the other's, on the same items."""
    from scipy.stats import binomtest

    a, b = np.asarray(a, bool), np.asarray(b, bool)
    n01 = int((a & ~b).sum())
    n10 = int((~a & b).sum())
    if n01 + n10 == 0:
        return 1.0
    return float(binomtest(n01, n01 + n10, 0.5).pvalue)


def compare(base_correct, correct, base_pred, pred, seed: int = 0) -> dict:
    """The change of one metric against a reference evaluation of the same items, in the same order.

    Args:
        base_correct: the reference's per-item outcomes.
        correct: this evaluation's.
        base_pred: the reference's predictions.
        pred: this evaluation's.
        seed: the bootstrap's seed.

    Returns:
        ``delta``, its 95% interval (``ci_low``, ``ci_high``), ``mcnemar_p`` and the ``flip_rate`` of predictions."""
    base_correct, correct = np.asarray(base_correct, bool), np.asarray(correct, bool)
    lo, hi = paired_bootstrap(base_correct, correct, seed=seed)
    return {"delta": float(correct.mean() - base_correct.mean()), "ci_low": lo, "ci_high": hi,
            "mcnemar_p": mcnemar_exact(base_correct, correct),
            "flip_rate": float((np.asarray(pred) != np.asarray(base_pred)).mean())}


def mean_change(a, b, seed: int = 0) -> dict:
    """mean(b - a) of a per-item score (the gold log-likelihood, say) and its 95% paired bootstrap interval.

    Args:
        a: the reference's per-item scores.
        b: the other's, on the same items.
        seed: the bootstrap's seed.

    Returns:
        ``{"delta", "ci_low", "ci_high"}``."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    lo, hi = paired_bootstrap(a, b, seed=seed)
    return {"delta": float((b - a).mean()), "ci_low": lo, "ci_high": hi}
