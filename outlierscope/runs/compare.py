"""Emulated vs real: a quantized checkpoint against the emulation of its scheme on the float weights it came from,
per item, with paired statistics.

    spec    = quant, or what the checkpoint's quantization_config says (quant.export.spec_from_config:
              int on compressed-tensors' full-range grid, fintB)
    real    = sweep(checkpoint, 16 bits)                 -> out/real      (its own quantized forward)
    emulated = sweep(float model, 16 bits + each spec)   -> out/emulated  (cells resume, reports as any sweep)
    per task: real vs each emulation (same items, same order): predictions that differ, McNemar p, mean and max
              |change| of a choice's log-likelihood, gold log-likelihood change with its paired interval; and what
              each costs against the float model
    write compare.csv, compare.md, compare.json (both models' sources, the checkpoint's quantization_config, the
          spec, how emulation and real differ by construction)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from outlierscope.analysis.paired import mcnemar_exact, mean_change
from outlierscope.errors import ParamError, check_seed, warnings_to
from outlierscope.eval.evaluate import EvalResult
from outlierscope.io import (
    git_commit,
    machine,
    output_dir,
    read_record,
    versions,
    write_csv,
    write_run_record,
    write_text,
)
from outlierscope.models.loading import (
    device_map_option,
    device_option,
    dtype_option,
    inspect_model,
    meta_model,
    preview_config,
    trust_remote_code_option,
)
from outlierscope.models.packed import packed_modules, packed_scheme
from outlierscope.quant import export as qexport
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.runs.cells import refuse_other_settings
from outlierscope.runs.perplexity import (
    TEXT_FIELDS,
    check_text_fields,
    length_option,
    max_windows_option,
    protocol_option,
    text_batch_size_option,
    text_option,
)
from outlierscope.runs.sweep import SweepSettings, check_models, check_previous, check_specs, sweep
from outlierscope.settings import check_defaults, option

METRICS = ("items", "text")
ITEM_FIELDS = ("tasks", "sample", "limit", "batch_size")  # what only metric items reads


@dataclass(frozen=True)
class CompareSettings:
    """Settings of ``outlierscope compare-quant``: a quantized checkpoint against the emulation of its scheme on the
    float model it came from, per item or per token. Each field is a CLI flag of the same name (its help is the
    field's ``option`` text) and is written to the comparison's record."""

    real: str = option(None, "the quantized checkpoint (directory, Hub id)", metavar="SPEC")
    model: str = option(None, "the float model it was made from", metavar="SPEC")
    quant: tuple[str, ...] = option((), "also compare these emulations (a compressed-tensors, GPTQ or AWQ checkpoint's own "
                                    "scheme is always compared, read from its quantization_config; other checkpoints need "
                                    "one); repeat", flag="--quant", repeat=True, metavar="SPEC")
    tasks: tuple[str, ...] = option(("hellaswag",), "tasks, as sweep's --task", flag="--task", repeat=True,
                                    metavar="TASK")
    sample: int | None = option(None, "N items of each task drawn at random (with --seed)")
    limit: int | None = option(None, "first N items of each task")
    seed: int = option(0, "seeds --sample and the bootstrap")
    batch_size: int = option(32, "(context, ending) sequences per forward")
    metric: str = option("items", "items: the tasks' items (accuracy, McNemar, log-likelihood changes); text: running "
                         "text, every token's whole distribution (KL divergence of each emulation to the checkpoint, "
                         "of both to the float model; perplexity)", choices=METRICS)
    text: str = text_option()
    protocol: str = protocol_option()
    length: int | None = length_option()
    max_windows: int | None = max_windows_option()
    text_batch_size: int = text_batch_size_option()
    dtype: str = dtype_option()
    device: str = device_option()
    device_map: str | None = device_map_option()
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self):
        check_seed(self.seed)
        for name in ("real", "model"):
            if not getattr(self, name):
                raise ParamError(name, "a model spec (directory, Hub id, preset role or fetched model)", getattr(self, name))
        if self.real == self.model:
            raise ParamError("real", "another model than model (the checkpoint, not its float source)", self.real)
        object.__setattr__(self, "quant", tuple(self.quant))
        dup = [q for i, q in enumerate(self.quant) if q in self.quant[:i]]
        if dup:
            raise ParamError("quant", "distinct specs", list(self.quant), f"{dup[0]} is given twice")
        self.sweep_settings(self.model, ())  # tasks, items, batch and dtype checked as sweep checks them
        if self.metric not in METRICS:
            raise ParamError("metric", f"one of {', '.join(METRICS)}", self.metric)
        check_text_fields(self)
        scores = "items of tasks" if self.metric == "items" else "running text"
        check_defaults(self, TEXT_FIELDS if self.metric == "items" else ITEM_FIELDS,
                       f"with metric={self.metric!r} (it scores {scores})")
        if self.metric == "text" and self.device_map is not None:
            raise ParamError("device_map", "None with metric='text' (both models load on one device; use device)",
                             self.device_map)

    def sweep_settings(self, model: str, quant: tuple[str, ...]) -> SweepSettings:
        """The settings of one of the comparison's two sweeps.

        Args:
            model: the model swept (the checkpoint, or the float model).
            quant: its specs (none for the checkpoint; the emulations for the float model)."""
        return SweepSettings(models=(model,), bits=(16,), quant=quant, tasks=self.tasks, sample=self.sample,
                             limit=self.limit, seed=self.seed, batch_size=self.batch_size, dtype=self.dtype,
                             device=self.device, device_map=self.device_map, trust_remote_code=self.trust_remote_code)


def emulations(s: CompareSettings, record, meta) -> tuple[list[str], dict | None]:
    """The specs to emulate and the checkpoint's quantization config.

    A compressed-tensors / GPTQ / AWQ checkpoint's own scheme, read from its ``quantization_config``, then ``quant``.

    Args:
        s: the comparison's settings.
        record: the checkpoint's ``inspect_model``.
        meta: its model on the meta device.

    Returns:
        ``(spec texts, the quantization config or None)``."""
    path, qconfig = record.path, record.quantization
    own, method = [], (qconfig or {}).get("quant_method")
    if method == "compressed-tensors":
        own = [str(qexport.spec_from_config(qconfig, meta))]
    elif packed_scheme(qconfig) is not None:
        own = [str(qexport.spec_from_packed_config(qconfig, meta, packed_modules(path)))]
    elif not s.quant:
        raise ParamError("quant", f"given: {s.real} is no compressed-tensors, GPTQ or AWQ checkpoint whose scheme could be read "
                         f"(quant_method {qconfig and qconfig.get('quant_method')!r}); name its emulation", s.quant)
    return list(dict.fromkeys(own + [str(QuantSpec.parse(q)) for q in s.quant])), qconfig


def _differences(specs: list[str], qconfig: dict | None) -> list[str]:
    """How the real checkpoint and the emulations differ by construction (GPTQ / AWQ: their algorithms' own)."""
    if packed_scheme(qconfig) is not None:
        return qexport.packed_differences(qconfig)
    return list(dict.fromkeys(d for spec in specs for d in qexport.differences(QuantSpec.parse(spec))))


def _cells(out: Path) -> dict[tuple[str, str], EvalResult]:
    """(task, quant text or '16') -> the sweep's cell result, read back from ``out``."""
    rec = read_record(out / "sweep.json", ("cells",))
    return {(c["task"], c.get("quant", "16")): EvalResult.load(out / "cells", c["cell"]) for c in rec["cells"]}


def pair_row(a: EvalResult, b: EvalResult, seed: int) -> dict:
    """One evaluation against another on the same items: predictions that differ, McNemar p, log-likelihood changes.

    Args:
        a: the first evaluation.
        b: the second.
        seed: the bootstrap's seed."""
    cols = a.score_columns
    change = np.abs(b.items[cols].to_numpy() - a.items[cols].to_numpy())  # (N, choices); NaN: no such choice
    gold = mean_change(a.gold_loglik(), b.gold_loglik(), seed)
    row = {"n_items": len(a.items)}
    for m, col in (("acc", "pred"), ("acc_norm", "pred_norm")):
        if col in a.items:
            row[f"{m}_a"], row[f"{m}_b"] = a.metrics[m], b.metrics[m]
            row[f"{m}_pred_differs"] = int((a.items[col].to_numpy() != b.items[col].to_numpy()).sum())
            row[f"{m}_mcnemar_p"] = mcnemar_exact(a.correct(m), b.correct(m))
    return {**row, "mean_abs_ll_change": float(np.nanmean(change)), "max_abs_ll_change": float(np.nanmax(change)),
            "gold_ll_delta": gold["delta"], "gold_ll_ci_low": gold["ci_low"], "gold_ll_ci_high": gold["ci_high"]}


def compare_table(real: dict, emulated: dict, specs: list[str], tasks, seed: int) -> pd.DataFrame:
    """Per task: float vs real, float vs each emulation, real vs each emulation (a the first, b the second).

    Args:
        real: (task, ``16``) -> the checkpoint's evaluation.
        emulated: (task, spec or ``16``) -> the float model's.
        specs: the emulations' specs.
        tasks: the tasks.
        seed: the bootstrap's seed."""
    rows = []
    for task in tasks:
        base, r = emulated[(task, "16")], real[(task, "16")]
        rows.append({"task": task, "a": "float", "b": "real", **pair_row(base, r, seed)})
        for spec in specs:
            e = emulated[(task, spec)]
            rows.append({"task": task, "a": "float", "b": f"emulated: {spec}", **pair_row(base, e, seed)})
            rows.append({"task": task, "a": "real", "b": f"emulated: {spec}", **pair_row(r, e, seed)})
    return pd.DataFrame(rows)


def _markdown(table: pd.DataFrame, record: dict) -> str:
    lines = [f"# Emulated vs real: {record['real']} against {record['model']}", "",
             "b against a on the same items: acc_norm of each, predictions that differ, McNemar p, mean / max |change| "
             "of a choice's log-likelihood (nats), gold log-likelihood change b - a with its 95% paired interval.", "",
             "| task | a | b | acc_norm a | acc_norm b | differ | p | mean abs | max abs | gold ll change |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    m = "acc_norm" if "acc_norm_a" in table and table["acc_norm_a"].notna().all() else "acc"
    for r in table.itertuples(index=False):
        d = r._asdict()
        lines.append(f"| {d['task']} | {d['a']} | {d['b']} | {100 * d[f'{m}_a']:.2f} | {100 * d[f'{m}_b']:.2f} | "
                     f"{d[f'{m}_pred_differs']} / {d['n_items']} | {d[f'{m}_mcnemar_p']:.3g} | "
                     f"{d['mean_abs_ll_change']:.3g} | {d['max_abs_ll_change']:.3g} | {d['gold_ll_delta']:+.3f} "
                     f"[{d['gold_ll_ci_low']:+.3f}, {d['gold_ll_ci_high']:+.3f}] |")
    lines += ["", "How emulation and real differ by construction:", ""]
    lines += [f"- {d}" for d in record["differences"]]
    return "\n".join(lines) + "\n"


def check_source(s: CompareSettings, real_meta, float_meta) -> None:
    """Check that the float model is the checkpoint's source by shape: the same linears and embeddings.

    A checkpoint of another model gives meaningless pairs.

    Args:
        s: the comparison's settings (the models' names, for the error).
        real_meta: the checkpoint's model on the meta device.
        float_meta: the float model's."""
    from torch import nn

    def shapes(model):
        return {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}

    real, float_ = shapes(real_meta), shapes(float_meta)
    if real != float_:
        diff = sorted(set(real.items()) ^ set(float_.items()))[0][0]
        raise ParamError("model", f"the float model {s.real} was made from (the same linears and embeddings)", s.model,
                         f"{diff}: {real.get(diff)} in the checkpoint, {float_.get(diff)} in the float model")


def compare_quant(s: CompareSettings, out: str | Path, progress: bool = True, log=print,
                  force: bool = False) -> pd.DataFrame:
    """Run (or resume) a quantized checkpoint's sweep beside its emulation on the float model, and pair them.

    Both models, that the float one is the checkpoint's source, each emulation and earlier results in ``out`` are
    checked before the first cell.

    Args:
        s: the comparison's settings.
        out: the output directory: ``real/``, ``emulated/`` (and ``cells/`` for a metric text), then the paired table.
        progress: show progress bars.
        log: where progress lines go.
        force: replace a run with other settings in ``out``.

    Returns:
        The paired comparison table."""
    git_commit()  # the checkout as the run found it (read once per process): before any record is written
    real = inspect_model(s.real, s.trust_remote_code)  # each model read once; its record is handed on
    real_meta = meta_model(real.config, s.trust_remote_code)
    specs, qconfig = emulations(s, real, real_meta)
    real_s, emu_s = s.sweep_settings(s.real, ()), s.sweep_settings(s.model, tuple(specs))
    if (config := preview_config(s.model)) is not None:  # a GGUF float model: its metadata before its conversion
        check_specs(s.model, emu_s.specs(), config)
    records = {s.real: real, s.model: inspect_model(s.model, s.trust_remote_code)}
    check_source(s, real_meta, meta_model(records[s.model].config, s.trust_remote_code))
    out = Path(out)
    check_models(emu_s, records)
    if s.metric == "text":
        return _compare_text(s, out, specs, qconfig, records, log, force)
    for sub, settings in (("real", real_s), ("emulated", emu_s)):
        check_previous(out / sub, dataclasses.asdict(settings), force)
    with output_dir(out):
        log(f"real: {s.real}; emulated: {s.model} under {' | '.join(specs)}")
        real_run = sweep(real_s, out / "real", progress=progress, log=log, force=force, records=records)
        emu_run = sweep(emu_s, out / "emulated", progress=progress, log=log, force=force, records=records)
        tasks = real_run.record["settings"]["tasks"]
        table = compare_table(_cells(out / "real"), _cells(out / "emulated"), specs, tasks, s.seed)
        record = {"settings": dataclasses.asdict(s), "real": s.real, "model": s.model, "specs": specs,
                  "quantization_config": qconfig, "model_sources": {**real_run.record["model_sources"],
                                                                    **emu_run.record["model_sources"]},
                  "differences": _differences(specs, qconfig),
                  **({"calibration": cal} if (cal := emu_run.record.get("calibration", {}).get(s.model)) else {}),
                  "versions": versions(), "machine": machine(), "git_commit": git_commit()}
        write_csv(out / "compare.csv", table)
        write_text(out / "compare.md", _markdown(table, record))
        write_run_record(out / "compare.json", record, ["compare.csv", "compare.md"])
    return table


def _check_previous_text(out: Path, s: CompareSettings, force: bool) -> None:
    """An earlier comparison in ``out`` with other settings is replaced only with ``force`` (its cells are kept: a
    cell's file name is its identity); every setting must be in its record (no defaults: the text comparison is
    younger than every setting it has)."""
    import json

    refuse_other_settings(out / "compare.json", json.loads(json.dumps(dataclasses.asdict(s))), {}, "a comparison",
                          force)


def _compare_text(s: CompareSettings, out: Path, specs: list[str], qconfig: dict | None, records: dict, log,
                  force: bool) -> pd.DataFrame:
    """metric text: the text pairs (``compare_on_text``), the table, the
    figures and the record."""
    from outlierscope.runs.compare_text import compare_on_text
    from outlierscope.runs.perplexity import perplexity_markdown, write_figures

    _check_previous_text(out, s, force)
    with output_dir(out), output_dir(out / "cells"), warnings_to(log):
        log(f"real: {s.real}; emulated: {s.model} under {' | '.join(specs)}; on running text")
        table, text, kld = compare_on_text(s, out, specs, records, log)
        record = {"settings": dataclasses.asdict(s), "real": s.real, "model": s.model, "specs": specs,
                  "quantization_config": qconfig, **text, "differences": _differences(specs, qconfig),
                  "cells": dict(zip(table["label"], table["cell"])),
                  "versions": versions(), "machine": machine(), "git_commit": git_commit()}
        write_csv(out / "compare.csv", table)
        write_figures(out / "figures", table, kld, "a (the first of each pair)")
        md = perplexity_markdown(table, "b against a")
        write_text(out / "compare.md", f"# Emulated vs real on running text: {s.real} against {s.model}\n\n"
                   f"{record['scored_tokens']:,} tokens of {s.text} ({s.protocol}); KL(a || b) at every token; "
                   "PPL is b's.\n\n" + md + "\nHow emulation and real differ by construction:\n\n"
                   + "".join(f"- {d}\n" for d in record["differences"]))
        write_run_record(out / "compare.json", record, ["compare.csv", "compare.md"])
    log(md)
    return table
