"""Figures from the tidy tables written by ``profile`` and ``sweep`` (seaborn; they never run a model).

Every function takes DataFrames and returns a matplotlib ``Figure``. Colours come from seaborn's
colour-blind-safe palette; each model keeps its colour across figures.
"""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np
import pandas as pd
import seaborn as sns

from outlierscope.report.tables import FLIP_METRIC, by_task, headline_metric, recipe_rows

PALETTE = "colorblind"
STAT_COLUMNS = [("top1", "Top-1"), ("top2", "Top-2"), ("top3", "Top-3"), ("top10", "Top-10"), ("top100", "Top-100"),
                ("median", "Median")]
POINT_LABEL = {"attn.logits": "attention logits", "hidden": "hidden states"}


def _colors(models) -> dict:
    models = list(dict.fromkeys(models))
    return dict(zip(models, sns.color_palette(PALETTE, max(len(models), 3))))


def _short(name: str) -> str:
    return name.split("/")[-1]


def _fit(text: str, width_in: float, fontsize: float) -> str:
    """``text`` wrapped into lines that fit ``width_in`` inches at ``fontsize`` points (DejaVu Sans: about 0.6 em a
    character, with a margin), so a long title or label is not cut off at the figure's edge."""
    import textwrap

    return textwrap.fill(text, max(16, int(width_in * 105 / fontsize)), break_on_hyphens=False)


def clipped_texts(fig: plt.Figure) -> list[str]:
    """What of a figure reaches past its canvas once laid out: a label or title cut off at the edge.

    Ticks outside an axis' view are not drawn and not counted.

    Args:
        fig: the figure, drawn here.

    Returns:
        The title (or class) of each axes, figure text and legend whose extent leaves the figure by more than a pixel."""
    fig.canvas.draw()
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    out = []
    for art in [*fig.axes, *fig.texts, *fig.legends]:
        ext = art.get_tightbbox(renderer) if art.get_visible() else None
        if ext is not None and (ext.x0 < box.x0 - 1 or ext.x1 > box.x1 + 1 or ext.y0 < box.y0 - 1 or ext.y1 > box.y1 + 1):
            name = art.get_title() if hasattr(art, "get_title") else getattr(art, "get_text", lambda: "")()
            out.append(name or type(art).__name__)
    return out


def bits_label(b: int) -> str:
    """A bit width as the figures' axes write it: ``16`` is "16 (unquantized)".

    Args:
        b: the bit width."""
    return "16\n(unquantized)" if int(b) == 16 else str(int(b))


def _kind_panels(df: pd.DataFrame, column: str):
    """One panel per activation kind (the values of ``df[column]``) side by side, and a color per model:
    ``(kinds, fig, axes, colors)``."""
    kinds = list(dict.fromkeys(df[column]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.2 * len(kinds), 3.8), layout="constrained", squeeze=False)
    return kinds, fig, axes, _colors(df["model"])


