"""Figures of the tables of every observation point (``channels``, ``sinks``, ``massive_recurrence``): per-channel
max |x| per layer, attention-sink mass per layer and head, where massive activations sit; and of the attention
recipes of a sweep (``recipe_damage``). Seaborn, as
``outlierscope.report.plots``; each function takes DataFrames and returns a matplotlib ``Figure``."""

from __future__ import annotations

import matplotlib.colors
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from outlierscope.report.plots import _colors, _fit, _short
from outlierscope.report.tables import by_task, headline_metric, recipe_rows

CHANNEL_POINTS = ("attn.k", "attn.q", "attn.v", "mlp.down_proj.input", "hidden")  # drawn when a run has them
KIND_MARKERS = {"first": "o", "delimiter": "s", "other": "^"}


def channel_heatmap(channels: pd.DataFrame, point: str, stat: str = "absmax") -> plt.Figure | None:
    """Layer x channel heatmap of `stat` (log colour scale), one panel per model: which channels carry the outliers.

    Args:
        channels: a profile's `channels` table.
        point: the point kind drawn, e.g. `attn.k`.
        stat: the column drawn.

    Returns:
        The figure; None when the profile has no row of `point`."""
    d = channels[channels["point"] == point]
    if d.empty:
        return None
    models = list(dict.fromkeys(d["model"]))
    grids = [d[d["model"] == m].pivot(index="layer", columns="channel", values=stat) for m in models]
    vals = np.concatenate([g.to_numpy().ravel() for g in grids])
    vals = vals[np.isfinite(vals) & (vals > 0)]
    norm = matplotlib.colors.LogNorm(vmin=max(vals.min(), vals.max() * 1e-4), vmax=vals.max())
    fig, axes = plt.subplots(len(models), 1, figsize=(9.5, 1.2 + 0.16 * max(len(g) for g in grids) * len(models)),
                             layout="constrained", squeeze=False)
    for ax, model, g in zip(axes[:, 0], models, grids):
        im = ax.imshow(g.to_numpy(), aspect="auto", interpolation="nearest", cmap="magma", norm=norm)
        ax.set_title(_short(model), fontsize=9)
        ax.set_ylabel("layer")
        ax.set_xlabel("channel" + (" (head x head_dim + dim)" if point.startswith("attn.") else ""))
        ax.set_yticks(range(len(g.index)), [str(i) for i in g.index], fontsize=6)
    fig.colorbar(im, ax=axes[:, 0].tolist(), label=f"{stat} |x|")
    fig.suptitle(f"Per-channel max |x| of {point}", fontsize=11)
    return fig


def sink_heatmap(sinks: pd.DataFrame, stat: str = "mass_first") -> plt.Figure:
    """Layer x head heatmap of the mean attention mass on key position 0, one panel per model and point.

    Args:
        sinks: a profile's `sinks` table.
        stat: the column drawn."""
    panels = [(f"{_short(m)}: {p}", g.pivot(index="layer", columns="head", values=stat))
              for (m, p), g in sinks.groupby(["model", "point"], sort=False)]
    fig, axes = plt.subplots(1, len(panels), figsize=(2.4 + 2.6 * len(panels), 3.6), layout="constrained", squeeze=False)
    lo = min(0.0, min(float(np.nanmin(h.to_numpy())) for _, h in panels))  # a differential map can be negative
    hi = max(float(np.nanmax(h.to_numpy())) for _, h in panels)
    for ax, (title, h) in zip(axes[0], panels):
        sns.heatmap(h, ax=ax, cmap="viridis", vmin=lo, vmax=hi, cbar=ax is axes[0][-1],
                    cbar_kws={"label": "mean attention mass on key 0"})
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
    fig.suptitle("Attention sinks: mass on the first token", fontsize=11)
    return fig


