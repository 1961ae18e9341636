"""``outlierscope plot`` and ``report``: figures and a markdown report from a run directory
(read and validated by ``load_run``). Figures go to ``RUN_DIR/figures``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from outlierscope.data.tasks import task_label
from outlierscope.io import atomic_path, write_text
from outlierscope.report.load import RunResults, load_run
from outlierscope.report.outcome import outcome_paragraph, quantized_heading
from outlierscope.report.tables import (
    attention_error_markdown,
    by_task,
    gold_ll_markdown,
    key_channels_markdown,
    linear_error_markdown,
    massive_origin,
    origin_markdown,
    recipe_rows,
    recurrence_markdown,
    sinks_markdown,
    sweep_table,
    table5_markdown,
)

FIGURES = [
    # (file stem, required table, figure function, title); resolved lazily so that plotting stays an optional import
    ("figure8_acc_norm", "sweep", lambda p, df, r: p.figure8(df, "acc_norm"), "acc_norm vs logit bits (Figure 8)"),
    ("figure8_acc", "sweep", lambda p, df, r: p.figure8(df, "acc"), "acc vs logit bits"),
    ("quantization_damage", "sweep", lambda p, df, r: p.quantization_damage(df), "Quantization damage vs 16 bits"),
    ("table5_bars", "table5", lambda p, df, r: p.table5_bars(df), "Largest activation values (Table 5)"),
    ("per_layer", "per_layer", lambda p, df, r: p.per_layer_lines(df), "Per-layer top-1, top-3 and median |x|"),
    ("head_heatmap", "per_head", lambda p, df, r: p.head_heatmap(df), "Max |logit| per layer and head"),
    ("histograms", "histograms", lambda p, df, r: p.histograms(df), "Distribution of |x|"),
    ("lambda", "lambda", lambda p, df, r: p.lambda_per_layer(df), "λ per layer (Diff models)"),
]


# figures of every observation point: drawn when the run has their table, never listed as skipped
POINT_FIGURES = [
    *((f"channels_{pt}", "channels", lambda p, df, r, pt=pt: p.channel_heatmap(df, pt), f"Per-channel max |x| of {pt}")
      for pt in ("attn.k", "attn.q", "attn.v", "mlp.down_proj.input", "hidden")),
    ("sinks", "sinks", lambda p, df, r: p.sink_heatmap(df), "Attention sinks: mass on key 0 per layer and head"),
    ("massive_locations", "massive_recurrence", lambda p, df, r: p.massive_locations(df), "Where massive activations sit"),
    ("recipes", "sweep", lambda p, df, r: p.recipe_damage(df), "Low-bit attention recipes: accuracy change"),
    ("recipe_lines", "sweep", lambda p, df, r: p.recipe_lines(df), "Accuracy vs bits: a line per attention recipe"),
    ("attn_error_layers", "attn_error", lambda p, df, r: p.attention_error_layers(df),
     "Attention error per layer (mean KL)"),
    ("linear_error", "linear_error", lambda p, df, r: p.linear_error_heatmap(df),
     "Linear layers: relative output error per layer and linear"),
    ("gold_ll", "gold_ll", lambda p, df, r: p.gold_ll_changes(df), "Gold log-likelihood change per quantized setting"),
]


def sweep_tasks(run: RunResults) -> list[str]:
    """The display names of a run's sweep tasks, in order.

    Args:
        run: the run."""
    return [task_label(t) for t, _ in by_task(run.tables["sweep"])]


class ClippedTextWarning(UserWarning):
    """A figure's title, label or legend reaches past its canvas (cut off in the saved file)."""


def save_figure(fig, out: Path, stem: str, svg: bool = False) -> Path:
    """Write a figure as ``out/stem.png`` (and .svg), each atomically; the figure is closed in any case.

    Text cut off at the figure's edge is a ``ClippedTextWarning`` (the tests make it an error for every committed
    report).

    Args:
        fig: the figure.
        out: the directory.
        stem: the files' stem.
        svg: also write an SVG."""
    import warnings

    import matplotlib.pyplot as plt

    from outlierscope.report.plots import clipped_texts

    try:
        if cut := clipped_texts(fig):
            warnings.warn(f"{out / stem}.png: text cut off at the figure's edge: {'; '.join(cut)}", ClippedTextWarning,
                          stacklevel=2)
        for ext in ("png", "svg") if svg else ("png",):
            with atomic_path(out / f"{stem}.{ext}") as tmp:
                fig.savefig(tmp, dpi=150, format=ext)
    finally:
        plt.close(fig)
    return out / f"{stem}.png"