def _task_grid(n: int, w: float = 4.4, h: float = 3.4):
    """A grid of ``n`` panels (at most 4 per row); the unused ones hidden."""
    ncol = min(n, 4)
    nrow = -(-n // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(w * ncol, h * nrow), layout="constrained", squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def logit_rows(sweep: pd.DataFrame) -> pd.DataFrame:
    """The rows of the logits' bit-width axis (an attention recipe's rows have their own figure).

    Args:
        sweep: a sweep's table."""
    return sweep[~recipe_rows(sweep)]


def figure8(sweep: pd.DataFrame, metric: str = "acc_norm") -> plt.Figure | None:
    """Zero-shot accuracy against the bit width of the attention logits: the paper's Figure 8.

    Args:
        sweep: a sweep's table (`run["sweep"]`, or `SweepResult.table`).
        metric: the accuracy to draw (`acc_norm` or `acc`).

    Returns:
        One panel per task that reports `metric`, each with its chance level; None when no task reports it."""
    from outlierscope.data.tasks import task_label

    sweep = logit_rows(sweep)
    panels = [(t, g) for t, g in by_task(sweep[sweep["metric"] == metric]) if not g.empty]
    if not panels:
        return None
    single = len(panels) == 1
    if single:
        fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
        axes = [ax]
    else:
        fig, axes = _task_grid(len(panels))
    colors = _colors(sweep["model"])
    markers = ["o", "s", "^", "D", "v"]
    gran = ", ".join(sorted(set(sweep.loc[sweep["bits"] != 16, "granularity"].dropna()))) or "unquantized"
    for ax, (task, df) in zip(axes, panels):
        bits = sorted(df["bits"].unique(), reverse=True)
        pos = {b: i for i, b in enumerate(bits)}
        for k, (model, g) in enumerate(df.groupby("model", sort=False)):
            g = g.sort_values("bits", ascending=False)
            ax.errorbar([pos[b] for b in g["bits"]], g["value"] * 100, yerr=g["stderr"] * 100, marker=markers[k % 5],
                        capsize=4, lw=1.8, color=colors[model], label=_short(model))
        chance = float(df["chance"].iloc[0]) if "chance" in df else 25.0 if task == "hellaswag" else None
        if chance is not None and np.isfinite(chance):
            ax.axhline(chance, color="0.4", ls="--", lw=1)
            ax.text(len(bits) - 1, chance, f"chance ({chance:.3g}%)", va="bottom", ha="right", fontsize=8, color="0.3")
        ax.set_xticks(range(len(bits)), [bits_label(b) for b in bits])
        n = int(df["n_items"].iloc[0]) if "n_items" in df else None
        if single:
            ax.set_xlabel("bits of the attention logits (dynamic absmax PTQ)")
            ax.set_ylabel(f"{task_label(task)} {metric} (%)")
            ax.set_title(f"Zero-shot {task_label(task)} vs logit bits ({gran}{f', {n:,} items' if n else ''})", fontsize=10)
            ax.legend(frameon=False)
        else:
            ax.set_xlabel("bits of the attention logits")
            ax.set_ylabel(f"{metric} (%)")
            ax.set_title(f"{task_label(task)}{f' ({n:,} items)' if n else ''}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    if not single:
        axes[0].legend(frameon=False, fontsize=8)
        fig.suptitle(f"Zero-shot {metric} vs bits of the attention logits (dynamic absmax PTQ, {gran})", fontsize=11)
    return fig


MAIN_POINTS = ("attn.logits", "hidden", "attn.k", "attn.probs", "mlp.down_proj.input")  # drawn when a run has many


def main_points(df: pd.DataFrame, column: str = "point") -> pd.DataFrame:
    """The rows of ``MAIN_POINTS`` when a run has more kinds than those (the tables keep all).

    Args:
        df: a table with a point column.
        column: the point column's name."""
    if df[column].nunique() <= len(MAIN_POINTS):
        return df
    return df[df[column].isin(MAIN_POINTS)]


def table5_bars(table5: pd.DataFrame) -> plt.Figure:
    """Table 5 as grouped bars on a log scale: the k-th largest |x| and the median, per model and activation type.

    Args:
        table5: a profile's Table 5 (`run["table5"]`, or `ProfileResult.table5`)."""
    table5 = main_points(table5)
    long = table5.melt(id_vars=["model", "activation"], value_vars=[c for c, _ in STAT_COLUMNS], var_name="stat",
                       value_name="value")
    long["stat"] = long["stat"].map(dict(STAT_COLUMNS))
    long["model"] = long["model"].map(_short)
    kinds, fig, axes, colors = _kind_panels(long, "activation")
    for ax, kind in zip(axes[0], kinds):
        sns.barplot(long[long["activation"] == kind], x="stat", y="value", hue="model", palette=colors, ax=ax)
        ax.set_yscale("log")
        ax.set_title(kind, fontsize=10)
        ax.set_xlabel("")
        ax.set_ylabel("|activation|")
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.get_legend().remove()
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), frameon=False, fontsize=9)
    fig.suptitle("Largest activation values (Table 5): k-th largest |x| and median", fontsize=11)
    return fig


def per_layer_lines(per_layer: pd.DataFrame) -> plt.Figure:
    """Top-1, top-3 and median |x| per layer for each model, as in Sun et al. 2024.

    Args:
        per_layer: a profile's `per_layer` table."""
    per_layer = main_points(per_layer)
    kinds, fig, axes, colors = _kind_panels(per_layer, "point")
    styles = {"top1": ("-", "o"), "top3": ("--", "s"), "median": (":", "^")}
    for ax, kind in zip(axes[0], kinds):
        d = per_layer[per_layer["point"] == kind]
        for model, g in d.groupby("model", sort=False):
            for stat, (ls, mk) in styles.items():
                ax.plot(g["layer"], g[stat], ls=ls, marker=mk, color=colors[model], ms=4,
                        label=f"{_short(model)} {stat.replace('top', 'top-')}")
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("|activation|")
        ax.set_title(POINT_LABEL.get(kind, kind), fontsize=10)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3, which="both")
    axes[0][-1].legend(frameon=False, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle("Per-layer magnitudes: top-1, top-3 and median |x|", fontsize=11)
    return fig


def head_heatmap(per_head: pd.DataFrame, stat: str = "max") -> plt.Figure:
    """Layer x head heatmap of the largest |logit|; a Diff model shows map 1 and map 2 side by side.

    Args:
        per_head: a profile's `per_head` table.
        stat: the column drawn."""
    panels = []
    for model, g in per_head.groupby("model", sort=False):
        if g["map"].fillna("").astype(str).str.startswith("map").any():
            for mp in ("map1", "map2"):
                h = g[g["map"] == mp].astype({"diff_head": int}).pivot(index="layer", columns="diff_head", values=stat)
                panels.append((f"{_short(model)}: {mp.replace('map', 'map ')}", h, "differential head"))
        else:
            panels.append((_short(model), g.pivot(index="layer", columns="head", values=stat), "head"))
    vmax = max(float(np.nanmax(p[1].to_numpy())) for p in panels)
    vmin = min(float(np.nanmin(p[1].to_numpy())) for p in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(2.2 + 1.9 * len(panels), 3.4), layout="constrained", squeeze=False)
    for ax, (title, h, xl) in zip(axes[0], panels):
        sns.heatmap(h, ax=ax, cmap="viridis", vmin=vmin, vmax=vmax, annot=h.size <= 64, fmt=".1f",
                    cbar=ax is axes[0][-1], cbar_kws={"label": f"{stat} |logit|"}, annot_kws={"fontsize": 7})
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xl)
        ax.set_ylabel("layer")
    fig.suptitle("Max |attention logit| per layer and head", fontsize=11)
    return fig


