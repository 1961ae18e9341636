"""Figures of a perplexity run: the per-token KL divergence distribution of every spec, and each spec's NLL change
and mean KL divergence with their window-block intervals (they never run a model)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from outlierscope.report.plots import PALETTE, _fit

KLD_FLOOR = 1e-8  # nats: the ECDF's left edge (a token whose distribution did not move sits there)


def kld_distribution(kld: dict[str, np.ndarray], against: str = "the unquantized model") -> plt.Figure:
    """The empirical distribution of per-token KLD, one line per spec (log x): the further right, the more a spec moves.

    Values below ``KLD_FLOOR`` are drawn at it.

    Args:
        kld: label -> per-token KLD.
        against: what the KLD is taken against, for the axis."""
    specs = {k: v for k, v in kld.items() if len(v) and np.any(v > 0)}
    fig, ax = plt.subplots(figsize=(7.2, 4.4), layout="constrained")
    colors = sns.color_palette(PALETTE, max(len(specs), 3))
    for (label, values), color in zip(specs.items(), colors):
        v = np.sort(np.maximum(values, KLD_FLOOR))
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), color=color, label=_fit(label, 2.6, 8), lw=1.4)
    ax.set_xscale("log")
    ax.set_xlabel(f"KL divergence to {against} at a token (nats)")
    ax.set_ylabel("share of scored tokens at or below")
    ax.set_title(_fit("Per-token KL divergence, every scored token", 7.0, 11))
    if specs:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def nll_and_kld(table: pd.DataFrame, against: str = "the unquantized model") -> plt.Figure:
    """Per spec, the mean NLL change and the mean KLD, each with its 95% interval over resampled windows.

    Args:
        table: a perplexity run's table.
        against: what they are taken against, for the axes."""
    rows = table[table["kld_max"] > 0].reset_index(drop=True)
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 0.45 * max(len(rows), 3) + 1.4), layout="constrained", sharey=True)
    y = np.arange(len(rows))
    for ax, (col, lo, hi, xlabel) in zip(axes, (
            ("delta_nll", "delta_nll_ci_low", "delta_nll_ci_high", "mean NLL change (nats/token)"),
            ("kld_mean", "kld_ci_low", "kld_ci_high", "mean KL divergence (nats/token)"))):
        err = np.vstack([rows[col] - rows[lo], rows[hi] - rows[col]])
        ax.errorbar(rows[col], y, xerr=err, fmt="o", color=sns.color_palette(PALETTE)[0], capsize=3)
        if col == "kld_mean" and (rows[lo] > 0).all():
            ax.set_xscale("log")  # KL divergences of schemes span orders of magnitude
        else:
            ax.axvline(0, color="0.6", lw=0.8)
        ax.set_xlabel(xlabel)
    axes[0].set_yticks(y, [_fit(lab, 2.4, 8) for lab in rows["label"]], fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(_fit(f"Against {against} on the same tokens (95% intervals over windows)", 8.6, 11))
    return fig