def render_figures(run: RunResults, svg: bool = False) -> tuple[list[tuple[str, Path]], list[str]]:
    """Write every figure the run supports.

    Args:
        run: the run.
        svg: also write SVGs.

    Returns:
        ``([(title, png path)], skipped messages)``."""
    from outlierscope.report import activation_plots, plots

    out = run.root / "figures"
    out.mkdir(exist_ok=True)
    written, skipped = [], []
    for stem, table, fn, title in FIGURES:
        df = run.tables.get(table)
        if df is None:
            skipped.append(f"{stem}: no {table} data in this run")
            continue
        fig = fn(plots, df, run)
        if fig is None:
            skipped.append(f"{stem}: nothing to draw (no task of the sweep reports this metric)")
            continue
        save_figure(fig, out, stem, svg)
        written.append((title, out / f"{stem}.png"))
    for stem, table, fn, title in POINT_FIGURES:
        df = run.tables.get(table)
        fig = None if df is None or df.empty else fn(activation_plots, df, run)
        if fig is not None:
            save_figure(fig, out, stem, svg)
            written.append((title, out / f"{stem}.png"))
    return written, skipped


def _timing_table(meta: dict | None) -> list[str]:
    """Seconds per model and task, summed over its bit widths, from the cells of the sweep record."""
    cells = (meta or {}).get("cells") or []
    if not cells or any(c.get("seconds") is None for c in cells):
        return []
    total, rows = {}, {}
    for c in cells:
        key = (c["model"], c.get("task", "hellaswag"))
        total[key] = total.get(key, 0.0) + c["seconds"]
        name = c["label"] if c.get("quant") else c["bits"]  # a recipe cell by its name, a logits cell by its bits
        rows.setdefault(key, []).append(f"{name}: {c['seconds']:.0f}")
    m = meta.get("machine") or {}
    where = f" on {m.get('cpu', '?')}, {m.get('cores', '?')} cores" + (f", {m['gpu']}" if m.get("gpu") else "")
    out = [f"Time per model and task (seconds as each cell recorded when it ran{where}; a cell reused from an "
           "earlier run keeps its own time):", "", "| Model | Task | seconds (all bit widths) | per bit width |",
           "|---|---|---|---|"]
    for (model, task), t in total.items():
        out.append(f"| {model} | {task_label(task)} | {t:,.0f} | {', '.join(rows[(model, task)])} |")
    return out + [f"| all | | {sum(total.values()):,.0f} | |", ""]


def _points_section(run: RunResults) -> list[str]:
    """Attention sinks, massive activations and LLM.int8 features, for runs that observed those points."""
    out = []
    if "sinks" in run.tables:
        out += ["## Attention sinks", "", "Mean attention mass on key position 0 over valid query rows, per layer "
                "(mean over heads; the largest head in parentheses).", "", sinks_markdown(run.tables["sinks"]), ""]
    ch = run.tables.get("channels")
    if ch is not None and (ch["point"] == "attn.k").any():
        out += ["## Key channels with outliers", "", "Per-channel max |k| (after RoPE, per KV head) against the median "
                "channel's max in the same layer: the channels KIVI quantizes per channel for.", "",
                key_channels_markdown(ch), ""]
    rec = run.tables.get("massive_recurrence")
    origins = massive_origin(rec) if rec is not None and not rec.empty else pd.DataFrame()
    if not origins.empty:
        out += ["## Where the first token's massive activation comes from", "", "The hidden channel whose massive "
                "activation on the first token recurs in the most sequences, and the first output in the residual "
                "stream (attention output, MLP output, layer output; in forward order) that carries it.", "",
                origin_markdown(origins), ""]
    if rec is not None and not rec.empty:
        s = run.profile_meta["settings"]
        out += ["## Massive activations", "", f"|x| > {s.get('massive_abs', 100)} and > {s.get('massive_rel', 1000)} x "
                "the layer's median |x| (Sun et al. 2024), where they recur most (all rows: massive.csv, "
                "massive_recurrence.csv).", "", recurrence_markdown(rec), ""]
        capped = sorted({k for f in run.profile_meta["models"].values() for k in f.get("massive_capped") or []})
        if capped:
            out += [f"More values passed the absolute threshold than were kept for {', '.join(capped)}: those rows "
                    "are the largest ones only.", ""]
    feats = run.tables.get("int8_features")
    if feats is not None and "linear" in feats:
        feats = feats[feats["linear"].astype(bool) | (feats["point"] == "hidden")]  # LLM.int8's: the linear inputs
    if feats is not None and not feats.empty:
        def channels(g):
            ch = [str(c) for c in g["channel"]]
            return f"{len(ch)} channels ({', '.join(ch[:16])}{', ...' if len(ch) > 16 else ''})"
        listed = "; ".join(f"{m} {p}: {channels(g)}" for (m, p), g in feats.groupby(["model", "point"], sort=False))
        out += ["LLM.int8 outlier features (|x| >= 6 on >= 6% of tokens in >= 25% of layers; hidden states and "
                "nn.Linear inputs, all kinds in int8_features.csv): " + listed, ""]
    return out