def histograms(hist: pd.DataFrame) -> plt.Figure:
    """Log-log density of |x| (all layers and heads pooled) for logits and hidden states, models overlaid.

    Args:
        hist: a profile's `histograms` table."""
    hist = main_points(hist)
    kinds, fig, axes, colors = _kind_panels(hist, "point")
    for ax, kind in zip(axes[0], kinds):
        d = hist[(hist["point"] == kind) & (hist["lo"] > 0) & np.isfinite(hist["hi"])]
        for model, g in d.groupby("model", sort=False):
            agg = g.groupby(["lo", "hi"], as_index=False)["count"].sum()
            # coarsen the 1% bins by 10x for a readable curve
            edges = np.geomspace(agg["lo"].min(), agg["hi"].max(), 80)
            idx = np.clip(np.searchsorted(edges, agg["lo"], side="right") - 1, 0, len(edges) - 2)
            counts = np.bincount(idx, weights=agg["count"], minlength=len(edges) - 1)
            widths = np.diff(edges)
            dens = counts / counts.sum() / widths
            centers = np.sqrt(edges[:-1] * edges[1:])
            keep = dens > 0
            ax.plot(centers[keep], dens[keep], color=colors[model], lw=1.6, label=_short(model))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"|{POINT_LABEL.get(kind, kind)}|")
        ax.set_ylabel("density")
        ax.set_title(POINT_LABEL.get(kind, kind), fontsize=10)
        ax.grid(alpha=0.3, which="major")
        ax.legend(frameon=False, fontsize=8)
    fig.suptitle("Distribution of |x| (all layers pooled, valid positions)", fontsize=11)
    return fig


