"""``outlierscope plot`` and ``report``: figures and a markdown report from a run directory
(read and validated by :func:`~outlierscope.report.load.load_run`). Figures go to ``RUN_DIR/figures``.
"""

from __future__ import annotations

import json
from pathlib import Path

from outlierscope.data.tasks import task_label
from outlierscope.io import atomic_path, write_text
from outlierscope.report.load import RunResults, load_run
from outlierscope.report.tables import FLIP_METRIC, by_task, headline_metric, sweep_table, table5_markdown, with_task

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


def sweep_tasks(run: RunResults) -> list[str]:
    """The display names of a run's sweep tasks, in order (HellaSwag for sweeps that predate tasks)."""
    return [task_label(t) for t, _ in by_task(run.tables["sweep"])]


def save_figure(fig, out: Path, stem: str, svg: bool = False) -> Path:
    """``out/stem.png`` (and .svg), each written atomically; the figure is closed in any case."""
    import matplotlib.pyplot as plt

    try:
        for ext in ("png", "svg") if svg else ("png",):
            with atomic_path(out / f"{stem}.{ext}") as tmp:
                fig.savefig(tmp, dpi=150, format=ext)
    finally:
        plt.close(fig)
    return out / f"{stem}.png"


def render_figures(run: RunResults, svg: bool = False) -> tuple[list[tuple[str, Path]], list[str]]:
    """Write every figure the run supports; returns (written [(title, png path)], skipped messages)."""
    from outlierscope.report import plots

    out = run.root / "figures"
    out.mkdir(exist_ok=True)
    written, skipped = [], []
    for stem, table, fn, title in FIGURES:
        df = run.tables.get(table)
        if df is None:
            skipped.append(f"{stem}: no {table} data in {run.root}")
            continue
        fig = fn(plots, df, run)
        if fig is None:
            skipped.append(f"{stem}: nothing to draw (no task of the sweep reports this metric)")
            continue
        save_figure(fig, out, stem, svg)
        written.append((title, out / f"{stem}.png"))
    return written, skipped


def _model_kinds(run: RunResults) -> dict[str, str]:
    """model name -> 'transformer' | 'diff' | 'other' from the profile facts or the spec."""
    kinds = {}
    if run.profile_meta:
        for name, f in run.profile_meta["models"].items():
            kinds[name] = "diff" if f.get("is_diff") or f.get("model_type") == "diffllama" else (
                "transformer" if f.get("model_type") == "llama" else "other")
    if "sweep" in run.tables:
        for m in run.tables["sweep"]["model"].unique():
            kinds.setdefault(m, "diff" if m.endswith(":diff") else "transformer" if m.endswith(":transformer") else "other")
    return kinds


def outcome_paragraph(run: RunResults) -> str:
    """Plain-words statement of the measured outcome, generated from the numbers."""
    kinds = _model_kinds(run)
    sentences = []
    t5 = run.tables.get("table5")
    tr = [m for m, k in kinds.items() if k == "transformer"]
    df = [m for m, k in kinds.items() if k == "diff"]
    if t5 is not None and tr and df and tr[0] in set(t5["model"]) and df[0] in set(t5["model"]):
        for act in t5["activation"].unique():
            a = t5[(t5.model == tr[0]) & (t5.activation == act)].iloc[0]
            b = t5[(t5.model == df[0]) & (t5.activation == act)].iloc[0]
            big, small = (a, b) if a["top1"] >= b["top1"] else (b, a)
            ratio = big["top1"] / small["top1"] if small["top1"] > 0 else float("inf")
            sentences.append(
                f"For {act.lower()}, the {'Transformer' if big is a else 'Diff Transformer'} has the larger top-1 "
                f"|value| ({big['top1']:.2f} vs {small['top1']:.2f}, {ratio:.2f}x); medians are "
                f"{a['median']:.3g} (Transformer) and {b['median']:.3g} (Diff Transformer), so the top-1/median "
                f"ratio is {a['top1'] / a['median']:.0f} vs {b['top1'] / b['median']:.0f}."
            )
    sw = run.tables.get("sweep")
    if sw is not None:
        sentences += _sweep_outcome(sw)
    return " ".join(sentences) if sentences else "No results to summarise."


def _headline_rows(sw, bits: int):
    """Per task, the rows of its headline metric (acc_norm where reported, else acc) at ``bits``."""
    return [g[(g.metric == headline_metric(g.metric)) & (g.bits == bits)] for _, g in by_task(sw)]


