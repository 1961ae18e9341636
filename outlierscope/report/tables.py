"""Markdown tables of Table 5 and the sweep, from the tidy DataFrames (they never run a model)."""

from __future__ import annotations

import pandas as pd

from outlierscope.stats.outliers import TABLE5_RANKS


def table5_markdown(df: pd.DataFrame, facts: dict) -> str:
    head = "| Model | Activation Type | " + " | ".join(f"Top-{r}" for r in TABLE5_RANKS) + " | Median |"
    lines = [head, "|" + "---|" * (len(TABLE5_RANKS) + 3)]
    for _, r in df.iterrows():
        vals = " | ".join(f"{r[f'top{k}']:.2f}" for k in TABLE5_RANKS)
        lines.append(f"| {r['model']} | {r['activation']} | {vals} | {r['median']:.3f} |")
    ntok = ", ".join(f"{m}: {f['tokens']:,} tokens" for m, f in facts.items())
    return (
        "Largest |activation| values (k-th largest, pooled over all layers, heads and valid positions) "
        f"and the median |activation| ({ntok}).\n"
        "Attention logits are pre-softmax (q k^T * scaling, both maps of each differential head); masked (future) "
        "entries are excluded. Hidden states are the decoder layers' outputs after both residual additions. "
        "Medians come from a log-spaced histogram (relative error <= 0.5%).\n\n" + "\n".join(lines) + "\n"
    )


def sweep_table(table: pd.DataFrame) -> str:
    """Markdown: one row per model and bit width with acc, acc_norm (stderr), change vs 16 bits, CI, p, flips."""
    lines = ["| Model | Bits | acc | acc_norm | Δacc_norm vs 16 [95% CI] | McNemar p | flip rate | mean abs Δscore |"
             + (" LM loss |" if "lm_loss" in set(table["metric"]) else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if "lm_loss" in set(table["metric"]) else "")]
    for (model, _), g in table.groupby(["model", "label"], sort=False):  # one row per cell (label: bits + granularity)
        bits = int(g["bits"].iloc[0])
        m = {r["metric"]: r for _, r in g.iterrows()}
        acc, accn = m["acc"], m["acc_norm"]
        if bits == 16:
            delta, p, flip, ds = "reference", "", "", ""
        else:
            delta = f"{accn['delta_vs_16'] * 100:+.2f} [{accn['ci_low'] * 100:+.2f}, {accn['ci_high'] * 100:+.2f}]"
            p = f"{accn['mcnemar_p']:.3g}"
            flip = f"{m['flip_rate_norm']['value'] * 100:.2f}%"
            ds = f"{m['mean_abs_score_change']['value']:.3g}"
        line = (f"| {model} | {acc['label']} | {acc['value'] * 100:.2f} ± {acc['stderr'] * 100:.2f} | "
                f"{accn['value'] * 100:.2f} ± {accn['stderr'] * 100:.2f} | {delta} | {p} | {flip} | {ds} |")
        if "lm_loss" in m:
            line += f" {m['lm_loss']['value']:.4f} |"
        lines.append(line)
    return "\n".join(lines) + "\n"
