"""A sweep's tables from its cells: the tidy ``sweep.csv`` (one row per model, task, setting and metric, with the
change against the model's 16-bit cell), ``attn_error.csv``, ``linear_error.csv``, ``gold_ll.csv`` and the record
(``SweepResult``). Shared by a run, ``tabulate_sweep`` and the merge of shards."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from outlierscope.analysis.paired import BOOTSTRAP_REPS, mean_change
from outlierscope.data.tasks import chance_percent, task_label, task_metrics
from outlierscope.eval.evaluate import EvalResult, items_digest
from outlierscope.io import git_commit, machine, versions, write_csv, write_run_record
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.report.load import SWEEP_COLUMNS
from outlierscope.report.tables import FLIP_METRIC, sweep_table
from outlierscope.runs.sweep_settings import SweepSettings


def cell_metrics(res: EvalResult, base: EvalResult | None, seed: int, metrics=("acc", "acc_norm")) -> dict:
    """A cell's metrics, flat, with their standard errors and, against the unquantized cell, each metric's change.

    Args:
        res: the cell's result.
        base: its model's unquantized cell; None: no change.
        seed: the bootstrap's seed.
        metrics: the task's metrics (lm-eval's acc-only tasks have no acc_norm)."""
    cmp = res.compare(base, seed=seed) if base is not None else None
    out = {}
    for m in metrics:  # per metric: value, stderr, then its change (the row order of sweep.csv)
        out[m], out[f"{m}_stderr"] = res.metrics[m], res.metrics[f"{m}_stderr"]
        if cmp is not None:
            c = cmp[m]
            out.update({f"{m}_delta": c["delta"], f"{m}_ci_low": c["ci_low"], f"{m}_ci_high": c["ci_high"],
                        f"{m}_mcnemar_p": c["mcnemar_p"], FLIP_METRIC[m]: c["flip_rate"]})
    if cmp is not None:
        out["mean_abs_score_change"] = cmp["mean_abs_score_change"]
    if res.metrics.get("lm_loss") is not None:
        out["lm_loss"] = res.metrics["lm_loss"]
    return out


def cell_label(spec: QuantSpec, source: dict | None = None) -> str:
    """A cell's label in tables and on the console: the spec's, or for a checkpoint saved quantized its own at 16 bits.

    That 16-bit cell is no emulation on top of the checkpoint's own quantization, not an unquantized model.

    Args:
        spec: the cell's spec.
        source: the model's ``provenance`` (or the run record's entry)."""
    saved = (source or {}).get("quantization_config")
    if spec.is_identity and saved:
        return f"16 (no emulation; saved {saved.get('quant_method', 'quantized')})"
    return spec.label


def _tidy_rows(model: str, task: str, spec: QuantSpec, label: str, s: SweepSettings, metrics: dict, info: dict,
               cid: str) -> list[dict]:
    """One row per metric (value, stderr, change vs 16 bits with its interval and McNemar p); ``info``: the
    task's ``task_record`` (its items and chance level go in every row: the table stands alone)."""
    rows = []
    for m, v in metrics.items():
        if m.endswith(("_stderr", "_ci_low", "_ci_high", "_mcnemar_p", "_delta")):
            continue
        rows.append({"model": model, "task": task, "bits": spec.bits, "label": label, "format": spec.columns.format,
                     "granularity": "none" if spec.is_identity else spec.columns.granularity, "weights": s.weights,
                     "metric": m, "value": v, "stderr": metrics.get(f"{m}_stderr"),
                     "delta_vs_16": metrics.get(f"{m}_delta"), "ci_low": metrics.get(f"{m}_ci_low"),
                     "ci_high": metrics.get(f"{m}_ci_high"), "mcnemar_p": metrics.get(f"{m}_mcnemar_p"),
                     "n_items": info["n_items"], "chance": info["chance"], "cell": cid})
    return rows


@dataclass
class SweepResult:
    """A finished sweep: its tidy table and its run record.

    Attributes:
        table: one row per model, task, bit width and metric (``sweep.csv``).
        record: the sealed run record (``sweep.json``).
        out: the run's output directory.
        side: the side tables where measured (``attn_error``, ``linear_error``, ``gold_ll``)."""

    table: pd.DataFrame
    record: dict
    out: Path
    side: dict[str, pd.DataFrame] = field(default_factory=dict)

    def markdown(self) -> str:
        """One row per model and bit width: acc, acc_norm (stderr), change vs 16 bits with CI, McNemar p, flips."""
        return sweep_table(self.table)

    def save(self, out: str | Path) -> Path:
        """Write ``sweep.csv`` and the side tables, then the sealed ``sweep.json`` with every table's digest.

        Args:
            out: the directory.

        Returns:
            The directory."""
        out = Path(out)
        write_csv(out / "sweep.csv", self.table)
        for name, df in self.side.items():
            write_csv(out / f"{name}.csv", df)
        text = ["text.csv"] if "text_metrics" in self.record else []
        write_run_record(out / "sweep.json", self.record, ["sweep.csv", *(f"{n}.csv" for n in self.side), *text])
        return out


