"""The statistics of per-token values against the unquantized model, as llama.cpp's ``llama-perplexity
--kl-divergence`` prints them, plus intervals from blocks of windows.

``tokens``: any object with (N,) arrays ``window``, ``nll``, ``nll_base``, ``kld``, ``same_top``, ``p_diff``
(``TokenScores``). llama.cpp's formulas (tools/perplexity/perplexity.cpp)::

    mean_and_uncertainty(x) = mean(x), sqrt((mean(x^2) - mean(x)^2) / (n - 1))      (0 for n <= 10)
    PPL(Q) = exp(mean nll) +- PPL * u(nll)                   ln(PPL(Q)/PPL(base)) = mean nll - mean nll_base
    u(ln ratio) = sqrt(u(nll)^2 + u(nll_base)^2 - 2 cov),    cov = (mean(nll nll_base) - mean nll mean nll_base) / (n-1)
    Cor(ln PPL(Q), ln PPL(base)) = cov / (u(nll) u(nll_base))
    RMS dp = sqrt(mean dp^2) +- 0.5 / RMS * u(dp^2)           same top = k / n +- sqrt(p (1 - p) / (n - 1))
    percentile(f) = linear between sorted values at f (n - 1); median: the middle one, or the mean of the two

Tokens of one window are not independent (llama.cpp's uncertainties treat them so); ``delta_nll_ci`` and
``kld_ci`` are 95% percentile-bootstrap intervals over windows (whole windows resampled, seeded), the paired interval
this toolkit reports everywhere else.
"""

from __future__ import annotations

import math

import numpy as np

from outlierscope.analysis.paired import BOOTSTRAP_REPS

KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1)


def mean_and_uncertainty(x: np.ndarray) -> tuple[float, float]:
    """llama.cpp's mean and its uncertainty (0 for 10 values or fewer).

    Args:
        x: the values."""
    n = len(x)
    if n < 1:
        return 0.0, 0.0
    f = float(np.sum(x)) / n
    df = float(np.sum(x * x)) / n - f * f
    return f, math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0


