"""The measured outcome in plain words, generated from a run's tables (the report's first paragraph)."""

from __future__ import annotations

from outlierscope.data.tasks import task_label
from outlierscope.report.tables import FLIP_METRIC, by_task, headline_metric, recipe_rows, with_task


def _model_kinds(run) -> dict[str, str]:
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


def outcome_paragraph(run) -> str:
    """The measured outcome in plain words, generated from a run's numbers (the report's first paragraph).

    Args:
        run: the ``RunResults`` (its tables and profile record)."""
    kinds = _model_kinds(run)
    sentences = []
    t5 = run.tables.get("table5")
    tr = [m for m, k in kinds.items() if k == "transformer"]
    df = [m for m, k in kinds.items() if k == "diff"]
    if t5 is not None and tr and df and tr[0] in set(t5["model"]) and df[0] in set(t5["model"]):
        both = set(t5[t5.model == tr[0]]["activation"]) & set(t5[t5.model == df[0]]["activation"])
        table5 = [a for a in ("Attention Logits", "Hidden States") if a in both]  # Table 5's, when observed
        for act in table5 or [a for a in t5["activation"].unique() if a in both]:
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
        recipes = recipe_rows(sw)
        sentences += _sweep_outcome(sw[~recipes]) + _recipe_outcome(sw[recipes])
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


def _recipe_outcome(rows) -> list[str]:
    """Per task and model, the attention recipes or linear schemes (``sweep --quant`` rows) that change the most and the fewest of the
    headline metric's choices (flip rate), with the change of the metric itself."""
    out = []
    for task, t in by_task(rows):
        hm = headline_metric(t.metric)  # a recipe's rows carry its task's metrics
        for model, g in t.groupby("model", sort=False):
            flips = g[g.metric == FLIP_METRIC[hm]].set_index("label")["value"]
            if len(flips) < 2:
                continue
            delta = g[g.metric == hm].set_index("label")
            hi, lo = (_recipe_said(lb, flips[lb], delta.loc[lb], hm) for lb in (flips.idxmax(), flips.idxmin()))
            kind = _kind_said(flips.index)  # labels: recipe names or spec texts
            out.append(f"{model} on {task_label(task)}, {len(flips)} {kind}: the most damaging is {hi}, "
                       f"the least {lo}.")
    return out


def quantized_heading(sweep) -> str:
    """What a sweep's quantized rows quantize, for its report section's heading.

    The attention logits (the paper's bit widths), or what its ``--quant`` rows are besides (attention, the linear
    layers, both).

    Args:
        sweep: the sweep's table."""
    from outlierscope.report.tables import recipe_rows

    rows = recipe_rows(sweep)
    if not rows.any():
        return "Quantized attention logits"
    kind = _kind_said(sweep.loc[rows, "label"].unique())
    logits = (~rows & sweep["bits"].ne(16)).any()
    what = {"attention recipes": "attention recipes", "linear-layer schemes": "linear layers",
            "quantization recipes": "attention and linear layers"}[kind]
    return f"Quantized {'attention logits and ' if logits else ''}{what}"


def _kind_said(texts) -> str:
    """What a sweep's ``--quant`` rows are (their labels: recipe names or spec texts): attention recipes, linear-layer
    schemes, or both."""
    from outlierscope.quant.specs.spec import QuantSpec

    specs = [QuantSpec.parse(t) for t in texts]
    if not any(s.has_linear for s in specs):
        return "attention recipes"
    return "linear-layer schemes" if not any(s.has_attention for s in specs) else "quantization recipes"


def _recipe_said(label: str, flip: float, row, metric: str) -> str:
    return (f"{label} ({flip * 100:.1f}% of choices change, {metric} {row['delta_vs_16'] * 100:+.2f} points, "
            f"McNemar p = {row['mcnemar_p']:.3g})")
