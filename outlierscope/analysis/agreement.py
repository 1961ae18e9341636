"""Do two measures rank quantization schemes alike? Spearman's rho between the schemes' mean KL divergence on running
text and their mean change of the gold choice's log-likelihood on a task, with a bootstrap interval that resamples
both sources of noise at once: whole windows of the text (the same windows for every scheme) and task items (the same
items for every scheme).

    kld[s]  = sum over windows of KLD sums / tokens          (larger: the scheme moves the model more)
    gold[s] = mean over items of gold ll(s) - gold ll(base)   (more negative: the scheme hurts more)
    rho     = spearman(kld, -gold)                            (+1: both measures order the schemes alike)
"""

from __future__ import annotations

import numpy as np

from outlierscope.analysis.paired import BOOTSTRAP_REPS


def _spearman_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman's rho of each row pair of (R, S) arrays (average ranks for ties)."""
    from scipy.stats import rankdata

    ra, rb = rankdata(a, axis=1), rankdata(b, axis=1)  # (R, S)
    ra, rb = ra - ra.mean(1, keepdims=True), rb - rb.mean(1, keepdims=True)
    den = np.sqrt((ra * ra).sum(1) * (rb * rb).sum(1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (ra * rb).sum(1) / den


def rank_agreement(counts: np.ndarray, kld_sums: np.ndarray, gold_delta: np.ndarray, seed: int = 0,
                   reps: int = BOOTSTRAP_REPS) -> dict:
    """Spearman's rho of the schemes ranked by mean text KLD and by mean gold log-likelihood loss, with a 95% interval.

    Windows and items are resampled together (seeded).

    Args:
        counts: ``(W,)`` tokens per window.
        kld_sums: ``(W, S)`` each scheme's KLD summed over a window's tokens.
        gold_delta: ``(I, S)`` each scheme's per-item gold log-likelihood change.
        seed: the bootstrap's seed.
        reps: resamples."""
    if kld_sums.shape[1] != gold_delta.shape[1] or kld_sums.shape[1] < 3:
        raise ValueError(f"rank agreement needs the same >= 3 schemes on both sides, got {kld_sums.shape[1]} and "
                         f"{gold_delta.shape[1]}")
    kld = kld_sums.sum(0) / counts.sum()  # (S,)
    gold = gold_delta.mean(0)  # (S,)
    rho = float(_spearman_rows(kld[None], -gold[None])[0])
    rng = np.random.default_rng(seed)
    w = rng.integers(0, len(counts), size=(reps, len(counts)))  # (R, W)
    i = rng.integers(0, len(gold_delta), size=(reps, len(gold_delta)))  # (R, I)
    boot_kld = np.stack([kld_sums[r].sum(0) / counts[r].sum() for r in w])  # (R, S)
    boot_gold = np.stack([gold_delta[r].mean(0) for r in i])  # (R, S)
    boots = _spearman_rows(boot_kld, -boot_gold)
    lo, hi = np.nanpercentile(boots, [2.5, 97.5])
    return {"spearman": rho, "ci_low": float(lo), "ci_high": float(hi), "schemes": int(len(kld)),
            "windows": int(len(counts)), "items": int(len(gold_delta)), "kld": kld.tolist(), "gold": gold.tolist()}


STABILITY_FRACTIONS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1)


def ranking_stability(counts: np.ndarray, sums: np.ndarray, seed: int = 0, reps: int = 200,
                      fractions=STABILITY_FRACTIONS) -> list[dict]:
    """How much text a ranking needs: rho with the full text's ranking over draws of fewer windows.

    For each size n = fraction x W (at least 1, each once): ``reps`` draws of n windows with replacement, each
    candidate's token-weighted mean harm over them, and its Spearman rho with the ranking on all W windows.

    Args:
        counts: ``(W,)`` tokens per window.
        sums: ``(W, C)`` each candidate's harm (a layer's KLD, say) summed over a window's tokens.
        seed: the draws' seed.
        reps: draws per size.
        fractions: the sizes as fractions of W.

    Returns:
        Rows in increasing n: the median and 5th percentile of rho, the share of draws whose most harmful candidate is
        the full text's, the mean number of tokens drawn."""
    if sums.ndim != 2 or sums.shape[0] != len(counts) or sums.shape[1] < 2:
        raise ValueError(f"expected sums (windows, >= 2 candidates) matching {len(counts)} windows, got {sums.shape}")
    full = sums.sum(0) / counts.sum()  # (C,)
    rng = np.random.default_rng(seed)
    rows = []
    for n in sorted({max(1, round(f * len(counts))) for f in fractions}):
        idx = rng.integers(0, len(counts), size=(reps, n))  # (R, n)
        tokens = counts[idx].sum(1)  # (R,)
        means = sums[idx].sum(1) / tokens[:, None]  # (R, C)
        rho = _spearman_rows(means, np.broadcast_to(full, means.shape))
        rows.append({"windows": int(n), "draws": int(reps), "tokens": float(tokens.mean()),
                     "spearman_median": float(np.nanmedian(rho)), "spearman_p5": float(np.nanpercentile(rho, 5)),
                     "same_top": float(np.mean(means.argmax(1) == full.argmax()))})
    return rows