def _sweep_outcome(sw) -> list[str]:
    """Sentences on the change at the lowest bit width: per model for one task; per model across tasks for a suite."""
    import pandas as pd

    sw = with_task(sw)
    low = int(sw["bits"].min())
    if low == 16:
        return []
    tasks = list(dict.fromkeys(sw["task"]))
    if len(tasks) == 1:
        out = []
        hm = headline_metric(sw.metric)
        acc = sw[sw.metric == hm]
        for model, g in acc.groupby("model", sort=False):
            base, q = g[g.bits == 16], g[g.bits == low]
            if base.empty or q.empty:
                continue
            q = q.iloc[0]
            sig = "significant" if q["mcnemar_p"] < 0.05 else "not significant"
            out.append(
                f"{model}: {hm} {base.iloc[0]['value'] * 100:.2f}% at 16 bits and {q['value'] * 100:.2f}% at "
                f"{low} bits, a change of {q['delta_vs_16'] * 100:+.2f} points (95% CI "
                f"{q['ci_low'] * 100:+.2f} to {q['ci_high'] * 100:+.2f}; McNemar p = {q['mcnemar_p']:.3g}, {sig} at 5%)."
            )
        flips = sw[(sw.metric == FLIP_METRIC[hm]) & (sw.bits == low)]
        if len(flips) >= 2:
            f = flips.set_index("model")["value"]
            hi, lo = f.idxmax(), f.idxmin()
            out.append(f"At {low} bits, {f[hi] * 100:.2f}% of {hi}'s {hm} choices change versus {f[lo] * 100:.2f}% "
                       f"for {lo}.")
        return out
    out = []
    rows = pd.concat(_headline_rows(sw, low))
    for model, g in rows.groupby("model", sort=False):
        d = g.set_index("task")["delta_vs_16"] * 100
        sig = [task_label(t) for t, p in g.set_index("task")["mcnemar_p"].items() if p < 0.05]
        out.append(
            f"{model} at {low} bits against 16 bits, over {len(d)} tasks (headline metric: acc_norm where reported, "
            f"else acc): mean change {d.mean():+.2f} points, from {d.min():+.2f} ({task_label(d.idxmin())}) to "
            f"{d.max():+.2f} ({task_label(d.idxmax())}); significant at 5% (McNemar) on {len(sig)} of {len(d)}"
            + (f" ({', '.join(sig)})." if sig else ".")
        )
    return out


def _timing_table(meta: dict | None) -> list[str]:
    """Seconds per model and task, summed over its bit widths, from the cells of the sweep record."""
    cells = (meta or {}).get("cells") or []
    if not cells or any(c.get("seconds") is None for c in cells):
        return []
    total, rows = {}, {}
    for c in cells:
        key = (c["model"], c.get("task", "hellaswag"))
        total[key] = total.get(key, 0.0) + c["seconds"]
        rows.setdefault(key, []).append(f"{c['bits']}: {c['seconds']:.0f}")
    m = meta.get("machine") or {}
    where = f" on {m.get('cpu', '?')}, {m.get('cores', '?')} cores" + (f", {m['gpu']}" if m.get("gpu") else "")
    out = [f"Time per model and task (seconds as each cell recorded when it ran{where}; a cell reused from an "
           "earlier run keeps its own time):", "", "| Model | Task | seconds (all bit widths) | per bit width |",
           "|---|---|---|---|"]
    for (model, task), t in total.items():
        out.append(f"| {model} | {task_label(task)} | {t:,.0f} | {', '.join(rows[(model, task)])} |")
    return out + [f"| all | | {sum(total.values()):,.0f} | |", ""]


def write_report(run_dir: str | Path, svg: bool = False) -> Path:
    """Render figures and write ``report.md`` into the run directory."""
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
    if "sweep" in run.tables:
        s = run.sweep_meta["settings"] if run.sweep_meta else {}
        sw = run.tables["sweep"]
        n_items = ", ".join(f"{task_label(t)} {int(g['n_items'].iloc[0]):,}" for t, g in by_task(sw))
        parts += [f"## Quantized attention logits on {', '.join(sweep_tasks(run))} (Figure 8)", "",
                  f"Dynamic absmax post-training quantization of the pre-softmax attention logits, format `{s.get('format')}`, "
                  f"granularity `{s.get('granularity')}`, weights `{s.get('weights')}`, validation items: {n_items}; "
                  "zero-shot, lm-eval 0.4.13 scoring. "
                  "16 bits = unquantized. Intervals: 95% paired bootstrap "
                  f"({run.sweep_meta['bootstrap_reps'] if run.sweep_meta else '?'} resamples); p: exact McNemar test.", "",
                  sweep_table(run.tables["sweep"]), ""]
        parts += _timing_table(run.sweep_meta)
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