def write_report(run_dir: str | Path, svg: bool = False) -> Path:
    """Render the figures and write ``report.md`` into a run directory.

    Args:
        run_dir: the directory.
        svg: also write SVGs.

    Returns:
        The report's path."""
    run = load_run(run_dir)
    written, skipped = render_figures(run, svg)
    parts = ["# outlierscope report", ""]
    parts += ["## Outcome", "", outcome_paragraph(run), ""]
    if run.profile_meta:
        s = run.profile_meta["settings"]
        parts += ["## Activation outliers (Table 5)", "",
                  f"Text: `{s['text']}`, {s['tokens']:,} tokens requested per model, seed {s['seed']}, batch {s['batch_size']}.", ""]
        if "table5" in run.tables:
            parts += [table5_markdown(run.tables["table5"], run.profile_meta["models"]), ""]
        parts += ["| model | spec | weights sha256 | tokens | seq len | tokens/s |", "|---|---|---|---|---|---|"]
        for name, f in run.profile_meta["models"].items():
            parts.append(f"| {name} | `{f['spec']}` | `{f['weights_sha256'][:16]}` | {f['tokens']:,} | {f['seq_len']} | {f['tokens_per_s']:,.0f} |")
        parts.append("")
        parts += _points_section(run)
    if "sweep" in run.tables:
        s = run.sweep_meta["settings"] if run.sweep_meta else {}
        sw = run.tables["sweep"]
        n_items = ", ".join(f"{task_label(t)} {int(g['n_items'].iloc[0]):,}" for t, g in by_task(sw))
        parts += [f"## {quantized_heading(sw)} on {', '.join(sweep_tasks(run))} (Figure 8)", "",
                  f"Dynamic absmax post-training quantization of the pre-softmax attention logits, format `{s.get('format')}`, "
                  f"granularity `{s.get('granularity')}`, weights `{s.get('weights')}`, validation items: {n_items}; "
                  "zero-shot, lm-eval 0.4.13 scoring. "
                  "16 bits = unquantized. Intervals: 95% paired bootstrap "
                  f"({run.sweep_meta['bootstrap_reps'] if run.sweep_meta else '?'} resamples); p: exact McNemar test."
                  + (" Rows named by a recipe or spec (`--quant`) quantize what it says instead (attention's q, k, "
                     "v, P, KV cache; the linear layers' weights and inputs; `outlierscope recipes`), their bits "
                     "column the fewest bits any of its tensors use."
                     if recipe_rows(sw).any() else ""), "",
                  sweep_table(run.tables["sweep"]), ""]
        parts += _timing_table(run.sweep_meta)
    if "attn_error" in run.tables:
        parts += ["## What quantization does to attention", "", "Measured per query row in every quantized cell "
                  "(`--attn-error`) against the unquantized attention of the same forward: the KL divergence "
                  "KL(p || p~) of the probabilities from the quantized logits (logits, q and k quantization, "
                  "smoothing), whether the row's most attended key changes, and the output error "
                  "||p V - P~ V~|| / ||p V|| (everything, P and V included); pooled over heads and layers weighted by "
                  "rows (per head: attn_error.csv).", "",
                  attention_error_markdown(run.tables["attn_error"]), ""]
    if "gold_ll" in run.tables:
        parts += ["## Gold log-likelihood", "", "Per quantized setting, the mean change of each item's gold-choice "
                  "log-likelihood against the same model unquantized (nats; < 0 hurts; it moves where accuracy sits at "
                  "chance), with its 95% paired bootstrap interval; for a second model, its change minus the first "
                  "model's on the same items (< 0: the second is hurt more). From gold_ll.csv.", "",
                  gold_ll_markdown(run.tables["gold_ll"]), ""]
    if "linear_error" in run.tables:
        parts += ["## What quantization does to the linear layers", "", "Measured in every cell with linear parts "
                  "(`--attn-error`): each quantized linear's relative output error ||x W^T - x~ W~^T|| / ||x W^T|| per "
                  "real token, x the input it was given in that forward; the mean weighted by tokens, the worst "
                  "(layer, linear) and the largest single token, then the mean per linear kind (per layer: "
                  "linear_error.csv).", "", linear_error_markdown(run.tables["linear_error"]), ""]
    if written:
        parts += ["## Figures", ""]
        for title, path in written:
            parts += [f"### {title}", "", f"![{title}]({path.relative_to(run.root).as_posix()})", ""]
    if skipped:
        parts += ["Skipped figures: " + "; ".join(skipped), ""]
    versions = (run.profile_meta or run.sweep_meta or {}).get("versions", {})
    parts += ["## Settings", "", "```json", json.dumps({"profile": run.profile_meta and run.profile_meta["settings"],
                                                        "sweep": run.sweep_meta and run.sweep_meta["settings"],
                                                        "versions": versions}, indent=2), "```", ""]
    path = run.root / "report.md"
    write_text(path, "\n".join(parts))
    return path
