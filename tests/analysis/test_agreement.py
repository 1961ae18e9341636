"""analysis.agreement.ranking_stability: how many windows a per-candidate ranking needs, against scipy's Spearman and
cases whose answer is known by construction."""

import numpy as np
import pytest
from scipy.stats import spearmanr

from outlierscope.analysis.agreement import ranking_stability


def test_identical_windows_give_the_full_ranking_at_every_size():
    """Every window alike: any draw's means are the full text's, so rho is 1 and the top candidate is the same."""
    counts = np.full(40, 10)
    sums = np.tile(np.array([3.0, 1.0, 2.0, 5.0, 4.0]) * 10, (40, 1))  # (W, C)
    rows = ranking_stability(counts, sums, reps=50)
    assert [r["windows"] for r in rows] == [1, 2, 5, 10, 20, 40]
    for r in rows:
        assert r["spearman_median"] == pytest.approx(1.0) and r["spearman_p5"] == pytest.approx(1.0)
        assert r["same_top"] == 1.0 and r["tokens"] == 10 * r["windows"] and r["draws"] == 50


def test_noisy_windows_need_more_text():
    """Harm = a fixed order plus per-window noise of the same size: a single window's rho is scattered, the whole
    text's draws agree almost perfectly; each draw's rho as scipy computes it (checked on the first one)."""
    rng = np.random.default_rng(0)
    W, C = 256, 8
    counts = rng.integers(50, 150, W)
    per_token = np.linspace(0.1, 0.3, C)[None] + rng.normal(0, 0.3, (W, C))  # (W, C)
    sums = per_token * counts[:, None]
    rows = ranking_stability(counts, sums, reps=300, seed=1)
    small, whole = rows[0], rows[-1]
    assert small["windows"] == 8 and whole["windows"] == W
    assert small["spearman_median"] < 0.8 < whole["spearman_median"]
    assert small["spearman_p5"] < whole["spearman_p5"] and small["same_top"] < whole["same_top"]
    # the first draw of the smallest size, re-drawn with the documented seed and recomputed with scipy
    idx = np.random.default_rng(1).integers(0, W, size=(300, 8))
    means = sums[idx].sum(1) / counts[idx].sum(1)[:, None]
    full = sums.sum(0) / counts.sum()
    rho = [spearmanr(m, full)[0] for m in means]
    assert small["spearman_median"] == pytest.approx(float(np.median(rho)), abs=1e-12)
    assert small["same_top"] == pytest.approx(float(np.mean(means.argmax(1) == full.argmax())))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="expected sums"):
        ranking_stability(np.ones(3), np.ones((4, 2)))
    with pytest.raises(ValueError, match=">= 2 candidates"):
        ranking_stability(np.ones(3), np.ones((3, 1)))


def test_means_are_token_weighted():
    """A long window where candidate 0 hurts (1 nat a token over 100 tokens) and a 1-token window where candidate 1
    does (10): per token over the text candidate 0 is the most harmful (100 vs 10 of 101 tokens), not as the mean of
    the two windows' means (0.5 vs 5) would say. Two windows drawn with replacement: only the draw of the short one
    twice (1 in 4) puts candidate 1 first."""
    counts = np.array([100, 1])
    sums = np.array([[100.0, 0.0], [0.0, 10.0]])
    (row,) = ranking_stability(counts, sums, reps=4000, fractions=(1,))
    assert row["same_top"] == pytest.approx(0.75, abs=0.03)