def massive_locations(recurrence: pd.DataFrame) -> plt.Figure | None:
    """Where massive activations sit: (layer, channel) per point, sized by the share of sequences that have one.

    Args:
        recurrence: a profile's `massive_recurrence` table.

    Returns:
        The figure (markers by position kind: first token, delimiter, other); None without rows."""
    if recurrence.empty:
        return None
    points = list(dict.fromkeys(recurrence["point"]))
    fig, axes = plt.subplots(1, len(points), figsize=(4.6 * len(points), 3.8), layout="constrained", squeeze=False)
    colors = _colors(recurrence["model"])
    for ax, point in zip(axes[0], points):
        d = recurrence[recurrence["point"] == point]
        for (model, kind), g in d.groupby(["model", "position_kind"], sort=False):
            ax.scatter(g["layer"], g["channel"], s=10 + 140 * g["share_of_sequences"], marker=KIND_MARKERS.get(kind, "x"),
                       color=colors[model], alpha=0.7, label=f"{_short(model)}: {kind}")
        ax.set_title(point, fontsize=10)
        ax.set_xlabel("layer")
        ax.set_ylabel("channel")
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, fontsize=7)
    fig.suptitle(_fit("Massive activations (|x| > 100 and > 1000 x median): marker size = share of sequences",
                      4.6 * len(points), 11), fontsize=11)
    return fig


def recipe_damage(sweep: pd.DataFrame) -> plt.Figure | None:
    """Per attention recipe, the change of the headline metric against 16 bits with its 95% interval.

    Args:
        sweep: a sweep's table with `--quant` rows.

    Returns:
        One panel per task, models side by side; None without recipe rows."""
    d = sweep[recipe_rows(sweep)]
    if d.empty:
        return None
    panels = []
    for task, t in by_task(d):
        hm = headline_metric(t["metric"])
        panels.append((task, t[t["metric"] == hm], f"Δ {hm} vs 16 bits (points, 95% CI)"))
    return _interval_figure(panels, "delta_vs_16", _colors(sweep["model"]), "Low-bit attention recipes: accuracy change",
                            scale=100)


def _interval_figure(panels: list[tuple[str, pd.DataFrame, str]], value: str, colors: dict, title: str,
                     scale: float = 1.0) -> plt.Figure:
    """One panel per (task, rows, x label) of ``_interval_bars`` of ``rows[value]``, side by side."""
    from outlierscope.data.tasks import task_label

    n_labels = len({lb for _, rows, _ in panels for lb in rows["label"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 1.4 + 0.45 * n_labels), layout="constrained",
                             squeeze=False)
    for ax, (task, rows, xlabel) in zip(axes[0], panels):
        _interval_bars(ax, rows, value, colors, scale)
        ax.set_xlabel(xlabel)
        ax.set_title(task_label(task), fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()  # one legend, under the panels: never over a bar
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), frameon=False, fontsize=8)
    fig.suptitle(title, fontsize=11)
    return fig


def _interval_bars(ax, rows: pd.DataFrame, value: str, colors: dict, scale: float = 1.0) -> None:
    """Horizontal bars of ``rows[value]`` with their ``ci_low``..``ci_high`` interval, a row of bars per label and
    one bar per model in it (times ``scale``)."""
    labels = list(dict.fromkeys(rows["label"]))
    models = list(dict.fromkeys(rows["model"]))
    for k, (model, g) in enumerate(rows.groupby("model", sort=False)):
        y = [labels.index(lb) + (k - (len(models) - 1) / 2) * 0.8 / len(models) for lb in g["label"]]
        err = [scale * (g[value] - g["ci_low"]), scale * (g["ci_high"] - g[value])]
        ax.barh(y, scale * g[value], height=0.8 / len(models), xerr=err, color=colors[model], label=_short(model),
                capsize=3)
    ax.axvline(0, color="0.3", lw=1)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.grid(axis="x", alpha=0.3)


def gold_ll_changes(gold: pd.DataFrame) -> plt.Figure | None:
    """Per quantized cell, the mean change of the gold choice's log-likelihood with its 95% paired interval.

    Args:
        gold: a sweep's `gold_ll` table.

    Returns:
        One panel per task, models side by side (it moves where accuracy sits at chance); None without rows."""
    if gold.empty:
        return None
    ends = gold[["ci_low", "ci_high", "delta_gold_ll"]].abs().to_numpy()
    symlog = bool(np.nanmax(ends) > 100 * SYMLOG_NATS)  # 4-bit's nats would hide 8-bit's hundredths on a linear axis
    unit = f"nats, 95% CI; symlog axis, linear within ±{SYMLOG_NATS}" if symlog else "nats, 95% CI"
    label = _fit(f"Δ mean gold log-likelihood vs 16 bits ({unit})", 3.4, 10)  # the panel beside its long y labels
    panels = [(task, t, label) for task, t in gold.groupby("task", sort=False)]
    fig = _interval_figure(panels, "delta_gold_ll", _colors(gold["model"]), "Gold log-likelihood change per quantized setting")
    for ax in fig.axes if symlog else ():
        ax.set_xscale("symlog", linthresh=SYMLOG_NATS)
    return fig


