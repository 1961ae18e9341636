"""What a finished sensitivity study writes: ``sensitivity.json`` (settings, ranking, the suggestion and its
verification, rank correlations, cells), ``sensitivity.csv``, ``greedy.csv``, ``kinds.csv``, ``sensitivity.md``, the
figures, and the summary line on the console. ``run``: the study's state (``outlierscope.runs.sensitivity``)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd

from outlierscope.analysis.harm import rank_by_of
from outlierscope.hooks.points import decoder_layers
from outlierscope.io import (
    git_commit,
    machine,
    versions,
    write_csv,
    write_run_record,
    write_text,
)
from outlierscope.quant.weights.calibration import calibration_records
from outlierscope.runs.sensitivity_settings import SensitivitySettings


def written_files(s: SensitivitySettings, record: dict) -> list[str]:
    """The files a finished study wrote, in the order a reader wants them.

    ``kinds.csv`` only for a scheme with linear parts, ``attn_error.csv`` only where attention was measured.

    Args:
        s: the study's settings.
        record: its record."""
    return ["sensitivity.md", "sensitivity.csv", "greedy.csv", *(["kinds.csv"] if "kinds" in record else []),
            *(["attn_error.csv"] if s.attn_error and s.metric == "gold_ll" and _in_attention(s.spec()) else []),
            "sensitivity.json", "figures/"]


def _in_attention(spec) -> bool:
    """Whether ``spec`` changes anything inside attention (a linear-only spec has no attention error to measure)."""
    return spec.is_logits_only or spec.has_attention


def outlier_points(spec, model) -> tuple[str, ...]:
    """The points whose top-1 / median |x| is a layer's outlier ratio in a sensitivity study.

    The attention logits when the spec quantizes attention (or is the logits' bit width), the inputs of the decoder
    linears it quantizes when it has linear parts (both for a mixed spec).

    Args:
        spec: the study's spec.
        model: the model (a meta model will do)."""
    from outlierscope.quant.linears.sites import linear_sites

    linear = getattr(spec, "has_linear", False)
    points = ["layers.*.attn.logits"] if not linear or spec.has_attention else []
    if linear:
        paths = sorted({site.path for site in linear_sites(model, spec) if not site.is_head})
        points += [f"layers.*.{p}.input" for p in paths]
    return tuple(points)


def _record(run, table: pd.DataFrame, order: list[int], keep: list[int], tries: list[dict]) -> dict:
    """sensitivity.json: settings, ranking, the suggestion and its verification, rank correlations, cells."""
    s, rb = run.s, run.rank_by
    harm = rb.harm(table["only_" + rb.column]).rank()
    ident = run.text["ident"] if run.text is not None else run.ident
    rec = {"settings": asdict(s), "n_items": len(run.items), "metric": run.metric,
           "n_layers": len(decoder_layers(run.lm.model)), "ranking": order, "keep": keep, "keep_bits": s.keep_bits,
           "quantized": [i for i in run.layers if i not in keep], "final": next(t for t in tries if t["kept"] == len(keep)),
           # > 0: layers with larger outliers (or a larger attention KL) are hurt more
           "spearman_damage_vs_outlier_ratio": float(harm.corr(table["outlier_ratio"].rank())),
           "outlier_points": list(outlier_points(s.spec(), run.lm.model)),
           "spearman_damage_vs_kl_mean": float(harm.corr(table["kl_mean"].rank())) if "kl_mean" in table else None,
           "note": "damage = mean change of the gold choice's log-likelihood with only that layer quantized; "
                   "rank 1 = most harmful; keep: the layers the greedy keeps at keep_bits (16 = unquantized); spearman: rank correlation of the harm (-damage) with the layer's outlier ratio, "
                   "its largest top-1/median |x| over outlier_points (> 0: layers with larger outliers are hurt more), "
                   "and with the layer's mean attention KL",
           "model_source": run.lm.provenance(ident["weights_sha256"]),
           "cells": run.cells, "processes": run.world.size, "versions": versions(), "machine": machine(),
           "git_commit": git_commit()}
    if cal := calibration_records([s.spec()], run.lm.model, run.lm.tokenizer):  # GPTQ/AWQ/SmoothQuant: text, tokens
        rec["calibration"] = cal
    if rb.on_text:
        t = run.text
        rec["note"] = (f"harm = {rb.column} of the cell with only that layer quantized against the unquantized "
                       f"model on running text ({rb.unit}); rank 1 = most harmful; keep: the layers the greedy keeps "
                       "unquantized for a harm of at most the tolerance; spearman: rank correlation of the harm with "
                       "the layer's outlier ratio, its largest top-1/median |x| over outlier_points")
        rec["rank_by"] = {"metric": rb.name, "column": rb.column, "unit": rb.unit, "text": t["text"].record(),
                          "protocol": s.protocol, "length": t["length"], "windows": len(t["windows"]),
                          "scored_tokens": int(sum(len(w.targets) for w in t["windows"])),
                          "stability": _ranking_stability(run) if run.world.is_main else None}
    return rec


def _ranking_stability(run) -> list[dict]:
    """How many windows the per-layer ranking needs (``ranking_stability`` of
    the one-layer text cells' per-window harm: KLD sums, or NLL change sums for ppl)."""
    from outlierscope.analysis.agreement import ranking_stability
    from outlierscope.analysis.kld import window_blocks
    from outlierscope.runs.text_cells import read_cell

    sums = []
    for i in run.layers:
        count, d, k = window_blocks(read_cell(run.cells_dir, run.cells[f"only_{i}"]))
        sums.append(k if run.rank_by.name == "kld" else d)
    return ranking_stability(count, np.stack(sums, 1), run.s.seed)  # (windows, layers)


def _write(out: Path, s: SensitivitySettings, record: dict, table: pd.DataFrame, tries: list[dict],
           kinds: pd.DataFrame | None = None) -> None:
    """The study's tables, its summary page and figures, then ``sensitivity.json`` with the tables' digests."""
    from outlierscope.report.sensitivity import sensitivity_markdown

    write_csv(out / "sensitivity.csv", table)
    if kinds is not None:
        write_csv(out / "kinds.csv", kinds)
    write_csv(out / "greedy.csv", pd.DataFrame(tries))
    write_text(out / "sensitivity.md", sensitivity_markdown(record, table, tries, kinds))
    _figures(table, out, record)
    tables = [f for f in written_files(s, record) if f.endswith((".csv", ".md"))]
    write_run_record(out / "sensitivity.json", record, tables)


def _log_summary(run, record: dict) -> None:
    from outlierscope.report.sensitivity import kept_as

    s, final, rho_kl, rb = run.s, record["final"], record["spearman_damage_vs_kl_mean"], run.rank_by
    reached = "verified" if final["within_tolerance"] else "NOT reached even keeping every layer"
    bound = (f"{rb.column} <= {s.tolerance} ({reached}: {final[rb.column]:.4g})" if rb.on_text else
             f"Δ gold ll >= -{s.tolerance} ({reached}: {final['delta_gold_ll']:+.4f} nats)")
    run.log(f"layers by harm: {record['ranking']}; keep {record['keep'] or 'none'} {kept_as(s.keep_bits)} for {bound}; "
            "Spearman(damage, outlier ratio) = "
            f"{record['spearman_damage_vs_outlier_ratio']:+.2f}"
            + (f", (damage, attention KL) = {rho_kl:+.2f}" if rho_kl is not None else ""))


def _figures(table: pd.DataFrame, out: Path, record: dict) -> None:
    from outlierscope.report import plots
    from outlierscope.report.markdown import save_figure
    from outlierscope.report.sensitivity import outliers_said, quantized_said

    (out / "figures").mkdir(exist_ok=True)
    what, rb = outliers_said(record), rank_by_of(record["settings"])
    save_figure(plots.sensitivity_bars(table, quantized_said(record["settings"]), what, rb.column, rb.label),
                out / "figures", "sensitivity")
    save_figure(plots.damage_vs_outliers(table, record["spearman_damage_vs_outlier_ratio"], what, rb.harm_sign,
                                         rb.column, rb.label), out / "figures", "damage_vs_outliers")