def _covariance(a: np.ndarray, b: np.ndarray) -> float:
    n = len(a)
    if n < 10:
        return 0.0
    return (float(np.sum(a * b)) / n - float(np.sum(a)) / n * float(np.sum(b)) / n) / (n - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's percentile of sorted values: linear between the neighbours of fraction x (n - 1).

    Args:
        sorted_values: the values, sorted.
        fraction: the percentile as a fraction."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = fraction * (len(sorted_values) - 1)
    i = int(p)
    p -= i
    return float((1 - p) * sorted_values[i] + p * sorted_values[min(i + 1, len(sorted_values) - 1)])


def _median(v: np.ndarray) -> float:
    n = len(v)
    return float(0.5 * (v[n // 2] + v[n // 2 - 1])) if n % 2 == 0 else float(v[n // 2])


def perplexity_stats(tokens) -> dict:
    """llama.cpp's "Perplexity statistics": the PPL of both models, the ln ratio with its uncertainty, the correlation.

    Args:
        tokens: the ``TokenScores``."""
    (m, u), (mb, ub) = mean_and_uncertainty(tokens.nll), mean_and_uncertainty(tokens.nll_base)
    cov = _covariance(tokens.nll, tokens.nll_base)
    ratio_u = math.sqrt(max(u * u + ub * ub - 2 * cov, 0.0))
    ppl, ppl_base = math.exp(m), math.exp(mb)
    return {"tokens": len(tokens.nll), "nll": m, "ppl": ppl, "ppl_unc": ppl * u, "nll_base": mb, "ppl_base": ppl_base,
            "ppl_base_unc": ppl_base * ub, "cor_ln_ppl": cov / (u * ub) if u and ub else float("nan"),
            "ln_ppl_ratio": m - mb, "ln_ppl_ratio_unc": ratio_u, "ppl_ratio": math.exp(m - mb),
            "ppl_ratio_unc": math.exp(m - mb) * ratio_u}


def kld_stats(tokens) -> dict:
    """llama.cpp's KL divergence, token probability and same-top statistics.

    Args:
        tokens: the ``TokenScores``."""
    kld = np.sort(tokens.kld)
    mean, unc = mean_and_uncertainty(tokens.kld)
    out = {"kld_mean": mean, "kld_unc": unc, "kld_max": float(kld[-1]), "kld_median": _median(kld),
           "kld_min": float(kld[0])}
    out.update({f"kld_p{q:g}": percentile(kld, q / 100) for q in KLD_PERCENTILES})
    dp2 = tokens.p_diff * tokens.p_diff
    mse, mse_u = mean_and_uncertainty(dp2)
    rms = math.sqrt(mse)
    n, same = len(kld), float(np.mean(tokens.same_top))
    out.update({"p_diff_mean": float(np.mean(tokens.p_diff)), "p_diff_rms": rms,
                "p_diff_rms_unc": 0.5 / rms * mse_u if rms > 0 else 0.0, "same_top": same,
                "same_top_unc": math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0})
    return out


def window_blocks(tokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per window (in window order): its token count, its sum of nll - nll_base, its sum of KLD.

    Args:
        tokens: the ``TokenScores``."""
    ids, start, count = np.unique(tokens.window, return_index=True, return_counts=True)
    d, k = tokens.nll - tokens.nll_base, tokens.kld
    return count, np.add.reduceat(d, start), np.add.reduceat(k, start)


def block_intervals(tokens, seed: int = 0, reps: int = BOOTSTRAP_REPS) -> dict:
    """95% percentile-bootstrap intervals over windows of the mean NLL change and the mean KLD, token-weighted.

    Args:
        tokens: the ``TokenScores``.
        seed: the bootstrap's seed.
        reps: resamples."""
    count, d, k = window_blocks(tokens)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(count), size=(reps, len(count)))  # (reps, windows)
    n = count[idx].sum(1)
    dm, km = d[idx].sum(1) / n, k[idx].sum(1) / n
    return {"delta_nll": float(d.sum() / count.sum()), "delta_nll_ci_low": float(np.percentile(dm, 2.5)),
            "delta_nll_ci_high": float(np.percentile(dm, 97.5)), "kld_ci_low": float(np.percentile(km, 2.5)),
            "kld_ci_high": float(np.percentile(km, 97.5)), "windows": int(len(count))}


def summary(tokens, seed: int = 0) -> dict:
    """Every statistic above for one spec's tokens: llama.cpp's blocks and the bootstrap intervals over windows.

    Args:
        tokens: the ``TokenScores``.
        seed: the bootstrap's seed."""
    return {**perplexity_stats(tokens), **kld_stats(tokens), **block_intervals(tokens, seed)}


def paired_runs(a, b, seed: int = 0, reps: int = BOOTSTRAP_REPS) -> dict:
    """Two models' values on the same windows, paired by window, with 95% percentile-bootstrap intervals over windows.

    Each model's mean NLL change and mean KLD (token-weighted), the differences b - a and the ratio of mean KLDs
    b / a; the same windows are resampled for both.

    Args:
        a: one model's ``TokenScores`` (the Transformer against its unquantized self under a scheme, say).
        b: the other's on the same windows (the Diff model's).
        seed: the bootstrap's seed.
        reps: resamples.

    Raises:
        ValueError: windows that differ (another tokenizer, text or protocol)."""
    count_a, d_a, k_a = window_blocks(a)
    count_b, d_b, k_b = window_blocks(b)
    if not np.array_equal(np.unique(a.window), np.unique(b.window)) or not np.array_equal(count_a, count_b):
        raise ValueError("the two runs' windows differ (another tokenizer, text or protocol): they cannot be paired")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(count_a), size=(reps, len(count_a)))  # (reps, windows)
    n = count_a[idx].sum(1)
    da, db, ka, kb = (v[idx].sum(1) / n for v in (d_a, d_b, k_a, k_b))
    total = count_a.sum()
    out = {"windows": int(len(count_a)), "tokens": int(total),
           "delta_nll_a": float(d_a.sum() / total), "delta_nll_b": float(d_b.sum() / total),
           "kld_a": float(k_a.sum() / total), "kld_b": float(k_b.sum() / total)}
    out["delta_nll_diff"] = out["delta_nll_b"] - out["delta_nll_a"]
    out["kld_diff"] = out["kld_b"] - out["kld_a"]
    out["kld_ratio"] = out["kld_b"] / out["kld_a"] if out["kld_a"] > 0 else float("nan")
    with np.errstate(divide="ignore", invalid="ignore"):
        for name, boot in (("delta_nll_diff", db - da), ("kld_diff", kb - ka), ("kld_ratio", kb / ka)):
            lo, hi = np.percentile(boot, [2.5, 97.5]) if np.isfinite(boot).all() else (float("nan"),) * 2
            out[f"{name}_ci_low"], out[f"{name}_ci_high"] = float(lo), float(hi)
    return out