def task_record(task: str, items: list) -> dict:
    """What a sweep records per task: display name, metrics, items, their digest and the chance level (%).

    Args:
        task: the task.
        items: its items."""
    return {"label": task_label(task), "metrics": list(task_metrics(task)), "n_items": len(items),
            "items_sha256": items_digest(items), "chance": chance_percent(items)}


def _tabulate(s: SweepSettings, cells: list[tuple[str, str, QuantSpec, str, EvalResult]], tasks: dict, out: Path,
              **record_extra) -> SweepResult:
    """The sweep's tables from its cells (model, task, spec, cell id, result), each (model, task)'s 16-bit cell
    first. ``tasks``: ``task_record`` per task. A one-task sweep also keeps ``n_items``, ``items_sha256``
    and ``chance`` at the record's top level (where they were before sweeps had several tasks)."""
    rows, cell_index, base, errors, lin_errors = [], [], None, [], []
    sources = record_extra.get("model_sources") or {}
    for model, task, spec, cid, res in cells:
        label = cell_label(spec, sources.get(model))
        if "attn_error_table" in res.extra:
            errors.append(res.extra.pop("attn_error_table").assign(model=model, task=task, bits=spec.bits, label=label))
        if "linear_error_table" in res.extra:
            lin_errors.append(res.extra.pop("linear_error_table").assign(model=model, task=task, label=label))
        if spec.is_identity:
            base = res
        metrics = cell_metrics(res, None if spec.is_identity else base, s.seed, task_metrics(task))
        cell_index.append({**_cell_entry(cid, model, task, spec), "label": label, **metrics, "seconds": res.seconds, "items_per_s": res.extra.get("items_per_s")})
        rows += _tidy_rows(model, task, spec, label, s, metrics, tasks[task], cid)
    single = {k: v for k, v in next(iter(tasks.values())).items() if k in ("n_items", "items_sha256", "chance")} \
        if len(tasks) == 1 else {}
    record = {"settings": asdict(s), **single, "tasks": tasks, "bootstrap_reps": BOOTSTRAP_REPS,
              "cells": cell_index, **record_extra, "versions": versions(), "machine": machine(),
              "git_commit": git_commit(), "note": "bits 16 = unquantized"}
    result = SweepResult(pd.DataFrame(rows, columns=SWEEP_COLUMNS), record, out, _side_tables(cells, errors, lin_errors, s.seed))
    result.save(out)
    return result


def _side_tables(cells, errors: list[pd.DataFrame], lin_errors: list[pd.DataFrame], seed: int) -> dict[str, pd.DataFrame]:
    """The sweep's tables beside ``sweep.csv``, where measured: per model, task, bit width, layer and head what
    quantization did to attention; per scheme, layer and linear each quantized linear's relative output error; per
    quantized cell the change of the gold choice's log-likelihood."""
    side = {}
    if errors:
        t = pd.concat(errors, ignore_index=True)
        first = ["model", "task", "bits", "label"]
        side["attn_error"] = t[first + [c for c in t.columns if c not in first]]
    if lin_errors:
        t = pd.concat(lin_errors, ignore_index=True)
        side["linear_error"] = t[["model", "task", "label", "layer", "linear", "tokens", "rel_err_mean", "rel_err_max"]]
    gold = gold_ll_table(cells, seed)
    if len(gold):
        side["gold_ll"] = gold
    return side


GOLD_COLUMNS = ["model", "task", "label", "n_items", "delta_gold_ll", "ci_low", "ci_high", "minus_first_model",
                "minus_first_ci_low", "minus_first_ci_high"]


def gold_ll_table(cells: list[tuple[str, str, QuantSpec, str, EvalResult]], seed: int) -> pd.DataFrame:
    """Per quantized cell, the mean change of the gold choice's log-likelihood against its model's unquantized cell.

    In nats (< 0 hurts), with its 95% paired bootstrap interval (a measure that moves where accuracy sits at chance);
    and that change minus the first model's change of the same task and setting, paired by item (the pair: Diff minus
    Transformer; < 0: this model is hurt more), NaN for the first model.

    Args:
        cells: ``(model, task, spec, cell id, result)`` of every cell.
        seed: the bootstrap's seed."""
    base, change, rows = {}, {}, []
    for model, task, spec, _, res in cells:
        if spec.is_identity:
            base[model, task] = res
            continue
        b = base[model, task]
        change[model, task, spec.label] = (res.items["index"].to_numpy(), res.gold_loglik() - b.gold_loglik())
        first = next(m for (m, t, lab) in change if (t, lab) == (task, spec.label))  # insertion order: the first model
        c = mean_change(b.gold_loglik(), res.gold_loglik(), seed)
        idx, d = change[model, task, spec.label]
        f_idx, f = change[first, task, spec.label]
        vs = mean_change(f, d, seed) if first != model and np.array_equal(idx, f_idx) else dict.fromkeys(c, np.nan)
        rows.append([model, task, spec.label, len(d), c["delta"], c["ci_low"], c["ci_high"], *vs.values()])
    return pd.DataFrame(rows, columns=GOLD_COLUMNS)


def _cell_entry(cid: str, model: str, task: str, spec) -> dict:
    """A cell as the records list it: an attention spec with its text (``quant``), a logits spec by its bits."""
    return {"cell": cid, "model": model, "task": task, "bits": spec.bits,
            **({"quant": str(spec)} if not spec.is_logits_only else {})}