SYMLOG_NATS = 0.01  # gold_ll's linear range around 0 on a symlog axis (nats)


def recipe_lines(sweep: pd.DataFrame) -> plt.Figure | None:
    """Figure 8 with a line per attention recipe: the headline metric against bits, per task and model.

    Args:
        sweep: a sweep's table with `--quant` rows.

    Returns:
        The paper's logits axis as the black line, each recipe a line from 16 bits to the fewest bits any of its
        tensors use; None without recipe rows."""
    from outlierscope.data.tasks import task_label

    recipes = recipe_rows(sweep)
    if not recipes.any():
        return None
    panels = [(task, model, g[g["metric"] == headline_metric(t["metric"])])
              for task, t in by_task(sweep) for model, g in t.groupby("model", sort=False)]
    labels = list(dict.fromkeys(sweep.loc[recipes, "label"]))
    colors = dict(zip(labels, sns.color_palette("tab20", max(len(labels), 3))))
    ncol = min(len(panels), 2)
    fig, axes = plt.subplots(-(-len(panels) // ncol), ncol, figsize=(6.4 * ncol, 4.4 * -(-len(panels) // ncol)),
                             layout="constrained", squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (task, model, g) in zip(axes.flat, panels):
        base = g[g["bits"] == 16]["value"].iloc[0] * 100
        pos = {b: i for i, b in enumerate(sorted(set(g["bits"]), reverse=True))}  # evenly spaced, as Figure 8
        recipe = recipe_rows(g)
        logits = g[~recipe].sort_values("bits", ascending=False)
        ax.plot([pos[b] for b in logits["bits"]], logits["value"] * 100, "o-", color="black", lw=2,
                label="logits (paper, per_tensor)")
        for _, r in g[recipe].iterrows():
            ax.plot([pos[16], pos[r["bits"]]], [base, r["value"] * 100], "s--", color=colors[r["label"]], lw=1.2,
                    ms=5, label=r["label"])
        ax.axhline(float(g["chance"].iloc[0]) if "chance" in g else 25.0, color="0.5", ls=":", lw=1)
        ax.set_xticks(list(pos.values()), [str(b) for b in pos])
        ax.set_xlabel("bits (a recipe: the fewest bits of its tensors)")
        ax.set_ylabel(f"{g['metric'].iloc[0]} (%)")
        ax.set_title(f"{_short(model)}, {task_label(task)} ({int(g['n_items'].iloc[0]):,} items)", fontsize=10)
        ax.grid(alpha=0.3)
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside right center", frameon=False, fontsize=8)
    fig.suptitle("Zero-shot accuracy vs bits: the paper's logits and each low-bit attention recipe", fontsize=11)
    return fig


def attention_error_layers(attn_error: pd.DataFrame, value: str = "kl_mean") -> plt.Figure | None:
    """Recipe x layer heatmap of the attention error pooled over heads (log colour scale), per model and task.

    Args:
        attn_error: a sweep's `attn_error` table.
        value: the column drawn, e.g. `kl_mean`.

    Returns:
        The figure; None without rows."""
    from outlierscope.data.tasks import task_label
    from outlierscope.report.tables import attention_error_layers as pooled

    layers = pooled(attn_error)
    groups = list(layers.groupby(["model", "task"], sort=False))
    vals = layers[value].to_numpy()
    vals = vals[np.isfinite(vals) & (vals > 0)]
    if not len(vals):
        return None
    norm = matplotlib.colors.LogNorm(vmin=max(vals.min(), vals.max() * 1e-6), vmax=vals.max())
    n_labels, n_layers = layers["label"].nunique(), layers["layer"].nunique()
    longest = max(len(str(lb)) for lb in layers["label"])  # the y labels (7 pt) take width beside the cells
    fig, axes = plt.subplots(len(groups), 1, figsize=(min(3.5 + 0.32 * n_layers + 0.06 * longest, 18),
                                                      max(2.2, (1 + 0.3 * n_labels) * len(groups))),
                             layout="constrained", squeeze=False)
    for ax, ((model, task), g) in zip(axes[:, 0], groups):
        grid = g.pivot(index="label", columns="layer", values=value).reindex(list(dict.fromkeys(g["label"])))  # (labels, layers)
        im = ax.imshow(grid.to_numpy(), aspect="auto", interpolation="nearest", cmap="rocket_r", norm=norm)
        ax.set_yticks(range(len(grid.index)), grid.index, fontsize=7)
        ax.set_xticks(range(len(grid.columns)), [str(c) for c in grid.columns], fontsize=6)
        ax.set_xlabel("layer")
        ax.set_title(f"{_short(model)}, {task_label(task)}", fontsize=9)
    fig.colorbar(im, ax=axes[:, 0].tolist(), label=f"{value}\n(pooled over heads)")  # two lines: fits a short panel
    fig.suptitle(f"Attention error per layer: {value}", fontsize=11)
    return fig


def linear_error_heatmap(linear_error: pd.DataFrame, value: str = "rel_err_mean") -> plt.Figure | None:
    """Linear x layer heatmap of each quantized linear's relative output error, per model, task and scheme.

    Args:
        linear_error: a sweep's `linear_error` table (`--attn-error` with a linear scheme).
        value: the column drawn: `rel_err_mean` is ||x W^T - x~ W~^T|| / ||x W^T|| over real tokens.

    Returns:
        The figure (log colour scale); None without rows."""
    from outlierscope.data.tasks import task_label

    vals = linear_error[value].to_numpy()
    vals = vals[np.isfinite(vals) & (vals > 0)]
    if not len(vals):
        return None
    norm = matplotlib.colors.LogNorm(vmin=max(vals.min(), vals.max() * 1e-4), vmax=vals.max())
    groups = list(linear_error.groupby(["model", "task", "label"], sort=False))
    n_layers, n_lin = linear_error["layer"].nunique(), linear_error["linear"].nunique()
    width = min(3.5 + 0.32 * n_layers, 16)
    fig, axes = plt.subplots(len(groups), 1, figsize=(width, (1.2 + 0.28 * n_lin) * len(groups)),
                             layout="constrained", squeeze=False)
    for ax, ((model, task, label), g) in zip(axes[:, 0], groups):
        grid = g.pivot(index="linear", columns="layer", values=value).reindex(list(dict.fromkeys(g["linear"])))  # (linears, layers)
        im = ax.imshow(grid.to_numpy(), aspect="auto", interpolation="nearest", cmap="rocket_r", norm=norm)
        ax.set_yticks(range(len(grid.index)), grid.index, fontsize=7)
        ax.set_xticks(range(len(grid.columns)), [str(c) for c in grid.columns], fontsize=6)
        ax.set_xlabel("layer")
        ax.set_title(_fit(f"{_short(model)}, {task_label(task)}: {label}", width - 1.2, 9), fontsize=9)  # colorbar
    fig.colorbar(im, ax=axes[:, 0].tolist(), label=f"{value} (relative output error)")
    fig.suptitle("Linear layers: relative output error per layer and linear", fontsize=11)
    return fig


def linear_error_vs_outliers(joined: pd.DataFrame, schemes: list[str] | None = None) -> plt.Figure | None:
    """Each quantized linear's relative output error against its input's top-1 / median |x|.

    Args:
        joined: `report.tables.linear_error_vs_outliers`'s table (a sweep's linear errors beside a profile's ratios).
        schemes: the schemes to draw, in order; all by default.

    Returns:
        A panel per model and scheme, a colour per linear kind; None without rows."""
    d = joined if schemes is None else joined[joined["label"].isin(schemes)]
    if d.empty:
        return None
    groups = list(d.groupby(["model", "label"], sort=False))
    cols = min(3, len(groups))
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), layout="constrained", squeeze=False)
    kinds = list(dict.fromkeys(d["linear"]))
    palette = dict(zip(kinds, sns.color_palette("tab10", len(kinds))))
    for ax, ((model, label), g) in zip(axes.flat, groups):
        for kind, h in g.groupby("linear", sort=False):
            ax.scatter(h["top1_over_median"], h["rel_err_mean"], s=14, color=palette[kind], label=kind.split(".")[-1])
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{_short(model)}: {label}", fontsize=9)
        ax.set_xlabel("input max |x| / median |x|", fontsize=8)
        ax.set_ylabel("mean relative output error", fontsize=8)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    axes.flat[0].legend(frameon=False, fontsize=7)
    fig.suptitle("Linear error against the input's outliers", fontsize=11)
    return fig