def lambda_per_layer(lam: pd.DataFrame) -> plt.Figure:
    """Learned lambda and lambda_init per layer of the Diff models.

    Args:
        lam: a profile's `lambda` table."""
    fig, ax = plt.subplots(figsize=(5.6, 3.6), layout="constrained")
    colors = _colors(lam["model"])
    for model, g in lam.groupby("model", sort=False):
        ax.plot(g["layer"], g["lambda"], marker="o", color=colors[model], label=f"{_short(model)}: learned λ")
        ax.plot(g["layer"], g["lambda_init"], ls="--", marker="x", color=colors[model], alpha=0.7,
                label=f"{_short(model)}: λ_init")
    ax.set_xlabel("layer")
    ax.set_ylabel("λ")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title("Differential attention: λ per layer", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    return fig


def quantization_damage(sweep: pd.DataFrame) -> plt.Figure:
    """Flip rate and mean |score change| against 16 bits (and the LM loss when present), per model and task.

    Args:
        sweep: a sweep's table (`run["sweep"]`)."""
    from outlierscope.data.tasks import task_label

    tasks = by_task(logit_rows(sweep))
    lm = "lm_loss" in set(sweep["metric"])
    ncol = 3 if lm else 2
    fig, axes = plt.subplots(len(tasks), ncol, figsize=(4.6 * ncol, 3.6 * len(tasks)), layout="constrained", squeeze=False)
    colors = _colors(sweep["model"])
    for row, (task, tdf) in zip(axes, tasks):
        hm = headline_metric(tdf["metric"])
        metrics = [(FLIP_METRIC[hm], f"flip rate of {hm} choices (%)", 100.0),
                   ("mean_abs_score_change", "mean |Δ log-likelihood| per choice (nats)", 1.0)]
        if lm:
            metrics.append(("lm_loss", "LM loss on held-out text (nats/token)", 1.0))
        bits = sorted(tdf["bits"].unique(), reverse=True)
        pos = {b: i for i, b in enumerate(bits)}
        for ax, (m, label, scale) in zip(row, metrics):
            d = tdf[tdf["metric"] == m]
            for model, g in d.groupby("model", sort=False):
                g = g.sort_values("bits", ascending=False)
                ax.plot([pos[b] for b in g["bits"]], g["value"] * scale, marker="o", color=colors[model], label=_short(model))
            ax.set_xticks(range(len(bits)), [bits_label(b) for b in bits])
            ax.set_xlabel("bits of the attention logits")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if ax.lines:  # a sweep of --quant cells alone has no quantized logits to draw here
                ax.legend(frameon=False, fontsize=8)
            if len(tasks) > 1:
                ax.set_title(task_label(task), fontsize=10)
            if m != "lm_loss" and (d["value"] > 0).any():  # log scale needs something positive to show
                ax.set_yscale("log", nonpositive="mask")
                ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.suptitle("Quantization damage relative to 16 bits (unquantized)", fontsize=11)
    return fig


def sensitivity_bars(table: pd.DataFrame, quantized: str = "quantized attention logits", what: str = "|logit|",
                     column: str = "delta_gold_ll", label: str = "Δ mean gold log-likelihood (nats)") -> plt.Figure:
    """Per layer, the damage of quantizing only that layer, beside the layer's outlier statistic.

    Args:
        table: a sensitivity study's `sensitivity.csv`.
        quantized: what each layer gets, in words (the title).
        what: the quantity whose top-1 / median is the outlier statistic.
        column: the damage column.
        label: the damage in words (the axis)."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    c = sns.color_palette(PALETTE, 3)
    a.bar(table["layer"], table[f"only_{column}"], color=c[0], label="only this layer quantized")
    if f"all_but_{column}" in table:
        a.plot(table["layer"], table[f"all_but_{column}"], "o", color=c[1], label="all layers but this one")
    a.axhline(0, color="0.4", lw=0.8)
    a.set_xlabel("layer")
    a.set_ylabel(label)
    a.legend(frameon=False, fontsize=8)
    b.bar(table["layer"], table["outlier_ratio"], color=c[2])
    b.set_xlabel("layer")
    b.set_ylabel(f"top-1 / median {what}")
    for ax in (a, b):
        ax.grid(axis="y", alpha=0.3)
        ax.set_xticks(table["layer"].tolist()[::-(-len(table) // 16)])  # at most 16 labels
    fig.suptitle(_fit(f"Per-layer sensitivity to {quantized}", 10, 11), fontsize=11)  # a long spec: more lines
    return fig


def damage_vs_outliers(table: pd.DataFrame, rho: float, what: str = "|logit|", harm_sign: int = -1,
                       column: str = "delta_gold_ll", label: str = "Δ mean gold log-likelihood (nats)") -> plt.Figure:
    """Scatter across layers: the harm of quantizing a layer alone against its top-1 / median `what`.

    Args:
        table: a sensitivity study's `sensitivity.csv`.
        rho: the Spearman correlation to print in the title.
        what: the quantity whose top-1 / median is the outlier statistic.
        harm_sign: -1 where a negative `column` is harm (a log-likelihood change), 1 where a positive one is (a KLD).
        column: the layer-alone damage column.
        label: the damage in words (the axis)."""
    fig, ax = plt.subplots(figsize=(5.2, 4), layout="constrained")
    harm = harm_sign * table[f"only_{column}"]
    ax.scatter(table["outlier_ratio"], harm, color=sns.color_palette(PALETTE, 1)[0])
    for (_, r), h in zip(table.iterrows(), harm):
        ax.annotate(str(int(r["layer"])), (r["outlier_ratio"], h), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(f"top-1 / median {what} of the layer")
    ax.set_ylabel(f"harm: {'-' if harm_sign < 0 else ''}{label}")
    ax.set_title(f"Do outliers predict the damage? Spearman ρ = {rho:+.2f}", fontsize=10)
    ax.grid(alpha=0.3)
    return fig


def attention_error_heads(heads: pd.DataFrame, value: str = "kl_mean") -> plt.Figure:
    """Heatmap over layers (rows) and heads (columns) of one column of `attn_error.csv`.

    Args:
        heads: one cell's rows of an `attn_error.csv` (one row per layer and head).
        value: the column drawn, e.g. `kl_mean`."""
    grid = heads.pivot(index="layer", columns="head", values=value)  # (layers, heads)
    fig, ax = plt.subplots(figsize=(min(2 + 0.35 * grid.shape[1], 14), min(1.5 + 0.3 * grid.shape[0], 12)),
                           layout="constrained")
    sns.heatmap(grid, ax=ax, cmap="rocket_r", cbar_kws={"label": value}, annot=grid.size <= 64, fmt=".2g")
    ax.set_title(f"Attention error per layer and head: {value}", fontsize=10)
    return fig
