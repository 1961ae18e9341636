"""Markdown tables of Table 5 and the sweep, from the tidy DataFrames (they never run a model)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from outlierscope.analysis.outliers import TABLE5_RANKS


def recipe_rows(sweep: pd.DataFrame) -> pd.Series:
    """Which rows of a sweep table are recipe rows (``sweep --quant``: format ``attn``, beyond the paper's logits).

    Args:
        sweep: a sweep's table (one without a format column has none)."""
    from outlierscope.quant.specs.parts import KERNEL_FORMAT

    return sweep["format"].eq(KERNEL_FORMAT) if "format" in sweep else pd.Series(False, index=sweep.index)


def table5_markdown(df: pd.DataFrame, facts: dict) -> str:
    """Table 5 as markdown: the k-th largest |x| and the median per model and kind, after a paragraph on what they are.

    Args:
        df: a profile's ``table5`` table.
        facts: model -> what ran (its ``tokens``)."""
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
    """A sweep table with its ``task`` column (a table built by hand, or without tasks, is HellaSwag's).

    Args:
        sweep: a sweep's table."""
    return sweep if "task" in sweep else sweep.assign(task="hellaswag")


def by_task(sweep: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """``(task, its rows)`` in table order.

    Args:
        sweep: a sweep's table."""
    return list(with_task(sweep).groupby("task", sort=False))


def headline_metric(metrics) -> str:
    """The metric a task is read by: acc_norm where the task reports it (HellaSwag, ARC, ...), else acc.

    Args:
        metrics: the metrics the task reports."""
    return "acc_norm" if "acc_norm" in set(metrics) else "acc"


def sweep_table(table: pd.DataFrame) -> str:
    """A sweep as markdown: one row per (task,) model and bit width, with the change of the headline metric vs 16 bits.

    Each row: acc, acc_norm (stderr), the change of ``headline_metric`` with its 95% interval, McNemar p, the flip
    rate and the mean |change| of the scores (and the LM loss where measured).

    Args:
        table: a sweep's table."""
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


def sinks_markdown(sinks: pd.DataFrame) -> str:
    """The mean attention mass on key 0 per layer (mean over heads, and the largest head), a column per model and point.

    Args:
        sinks: a profile's ``sinks`` table."""
    cols = list(dict.fromkeys(zip(sinks["model"], sinks["point"])))
    g = sinks.groupby(["model", "point", "layer"])["mass_first"]
    mean, top = g.mean(), g.max()
    lines = ["| layer | " + " | ".join(f"{m} {p}: mean (max head)" for m, p in cols) + " |", "|---|" + "---|" * len(cols)]
    for layer in sorted(sinks["layer"].unique()):
        cells = [f"{mean[(m, p, layer)]:.3f} ({top[(m, p, layer)]:.3f})" if (m, p, layer) in mean.index else ""
                 for m, p in cols]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def recurrence_markdown(rec: pd.DataFrame, n: int = 12) -> str:
    """The (point, layer, channel, position kind) of massive activations found in the most sequences, as markdown.

    Args:
        rec: a profile's ``massive_recurrence`` table.
        n: rows shown."""
    top = rec.sort_values(["sequences", "point", "layer", "channel"], ascending=[False, True, True, True]).head(n)
    lines = ["| model | point | layer | channel | position | sequences (share) | occurrences |", "|---|---|---|---|---|---|---|"]
    for r in top.itertuples():
        lines.append(f"| {r.model} | {r.point} | {r.layer} | {r.channel} | {r.position_kind} | "
                     f"{r.sequences:,} ({r.share_of_sequences:.0%}) | {r.occurrences:,} |")
    return "\n".join(lines) + "\n"


RESIDUAL_WRITERS = ("self_attn.output", "attn.output", "o_proj.output", "c_proj.output", "out_proj.output",
                    "mlp.output", "down_proj.output", "hidden")  # tensors in the hidden-state channel space


def _writer_rank(point: str) -> int:
    """Forward order inside a layer: attention's output, then the MLP's, then the layer's output."""
    return 0 if "attn" in point or "o_proj" in point else 2 if point == "hidden" else 1


def massive_origin(rec: pd.DataFrame) -> pd.DataFrame:
    """Per model, the hidden channel whose massive activation on the first token recurs most, and where it starts.

    Args:
        rec: a profile's ``massive_recurrence`` table.

    Returns:
        One row per model: the channel, its share of sequences, the first (layer, point) of the residual stream that
        carries it, and the layers whose hidden states hold it."""
    rows = []
    for model, g in rec.groupby("model", sort=False):
        first = g[(g["position_kind"] == "first") & (g["point"] == "hidden")]
        if first.empty:
            continue
        top = first.sort_values(["sequences", "layer"], ascending=[False, True]).iloc[0]
        c = int(top["channel"])
        carriers = g[(g["channel"] == c) & (g["position_kind"] == "first") & g["point"].map(
            lambda p: p.endswith(RESIDUAL_WRITERS) and not p.endswith(".input"))]
        origin = carriers.assign(rank=carriers["point"].map(_writer_rank)).sort_values(["layer", "rank"]).iloc[0]
        layers = sorted(first[first["channel"] == c]["layer"])
        rows.append({"model": model, "channel": c, "share": float(top["share_of_sequences"]),
                     "origin": f"layers.{int(origin['layer'])}.{origin['point']}", "first_layer": layers[0],
                     "last_layer": layers[-1], "n_layers": len(layers)})
    return pd.DataFrame(rows)


def origin_markdown(origins: pd.DataFrame) -> str:
    """``massive_origin``'s table as markdown.

    Args:
        origins: ``massive_origin``'s table."""
    lines = ["| model | hidden channel | sequences with it | first carried by | in the hidden states of layers |",
             "|---|---|---|---|---|"]
    for r in origins.itertuples():
        lines.append(f"| {r.model} | {r.channel} | {r.share:.0%} | `{r.origin}` | {r.first_layer}-{r.last_layer} "
                     f"({r.n_layers} layers) |")
    return "\n".join(lines) + "\n"


def key_channels_markdown(channels: pd.DataFrame, n: int = 8) -> str:
    """The key channels (``attn.k``) whose max |x| stands out most from their layer's median channel max, as markdown.

    Args:
        channels: a profile's ``channels`` table.
        n: rows per model."""
    k = channels[channels["point"] == "attn.k"].copy()
    k["ratio"] = k["absmax"] / k.groupby(["model", "layer"])["absmax"].transform("median")
    top = k.sort_values("ratio", ascending=False).groupby("model", sort=False).head(n)
    lines = ["| model | layer | KV head | dim | max \\|k\\| | x the layer's median channel max | mean \\|k\\| |",
             "|---|---|---|---|---|---|---|"]
    for r in top.itertuples():
        lines.append(f"| {r.model} | {r.layer} | {r.head} | {r.dim} | {r.absmax:.2f} | {r.ratio:.1f} | {r.mean_abs:.2f} |")
    return "\n".join(lines) + "\n"


def attention_error_layers(attn_error: pd.DataFrame) -> pd.DataFrame:
    """A sweep's ``attn_error.csv`` pooled over heads, per layer (``pool_heads`` per cell).

    Args:
        attn_error: per model, task, cell, layer and head.

    Returns:
        Per model, task, cell and layer: the row-weighted mean KL, top-key change rate and output error, the maxima."""
    from outlierscope.analysis.attention_error import pool_heads

    keys = ["model", "task", "bits", "label"]
    parts = [pool_heads(g.drop(columns=keys)).assign(**dict(zip(keys, k)))
             for k, g in attn_error.groupby(keys, sort=False)]
    out = pd.concat(parts, ignore_index=True)
    return out[keys + [c for c in out.columns if c not in keys]]


def attention_error_markdown(attn_error: pd.DataFrame) -> str:
    """The attention error as markdown: per cell a summary, then per model and task the mean KL per layer and cell.

    Each cell's summary: the query rows measured, the mean KL over all rows, the layer with the largest mean KL, the
    share of rows whose top key changes and the mean relative output error.

    Args:
        attn_error: a sweep's ``attn_error.csv``."""
    from outlierscope.data.tasks import task_label

    layers = attention_error_layers(attn_error)
    out = _attention_error_summary(layers)
    for (model, task), g in layers.groupby(["model", "task"], sort=False):
        grid = g.pivot(index="layer", columns="label", values="kl_mean")[list(dict.fromkeys(g["label"]))]  # (layers, cells)
        out += ["", f"Mean KL per layer, {model} on {task_label(task)}:", "",
                "| layer | " + " | ".join(grid.columns) + " |", "|---|" + "---|" * len(grid.columns)]
        out += [f"| {layer} | " + " | ".join(f"{v:.3g}" for v in row) + " |" for layer, row in grid.iterrows()]
    return "\n".join(out)


def _attention_error_summary(layers: pd.DataFrame) -> list[str]:
    """The summary table of ``attention_error_markdown`` from the per-layer pooled rows."""
    from outlierscope.analysis.attention_error import pool_rows
    from outlierscope.data.tasks import task_label

    keys = ["model", "task", "label"]
    has_out = "rel_out_mean" in layers and layers["rel_out_mean"].notna().any()
    out = ["| Model | Task | Setting | rows | mean KL | worst layer (mean KL) | top key lost | "
           + ("mean rel. output error |" if has_out else ""), "|---|---|---|---|---|---|---|" + ("---|" if has_out else "")]
    worst = layers.loc[layers.groupby(keys, sort=False)["kl_mean"].idxmax(), keys + ["layer", "kl_mean"]]
    cells = pool_rows(layers, keys).merge(  # pooled over layers, in the cells' order, with each cell's worst layer
        worst.rename(columns={"layer": "worst_layer", "kl_mean": "worst_kl"}), on=keys, how="left", validate="1:1")
    for c in cells.itertuples():
        row = (f"| {c.model} | {task_label(c.task)} | {c.label} | {c.rows:,} | {c.kl_mean:.3g} | "
               f"{int(c.worst_layer)} ({c.worst_kl:.3g}) | {c.argmax_change_rate:.2%} |")
        if has_out:
            row += f" {c.rel_out_mean:.3g} |" if pd.notna(c.rel_out_mean) else " |"  # NaN: not measured
        out.append(row)
    return out


def gold_ll_markdown(gold: pd.DataFrame) -> str:
    """The mean change of the gold choice's log-likelihood per model, task and setting, with its 95% paired interval.

    For the models after the first, also that change minus the first model's, paired by item.

    Args:
        gold: a sweep's ``gold_ll.csv``."""
    from outlierscope.data.tasks import task_label

    first = gold["model"].iloc[0]
    two = gold["minus_first_model"].notna().any() if "minus_first_model" in gold else False
    out = ["| Model | Task | Setting | items | Δ gold log-lik. [95% CI] |" + (f" minus {first}'s [95% CI] |" if two else ""),
           "|---|---|---|---|---|" + ("---|" if two else "")]
    for _, r in gold.iterrows():
        vs = f" {r['minus_first_model']:+.3f} [{r['minus_first_ci_low']:+.3f}, {r['minus_first_ci_high']:+.3f}] |" \
            if two and np.isfinite(r["minus_first_model"]) else (" |" if two else "")
        out.append(f"| {r['model']} | {task_label(r['task'])} | {r['label']} | {int(r['n_items'])} | "
                   f"{r['delta_gold_ll']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] |{vs}")
    return "\n".join(out)


def linear_error_summary(linear_error: pd.DataFrame) -> pd.DataFrame:
    """A sweep's linear errors per model, task and scheme.

    Args:
        linear_error: a sweep's ``linear_error.csv``.

    Returns:
        The token-weighted mean relative output error over every quantized linear, the (layer, linear) with the largest
        mean and its value, the largest single token's error, and the mean per linear kind (a column each)."""
    keys = ["model", "task", "label"]
    rows = []
    for k, g in linear_error.groupby(keys, sort=False):
        w = g["tokens"].to_numpy(dtype=np.float64)
        worst = g.loc[g["rel_err_mean"].idxmax()]
        kinds = {lin: float(np.average(h["rel_err_mean"], weights=h["tokens"])) for lin, h in g.groupby("linear", sort=False)}
        rows.append({**dict(zip(keys, k)), "rel_err_mean": float(np.average(g["rel_err_mean"], weights=w)),
                     "worst": f"{int(worst['layer'])}.{worst['linear']}", "worst_mean": float(worst["rel_err_mean"]),
                     "max": float(g["rel_err_max"].max()), **kinds})
    return pd.DataFrame(rows)


def linear_error_markdown(linear_error: pd.DataFrame) -> str:
    """``linear_error_summary`` as markdown (kinds by their last name: q_proj, down_proj, ...).

    Args:
        linear_error: a sweep's ``linear_error.csv``."""
    from outlierscope.data.tasks import task_label

    t = linear_error_summary(linear_error)
    kinds = [c for c in t.columns if c not in ("model", "task", "label", "rel_err_mean", "worst", "worst_mean", "max")]
    out = ["| Model | Task | Scheme | mean rel. error | worst linear (mean) | largest token | "
           + " | ".join(k.split(".")[-1] for k in kinds) + " |", "|---|---|---|---|---|---|" + "---|" * len(kinds)]
    for _, r in t.iterrows():
        out.append(f"| {r['model']} | {task_label(r['task'])} | {r['label']} | {r['rel_err_mean']:.3g} | "
                   f"{r['worst']} ({r['worst_mean']:.3g}) | {r['max']:.3g} | "
                   + " | ".join(f"{r[k]:.3g}" for k in kinds) + " |")
    return "\n".join(out)


def linear_error_vs_outliers(linear_error: pd.DataFrame, per_layer: pd.DataFrame,
                             int8_features: pd.DataFrame | None = None) -> pd.DataFrame:
    """A sweep's linear errors beside a profile's statistics of the same inputs, per model, scheme, layer and linear.

    Rows whose input the profile did not observe (``profile --points 'layers.*.**'`` observes each ``{linear}.input``)
    are left out.

    Args:
        linear_error: a sweep's ``linear_error.csv``.
        per_layer: the profile's ``per_layer`` table: the input's largest |x| (``top1``), its median, their ratio.
        int8_features: the profile's ``int8_features``: the LLM.int8 feature channels (|x| >= 6) of each input."""
    stats = per_layer.assign(linear=per_layer["point"].str.removesuffix(".input"))[
        ["model", "layer", "linear", "top1", "median"]]
    out = linear_error.merge(stats[per_layer["point"].str.endswith(".input")], on=["model", "layer", "linear"])
    out["top1_over_median"] = out["top1"] / out["median"]
    if int8_features is not None:
        f = int8_features[int8_features["point"].str.endswith(".input")]
        rows = [(m, p.removesuffix(".input"), int(layer)) for m, p, layers in zip(f["model"], f["point"], f["layers"])
                for layer in json.loads(layers)]
        counts = pd.DataFrame(rows, columns=["model", "linear", "layer"]).value_counts().rename("int8_features")
        out = out.merge(counts.reset_index(), on=["model", "linear", "layer"], how="left")
        out["int8_features"] = out["int8_features"].fillna(0).astype(int)
    return out
