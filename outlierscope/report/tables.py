"""Markdown tables of Table 5 and the sweep, from the tidy DataFrames (they never run a model)."""

from __future__ import annotations

import pandas as pd

from outlierscope.analysis.outliers import TABLE5_RANKS
from outlierscope.quant.names import UNQUANTIZED_BITS


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


FLIP_METRIC = {"acc": "flip_rate", "acc_norm": "flip_rate_norm"}  # metric -> its flip-rate row in sweep.csv


def with_task(sweep: pd.DataFrame) -> pd.DataFrame:
    """A sweep table with its ``task`` column: a table built by hand, or from before tasks, is HellaSwag's."""
    return sweep if "task" in sweep else sweep.assign(task="hellaswag")


def by_task(sweep: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(task, its rows) in table order."""
    return list(with_task(sweep).groupby("task", sort=False))


def headline_metric(metrics) -> str:
    """The metric a task is read by: acc_norm where the task reports it (HellaSwag, ARC, ...), else acc."""
    return "acc_norm" if "acc_norm" in set(metrics) else "acc"


def sweep_table(table: pd.DataFrame) -> str:
    """Markdown: one row per (task,) model and bit width with acc, acc_norm (stderr), the change of the headline
    metric (:func:`headline_metric`) vs 16 bits with CI, McNemar p and flip rate, the mean |Δscore|."""
    table = with_task(table)
    from outlierscope.data.tasks import task_label

    many = table["task"].nunique() > 1
    all_norm = all("acc_norm" in set(g["metric"]) for _, g in table.groupby("task"))
    dname = "Δacc_norm" if all_norm else "Δ(headline)"
    lm = "lm_loss" in set(table["metric"])
    head = (["Task"] if many else []) + ["Model", "Bits", "acc", "acc_norm", f"{dname} vs 16 [95% CI]", "McNemar p",
                                         "flip rate", "mean abs Δscore"] + (["LM loss"] if lm else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (task, model, _), g in table.groupby(["task", "model", "label"], sort=False):  # one row per cell
        bits = int(g["bits"].iloc[0])
        m = {r["metric"]: r for _, r in g.iterrows()}
        hm = headline_metric(m)
        acc = m["acc"]
        accn = f"{m['acc_norm']['value'] * 100:.2f} ± {m['acc_norm']['stderr'] * 100:.2f}" if "acc_norm" in m else "–"
        if bits == 16:
            delta, p, flip, ds = "reference", "", "", ""
        else:
            h = m[hm]
            delta = f"{h['delta_vs_16'] * 100:+.2f} [{h['ci_low'] * 100:+.2f}, {h['ci_high'] * 100:+.2f}]"
            if not all_norm:
                delta += f" ({hm})"
            p = f"{h['mcnemar_p']:.3g}"
            flip = f"{m[FLIP_METRIC[hm]]['value'] * 100:.2f}%"
            ds = f"{m['mean_abs_score_change']['value']:.3g}"
        cells = ([task_label(task)] if many else []) + [
            model, acc["label"], f"{acc['value'] * 100:.2f} ± {acc['stderr'] * 100:.2f}", accn, delta, p, flip, ds]
        if lm:
            cells.append(f"{m['lm_loss']['value']:.4f}" if "lm_loss" in m else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def kept_as(keep_bits: int) -> str:
    """How a sensitivity run's kept layers run: ``unquantized`` (16 bits) or ``at 8 bits``."""
    return "unquantized" if keep_bits == UNQUANTIZED_BITS else f"at {keep_bits} bits"


def sensitivity_markdown(record: dict, table: pd.DataFrame, tries: list[dict]) -> str:
    """Markdown of a sensitivity run (:mod:`outlierscope.runs.sensitivity`): the settings, the layers by harm with
    their attention error and outlier ratio, every greedy try, and the rank correlation."""
    s, metric = record["settings"], record["metric"]
    quant = f"{s['bits']}-bit {s['format']} {s['granularity']}"
    final = record["final"]
    reach = ("within" if final["within_tolerance"] else "NOT within") + f" {s['tolerance']} nats"
    lines = [f"# Per-layer sensitivity: {s['model']}, {s['task']}, {quant}", "",
             f"{record['n_items']} items ({'sample' if s['sample'] else 'first'} {s['sample'] or s['limit'] or 'all'}, "
             f"seed {s['seed']}); damage = mean change of the gold choice's log-likelihood (nats, < 0 hurts) against "
             f"the unquantized model; Δ{metric} in points; flip = share of items whose prediction changes.", "",
             f"Greedy suggestion: keep layers {record['keep'] or 'none'} {kept_as(record['keep_bits'])}, quantize "
             f"{len(record['quantized'])} of {record['n_layers']}: {final['delta_gold_ll']:+.4f} nats ({reach}), "
             f"Δ{metric} {final[f'delta_{metric}'] * 100:+.2f}, flip {final['flip_rate'] * 100:.1f}%.", "",
             f"Spearman rank correlation of harm with the layer's top-1/median |logit|: "
             f"{record['spearman_damage_vs_outlier_ratio']:+.2f} (> 0: larger outliers, more harm)"
             + (f"; with the layer's mean attention KL: {record['spearman_damage_vs_kl_mean']:+.2f}"
                if record.get("spearman_damage_vs_kl_mean") is not None else "") + ".", ""]
    cols = [("rank", "Rank", "{:d}"), ("layer", "Layer", "{:d}"), ("only_delta_gold_ll", "only: damage", "{:+.4f}"),
            (f"only_delta_{metric}", f"only: Δ{metric}", "pct"), ("only_flip_rate", "only: flip", "pct%"),
            ("all_but_delta_gold_ll", "all but: damage", "{:+.4f}"), ("kl_mean", "KL mean", "{:.4f}"),
            ("kl_max", "KL max", "{:.3f}"), ("argmax_change_rate", "top key lost", "pct%"),
            ("rel_out_mean", "rel. out error", "{:.4f}"), ("outlier_ratio", "top-1/median", "{:.1f}")]
    cols = [c for c in cols if c[0] in table]

    def fmt(v, f):
        return f"{v * 100:+.2f}" if f == "pct" else f"{v * 100:.2f}%" if f == "pct%" else f.format(v)

    lines += ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for _, r in table.sort_values("rank").iterrows():
        lines.append("| " + " | ".join(fmt(int(r[k]) if f == "{:d}" else r[k], f) for k, _, f in cols) + " |")
    lines += ["", "Greedy tries (bisection over k, the number of most harmful layers kept):", "",
              f"| kept | kept layers | damage | Δ{metric} | flip | within |", "|---|---|---|---|---|---|"]
    for t in tries:
        lines.append(f"| {t['kept']} | {t['kept_layers']} | "
                     f"{t['delta_gold_ll']:+.4f} | {t[f'delta_{metric}'] * 100:+.2f} | {t['flip_rate'] * 100:.1f}% | "
                     f"{'yes' if t['within_tolerance'] else 'no'} |")
    return "\n".join(lines) + "\n"
