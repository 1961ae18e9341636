"""Quantization sweep over bit widths (Figure 8): every cell is one :func:`~outlierscope.eval.evaluate` run.

For each model, task and setting (bits, format, granularity, weights) a cell records the task's
metrics (acc, and acc_norm where lm-eval reports it) with their standard errors, and against the same model at 16 bits (unquantized): the accuracy
difference with a 95% paired bootstrap interval, the exact McNemar p-value, the flip rate (share
of items whose choice changed) and the mean |score change|; optionally the language-model loss
on held-out text. Each cell is written atomically when it finishes; a rerun skips cells whose
settings match and recomputes those whose settings changed. A directory that holds a sweep with
other settings is refused unless ``force=True``. Under ``torchrun``, or split into ``--shard i/N`` runs
merged by :func:`merge_sweep`, the cells and tables are byte-identical to a single process's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from outlierscope.analysis.attention_error import AttentionErrorStats, measured_spec
from outlierscope.analysis.paired import BOOTSTRAP_REPS, mean_change
from outlierscope.data.tasks import chance_percent, task_label, task_metrics
from outlierscope.errors import OutlierscopeError, ParamError, check_seed
from outlierscope.eval.evaluate import EvalResult, evaluate, items_digest, select_items, subset_items
from outlierscope.io import git_commit, machine, output_dir, read_record, versions, write_csv, write_record
from outlierscope.models.loading import (
    attn_block_option,
    check_placement,
    device_map_option,
    device_option,
    dtype_option,
    inspect_model,
    num_layers,
    preview_config,
    trust_remote_code_option,
)
from outlierscope.models.presets import DEFAULT_PAIR
from outlierscope.parallel import Shard, World, find_shards
from outlierscope.quant.apply import check_layers, check_spec
from outlierscope.quant.numerics.names import FORMATS, GRANULARITIES, UNQUANTIZED_BITS, WEIGHT_MODES
from outlierscope.quant.specs.spec import QuantSpec, build_spec, layers_option
from outlierscope.quant.weights.calibration import calibration_records
from outlierscope.report.load import SWEEP_COLUMNS
from outlierscope.report.tables import FLIP_METRIC, sweep_table
from outlierscope.runs.cells import DEFAULT_BATCH, cached_cell, merged_cell, refuse_other_settings, revised
from outlierscope.runs.perplexity import length_option, max_windows_option, protocol_option
from outlierscope.settings import check_defaults, option


@dataclass(frozen=True)
class SweepSettings:
    """Settings of a sweep (``outlierscope sweep``): models x quantization specs x tasks, each pair a resumable cell.
    Each field is a CLI flag of the same name (its help is the field's ``option`` text); the record holds them all
    and a rerun into the same ``out`` resumes only with the same settings (``force`` to change them)."""

    models: tuple[str, ...] = option(DEFAULT_PAIR, "Hub id (ORG/NAME[@REVISION]), HF model directory, .gguf file, preset role or fetched model; repeat",
                                     flag="--model", repeat=True, metavar="SPEC")
    bits: tuple[int, ...] = option((16, 8, 6, 4), "bit widths; 16 = unquantized")
    format: str = option("int", "int absmax or FP8 (bits 8)", choices=FORMATS)
    granularity: str = option("per_tensor", "one scale per sequence and layer / per head / per query row",
                              choices=GRANULARITIES)
    quant: tuple[str, ...] = option((), "also: an attention recipe or spec (q/k/v/P/KV cache; see `outlierscope "
                                    "recipes`), e.g. sage2-int4 or 'k=int4/per_group:32'; repeat; --bits stays the "
                                    "logits' axis", flag="--quant", repeat=True, metavar="RECIPE_OR_SPEC")
    weights: str = option("none", "bitsandbytes weights in every cell (adds w=bnb-int8 or w=bnb-nf4 to each spec)", choices=WEIGHT_MODES)
    layers: tuple[int, ...] | None = option(None, "quantize only these layers, e.g. 0-3 or 0,2 (default all)",
                                            parse=layers_option)
    limit: int | None = option(None, "first N validation items of each task (all of a task with fewer)",
                               exclusive="items")
    sample: int | None = option(None, "N items of each task drawn at random (with --seed; all of a task with fewer)",
                                exclusive="items")
    seed: int = option(0, "seeds --sample and the bootstrap")
    tasks: tuple[str, ...] = option(("hellaswag",), "hellaswag or a zero-shot task (see `outlierscope tasks`); repeat "
                                    "for several; `paper` = the paper's seven, `all` = every task", flag="--task",
                                    repeat=True, metavar="TASK")
    data: str | None = option(None, "HellaSwag .jsonl (official format) or .arrow file (default: the cached "
                              "validation set)")
    text: str | None = option(None, "held-out .txt/.jsonl(.xz) text: also report LM loss (nats/token) per setting")
    text_tokens: int = option(65_536, "tokens of --text to use")
    kld_text: str | None = option(None, "also score every cell on this running text as `perplexity --text` does "
                                  "(lambada, a file, a dataset ORG/NAME:CONFIG:SPLIT): mean KL divergence to the "
                                  "unquantized model, PPL and the NLL change with intervals over windows, per model "
                                  "in text/ and together in text.csv")
    kld_protocol: str = protocol_option()
    kld_length: int | None = length_option()
    kld_max_windows: int | None = max_windows_option()
    batch_size: int = option(DEFAULT_BATCH, "(context, ending) sequences per forward; quantized scores depend on it by float32 "
                             "rounding (part of a quantized cell's identity); 1 is exactly batch-invariant, ~2x slower")
    dtype: str = dtype_option()
    device: str = device_option()
    device_map: str | None = device_map_option()
    attn_block: int | None = attn_block_option()
    attn_error: bool = option(False, "also measure per layer and head what quantization does to attention (KL, "
                              "argmax changes, output error) into attn_error.csv, for the logits cells and the --quant cells, "
                              "and per layer and linear each quantized linear's relative output error into "
                              "linear_error.csv; costs 2-5x the time of a cell; split over processes and shards like the "
                              "scores")
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self):
        check_seed(self.seed)
        from outlierscope.data.tasks import expand_tasks

        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "bits", tuple(self.bits))
        names = (self.tasks,) if isinstance(self.tasks, str) else tuple(self.tasks)
        dup = sorted({t for t in names if names.count(t) > 1})
        if dup:
            raise ParamError("tasks", "distinct task names", list(names), f"{dup[0]} is given twice")
        # the suites expanded (and every name checked) here: the record holds the tasks that ran
        object.__setattr__(self, "tasks", expand_tasks(names))
        if not self.models:
            raise ParamError("models", "at least one model spec (two for a side-by-side sweep)", ())
        dup = sorted({m for m in self.models if self.models.count(m) > 1})
        if dup:
            raise ParamError("models", "distinct model specs", list(self.models), f"{dup[0]} is given twice")
        check_placement(self.device, self.dtype, self.device_map, self.attn_block)
        if not self.tasks:
            raise ParamError("tasks", "at least one task (hellaswag or one of `outlierscope tasks`)", ())
        if self.data is not None and "hellaswag" not in self.tasks:
            raise ParamError("data", "None unless the tasks include hellaswag (the other tasks' rows come from the cache)",
                             self.data)
        if self.weights not in WEIGHT_MODES:
            raise ParamError("weights", f"one of {', '.join(WEIGHT_MODES)}", self.weights)
        for n, v in (("limit", self.limit), ("sample", self.sample)):  # per task; a task with fewer rows: all
            if v is not None and v < 1:
                raise ParamError(n, ">= 1", v)
        if self.limit is not None and self.sample is not None:
            raise OutlierscopeError("limit and sample exclude each other; pass one")
        if self.batch_size < 1:
            raise ParamError("batch_size", ">= 1", self.batch_size)
        if self.text_tokens < 1:
            raise ParamError("text_tokens", ">= 1", self.text_tokens)
        if not self.bits:
            raise ParamError("bits", "at least one bit width", ())
        self._check_kld()
        for b in self.bits:  # validate every spec up front: nothing runs with a bad one
            self.spec(b)
        object.__setattr__(self, "quant", tuple(self.quant))
        if self.kld_text is not None:
            self.kld_settings(self.models[0])  # protocol, length, windows and the specs as perplexity checks them
        parsed = {q: QuantSpec.parse(q) for q in self.quant}
        texts = [str(sp) for sp in parsed.values()]
        own = [q for q, sp in parsed.items() if sp.layers is not None]
        if own and self.layers is not None:  # one rule: layers applies to the specs that name none
            raise ParamError("layers", f"left out when a quant spec names its own layers ({own[0]!r}); layers applies to "
                             "the specs that name none: drop one of the two", list(self.layers))
        if self.attn_error:
            for q in self.quant:
                measured_spec(q)
        bnb = [q for q, sp in parsed.items() if sp.weights_mode != "none"]
        if bnb:
            raise ParamError("quant", "specs without bitsandbytes weights: they apply to every cell of a sweep "
                             f"(weights='{parsed[bnb[0]].weights_mode}', --weights)", bnb[0])
        linear_w = [q for q, sp in parsed.items() if sp.part("w") is not None]
        if linear_w and self.weights != "none":
            raise ParamError("weights", f"'none' with a quant spec that quantizes the weights itself ({linear_w[0]!r}): "
                             "one weight quantization at a time", self.weights)
        dup = sorted({t for t in texts if texts.count(t) > 1})
        if dup:
            raise ParamError("quant", "distinct specs", list(self.quant), f"{dup[0]} is given twice")

    def _check_kld(self) -> None:
        """The text settings only with ``kld_text``, checked as perplexity checks them; one device per model."""
        if self.kld_text is None:
            check_defaults(self, ("kld_protocol", "kld_length", "kld_max_windows"), "without kld_text")
            return
        for name, low in (("kld_length", 2), ("kld_max_windows", 1)):  # named as this command's settings
            value = getattr(self, name)
            if value is not None and value < low:
                raise ParamError(name, f">= {low}", value)
        if self.device_map is not None:
            raise ParamError("device_map", "None with kld_text (the text cells run the model on one device)",
                             self.device_map)

    def kld_settings(self, model: str):
        """The perplexity run of ``model`` on ``kld_text``: every spec of this sweep (its text), the same placement."""
        from outlierscope.runs.perplexity import PerplexitySettings

        return PerplexitySettings(model=model, quant=tuple(str(sp) for sp in self.specs() if not sp.is_identity),
                                  text=self.kld_text, protocol=self.kld_protocol, length=self.kld_length,
                                  max_windows=self.kld_max_windows, dtype=self.dtype, device=self.device,
                                  attn_block=self.attn_block, trust_remote_code=self.trust_remote_code)

    def spec(self, bits: int) -> QuantSpec:
        return build_spec(bits, self.format, self.granularity, self.layers)

    def specs(self) -> list[QuantSpec]:
        """Every cell's spec: the bit widths of the logits (16 first: the reference), then each ``quant`` (with
        ``layers`` when the spec names none). ``weights`` is not in them: each cell
        runs with it (``spec.with_weights(weights)``) and records it beside them."""
        out: list = [self.spec(b) for b in _bits_order(self)]
        for q in self.quant:
            a = QuantSpec.parse(q)
            out.append(a if a.layers is not None or self.layers is None else dataclasses.replace(a, layers=self.layers))
        return out

    def spec_of(self, cell: dict) -> QuantSpec:
        """The spec of a cell as a record lists it (``quant``: an attention spec's text; else its bits): the one of
        :meth:`specs` that ran it, with its recipe name."""
        if cell.get("quant"):
            ran = (sp for sp in self.specs() if str(sp) == cell["quant"])
            return next(ran, None) or QuantSpec.parse(cell["quant"])
        return self.spec(cell["bits"])

    def task_items(self) -> dict[str, list]:
        """Each task's items: all rows, the first ``limit`` or a ``sample`` drawn with ``seed``, and all rows of a
        task with fewer. A ``limit``/``sample`` above every task's rows is an error (a typo, not a suite)."""
        full = {t: select_items(data=self.data if t == "hellaswag" else None, task=t) for t in self.tasks}
        n, most = self.limit or self.sample, max(len(v) for v in full.values())
        if n is not None and n > most:
            name = "limit" if self.limit else "sample"
            raise ParamError(name, f"in 1..{most} (the items of {'the largest task' if len(full) > 1 else 'the task'})", n)
        return {t: subset_items(v, self.limit, self.sample, self.seed, at_most=True) for t, v in full.items()}

    @classmethod
    def from_record(cls, settings: dict) -> SweepSettings:
        """The settings as a sweep.json holds them (lists for tuples; ``task``: one task, before ``tasks``)."""
        return cls(**{k: tuple(v) if isinstance(v, list) and k in ("models", "bits", "layers", "tasks") else v
                      for k, v in _current_keys(settings).items()})


def _current_keys(settings: dict) -> dict:
    """Recorded settings with today's keys: ``task`` (one task, as sweeps recorded it before ``tasks``) -> ``tasks``."""
    d = dict(settings)
    if "task" in d:
        d.setdefault("tasks", [d.pop("task")])
    return d


def cell_settings(model: str, weights_sha: str, spec: QuantSpec, s: SweepSettings, items_sha: str, dtype: str,
                  device: str = "cpu", task: str = "hellaswag") -> dict:
    """A cell's identity: what its numbers depend on. ``dtype`` and ``device`` are the loaded model's; the
    device type enters only when it is not the CPU (so CPU cells keep their ids). The attention block size
    does not enter: blocked and unblocked attention give the same numbers. A quantized cell's batch size does when it
    is not the default 32 (cells at 32 keep their ids): its per-item scores depend on it by float32 rounding
    (:mod:`outlierscope.eval.scorer`); an unquantized cell's differ by ~1e-5 nats at most and keep their ids."""
    ident = spec.is_identity
    out = {"model": model, "weights_sha256": weights_sha, "bits": spec.bits, "format": None if ident else spec.format,
           "granularity": None if ident else spec.granularity, "layers": list(spec.layers) if spec.layers else None,
           "weights": s.weights, "dtype": dtype, "items_sha256": items_sha, "text": s.text,
           "text_tokens": s.text_tokens if s.text else None}
    kind = device.split(":")[0]
    if kind != "cpu":
        out["device"] = kind
    if task != "hellaswag":  # HellaSwag cells keep the ids they had before tasks existed
        out["task"] = task
    if s.attn_error and not ident:  # cells without it keep their ids
        out["attn_error"] = True
    if not ident and s.batch_size != DEFAULT_BATCH:  # float32 rounding that depends on the batch's shape can cross a
        out["batch_size"] = s.batch_size  # quantizer's rounding boundary; cells at the default keep their ids
    if not spec.is_logits_only:  # its text is its identity (the paper's logits cells keep theirs)
        out["quant"] = str(spec)
    return {**out, **revised(spec)}


def _load_or_run_cell(lm, items, spec: QuantSpec, s: SweepSettings, text_seqs, settings: dict, cells_dir: Path,
                      progress: bool, log, shard: Shard, world: World) -> tuple[EvalResult | None, str]:
    """A sweep cell through the shared cache (:func:`~outlierscope.runs.cells.cached_cell`). With ``attn_error`` in
    the settings, ``cells/<cell>.attn_error.csv`` (per layer and head) is written with the cell and put in
    ``res.extra["attn_error_table"]``."""
    task = settings.get("task", "hellaswag")
    label = cell_label(spec, {"quantization_config": lm.quantization_config()})
    desc = f"{settings['model']} {task} {label}" if len(s.tasks) > 1 or task != "hellaswag" else \
        f"{settings['model']} {label}"
    measure = bool(settings.get("attn_error"))
    in_attention = measure and (spec.is_logits_only or spec.has_attention)
    in_linears = measure and spec.has_linear
    tables = ("attn_error",) * in_attention + ("linear_error",) * in_linears

    def compute():
        from outlierscope.analysis.linear_error import LinearErrorStats
        from outlierscope.quant.linears.sites import linear_sites

        n_layers = lm.model.config.num_hidden_layers
        stats = AttentionErrorStats(n_layers) if in_attention else None
        sites = linear_sites(lm.model, spec) if in_linears else []  # the LM head, when named: layer n_layers
        lin = LinearErrorStats(max(site.layer for site in sites) + 1, list(dict.fromkeys(site.path for site in sites))) \
            if sites else None
        res = evaluate(lm, quant=spec.with_weights(s.weights), items=items, text_seqs=text_seqs,
                       batch_size=s.batch_size, progress=progress, desc=desc, block_rows=s.attn_block, shard=shard, world=world, task=task, attn_error=stats,
                       linear_error=lin, calibration_dir=str(cells_dir.parent / "calibration"))
        # a --shard part keeps the raw numbers of its virtual shards, which merge exactly (merge_sweep)
        whole = shard is None or shard.whole
        side = {name: st.table() if whole else st.shard_table() for name, st in (("attn_error", stats),
                                                                                  ("linear_error", lin)) if st is not None}
        return res, (side or None)

    return cached_cell(cells_dir, settings, compute, desc, log, tables, shard, world)


def cell_metrics(res: EvalResult, base: EvalResult | None, seed: int, metrics=("acc", "acc_norm")) -> dict:
    """The cell's ``metrics`` (the task's: lm-eval's acc-only tasks have no acc_norm), flat, with stderr, and
    against ``base`` each metric's change."""
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
    """A cell's label in tables and on the console: the spec's, except the 16-bit cell of a checkpoint saved quantized
    (``source``: its :meth:`~outlierscope.models.loading.LoadedModel.provenance`, or the run record's entry), which
    is no emulation on top of that checkpoint's own quantization, not an unquantized model."""
    saved = (source or {}).get("quantization_config")
    if spec.is_identity and saved:
        return f"16 (no emulation; saved {saved.get('quant_method', 'quantized')})"
    return spec.label


def _tidy_rows(model: str, task: str, spec: QuantSpec, label: str, s: SweepSettings, metrics: dict, info: dict,
               cid: str) -> list[dict]:
    """One row per metric (value, stderr, change vs 16 bits with its interval and McNemar p); ``info``: the
    task's :func:`task_record` (its items and chance level go in every row: the table stands alone)."""
    rows = []
    for m, v in metrics.items():
        if m.endswith(("_stderr", "_ci_low", "_ci_high", "_mcnemar_p", "_delta")):
            continue
        rows.append({"model": model, "task": task, "bits": spec.bits, "label": label, "format": spec.format,
                     "granularity": "none" if spec.is_identity else spec.granularity, "weights": s.weights,
                     "metric": m, "value": v, "stderr": metrics.get(f"{m}_stderr"),
                     "delta_vs_16": metrics.get(f"{m}_delta"), "ci_low": metrics.get(f"{m}_ci_low"),
                     "ci_high": metrics.get(f"{m}_ci_high"), "mcnemar_p": metrics.get(f"{m}_mcnemar_p"),
                     "n_items": info["n_items"], "chance": info["chance"], "cell": cid})
    return rows


@dataclass
class SweepResult:
    """A finished sweep: the tidy table (one row per model, task, bit width and metric) and the run record."""

    table: pd.DataFrame
    record: dict
    out: Path

    def markdown(self) -> str:
        """One row per model and bit width: acc, acc_norm (stderr), change vs 16 bits with CI, McNemar p, flips."""
        return sweep_table(self.table)

    def save(self, out: str | Path) -> Path:
        write_csv(Path(out) / "sweep.csv", self.table)
        write_record(Path(out) / "sweep.json", self.record)
        return Path(out)


def check_previous(out: Path, settings: dict, force: bool, shard: Shard | None = None) -> None:
    """Refuse to replace the sweep.csv (or shard record) of a sweep with other settings unless ``force``. A
    setting that an older sweep.json lacks counts as equal when it has its default value now."""
    prev = out / ("sweep.json" if shard is None or shard.whole else f"sweep.{shard.tag}.json")
    refuse_other_settings(prev, json.loads(json.dumps(settings)), json.loads(json.dumps(asdict(SweepSettings()))),
                          "a sweep", force, _current_keys)


def task_record(task: str, items: list) -> dict:
    """What a sweep records per task: display name, metrics, items, their digest and the chance level (%)."""
    return {"label": task_label(task), "metrics": list(task_metrics(task)), "n_items": len(items),
            "items_sha256": items_digest(items), "chance": chance_percent(items)}


def _tabulate(s: SweepSettings, cells: list[tuple[str, str, QuantSpec, str, EvalResult]], tasks: dict, out: Path,
              **record_extra) -> SweepResult:
    """The sweep's tables from its cells (model, task, spec, cell id, result), each (model, task)'s 16-bit cell
    first. ``tasks``: :func:`task_record` per task. A one-task sweep also keeps ``n_items``, ``items_sha256``
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
    result = SweepResult(pd.DataFrame(rows, columns=SWEEP_COLUMNS), record, out)
    result.save(out)
    if errors:  # per model, task, bit width, layer and head: what quantization did to attention
        t = pd.concat(errors, ignore_index=True)
        write_csv(out / "attn_error.csv", t[["model", "task", "bits", "label"] + [c for c in t.columns
                                                                                if c not in ("model", "task", "bits", "label")]])
    if lin_errors:  # per model, task, scheme, layer and linear: each quantized linear's relative output error
        t = pd.concat(lin_errors, ignore_index=True)
        write_csv(out / "linear_error.csv", t[["model", "task", "label", "layer", "linear", "tokens", "rel_err_mean",
                                               "rel_err_max"]])
    gold = gold_ll_table(cells, s.seed)
    if len(gold):
        write_csv(out / "gold_ll.csv", gold)
    return result


GOLD_COLUMNS = ["model", "task", "label", "n_items", "delta_gold_ll", "ci_low", "ci_high", "minus_first_model",
                "minus_first_ci_low", "minus_first_ci_high"]


def gold_ll_table(cells: list[tuple[str, str, QuantSpec, str, EvalResult]], seed: int) -> pd.DataFrame:
    """Per quantized cell: the mean change of the gold choice's log-likelihood against its model's unquantized cell
    (nats; < 0 hurts) with its 95% paired bootstrap interval, a measure that moves where accuracy sits at chance;
    and that change minus the first model's change of the same task and setting, paired by item (the pair: Diff
    minus Transformer; < 0: this model is hurt more), NaN for the first model."""
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


def check_models(s: SweepSettings, records: dict | None = None) -> dict:
    """Every model of ``s`` found, a causal LM, with the layers ``s`` quantizes: before the first cell runs. GGUF
    files' specs are checked against their metadata first, before any conversion (minutes each). Returns each
    model's :class:`~outlierscope.models.record.ModelRecord` (``records``: those the caller made already)."""
    for m in s.models:  # every GGUF file first: a conversion takes minutes
        if (config := preview_config(m)) is not None:
            check_specs(m, s.specs(), config)
    records = {m: (records or {}).get(m) or inspect_model(m, s.trust_remote_code) for m in s.models}
    for m, record in records.items():
        check_specs(m, s.specs(), record.config)
    return records


def check_specs(model: str, specs, config) -> None:
    """Each spec fits ``config`` (its layers exist, its groups and blocks divide the shapes), or one line naming the
    model."""
    for spec in specs:
        try:
            check_layers(spec, num_layers(config))
            check_spec(spec, config)
        except OutlierscopeError as e:
            raise OutlierscopeError(f"{model}: {e}") from None


def _cell_entry(cid: str, model: str, task: str, spec) -> dict:
    """A cell as the records list it: an attention spec with its text (``quant``), a logits spec by its bits."""
    return {"cell": cid, "model": model, "task": task, "bits": spec.bits,
            **({"quant": str(spec)} if not spec.is_logits_only else {})}


def _bits_order(s: SweepSettings) -> list[int]:
    return sorted(set(s.bits) | {UNQUANTIZED_BITS}, key=lambda b: -b)  # the 16-bit reference first


def sweep(s: SweepSettings, out: str | Path, progress: bool = True, log=print, force: bool = False,
          shard: Shard | None = None, world: World | None = None, records: dict | None = None) -> SweepResult | None:
    """Run (or resume) a sweep into ``out``; returns the tidy result table (also written as sweep.csv). ``records``:
    model -> its :func:`~outlierscope.models.record.inspect_model`, where the caller made it already.

    Data parallel (:mod:`outlierscope.parallel`): under ``torchrun`` pass ``world=World.from_env()``: every rank
    scores its share of each cell, rank 0 writes the cells and tables and gets the result (the others None).
    A partial ``shard`` writes its part of each cell (``cells/<cell>.shard-i-of-N.*``) and
    ``sweep.shard-i-of-N.json`` and returns None; :func:`merge_sweep` combines the shards. The numbers do not
    depend on the split."""
    from outlierscope.data.text import pack_sequences, text_documents
    from outlierscope.models.loading import load_model, resolve_seq_len

    shard, world = shard or Shard(), world or World()
    out = Path(out)
    if s.kld_text is not None and not shard.whole:
        raise OutlierscopeError("kld_text with a --shard of a sweep is not built; run the sweep's text cells whole, or "
                                "`outlierscope perplexity --shard` on each model")
    git_commit()  # the checkout as the run found it (read once per process): before any table is written
    error = None
    if world.is_main:
        try:
            check_previous(out, asdict(s), force, shard)
        except OutlierscopeError as e:
            error = str(e)
    world.agree(error)
    records = check_models(s, records)
    if s.kld_text is not None:
        _check_text_cells(s, records)
    items = s.task_items()
    tasks = {t: task_record(t, items[t]) for t in s.tasks}
    cells, sources, calibs = [], {}, {}
    log = log if world.is_main else (lambda *a, **k: None)
    with output_dir(out) if world.is_main else contextlib.nullcontext(out), \
            output_dir(out / "cells") if world.is_main else contextlib.nullcontext(out / "cells") as cells_dir:
        for spec_str in s.models:
            lm = load_model(spec_str, dtype=s.dtype, device=world.device(s.device), device_map=s.device_map,
                            trust_remote_code=s.trust_remote_code, record=records[spec_str])
            wsha = lm.weights_sha256()
            sources[spec_str] = lm.provenance(wsha)  # as given, resolved commit / GGUF details, weights digest
            if cal := calibration_records(s.specs(), lm.model, lm.tokenizer):  # each calibrated spec's text, tokens
                calibs[spec_str] = cal
            text_seqs = None
            if s.text:
                text_seqs = pack_sequences(lm.tokenizer, text_documents(s.text), resolve_seq_len(lm.model, None), s.text_tokens)
            for t in s.tasks:
                for spec in s.specs():
                    settings = cell_settings(spec_str, wsha, spec, s, tasks[t]["items_sha256"], lm.dtype, lm.device, t)
                    res, cid = _load_or_run_cell(lm, items[t], spec, s, text_seqs, settings, cells_dir, progress, log,
                                                 shard, world)
                    cells.append((spec_str, t, spec, cid, res))
        del lm  # the text cells load each model again: one copy at a time
    extra = {"text_metrics": _text_metrics(s, out, log, world, records)} if s.kld_text is not None else {}
    extra |= {"calibration": calibs} if calibs else {}
    if not world.is_main:
        return None
    if not shard.whole:
        write_record(out / f"sweep.{shard.tag}.json", {
            "settings": asdict(s), "shard": [shard.index, shard.count], "processes": world.size, "tasks": tasks,
            "cells": [_cell_entry(cid, m, t, spec) for m, t, spec, cid, _ in cells],
            "model_sources": sources, **({"calibration": calibs} if calibs else {}),
            "versions": versions(), "machine": machine(), "git_commit": git_commit()})
        log(f"shard {shard.index}/{shard.count} written to {out}; combine all {shard.count} with `outlierscope merge`")
        return None
    return _tabulate(s, cells, tasks, out, model_sources=sources, processes=world.size, **extra)


def _text_dir(model: str) -> str:
    """A model's directory under ``text/``: its spec with every character but letters, digits, ``-``, ``.`` as ``_``."""
    import re

    return "text/" + re.sub(r"[^A-Za-z0-9.-]", "_", model)


def _check_text_cells(s: SweepSettings, records: dict) -> None:
    """Before any item cell: the text of ``kld_text`` read and cut into windows with each model's tokenizer (an
    unreadable file or a text too short for one window is an error now, not after every item cell ran)."""
    from outlierscope.runs.perplexity import prepare_windows

    for m in s.models:
        prepare_windows(s.kld_settings(m), records[m])


def _text_metrics(s: SweepSettings, out: Path, log, world: World, records: dict) -> dict:
    """Each model's perplexity run of every cell on ``kld_text`` (:meth:`SweepSettings.kld_settings`, resumable) in
    ``out/text/<model>``, and ``text.csv``: their tables with a model column. Returns model -> its directory."""
    from outlierscope.runs.perplexity import perplexity

    tables, dirs = [], {}
    for m in s.models:
        dirs[m] = _text_dir(m)
        table = perplexity(s.kld_settings(m), out / dirs[m], log=log, world=world, force=True,  # the sweep's: checked
                           record=records[m])
        if table is not None:
            tables.append(table.assign(model=m))
    if world.is_main:
        t = pd.concat(tables, ignore_index=True)
        write_csv(out / "text.csv", t[["model"] + [c for c in t.columns if c != "model"]])
    return dirs


def tabulate_sweep(run_dir: str | Path, out: str | Path) -> SweepResult:
    """The tables of a finished sweep, computed again from its record (``sweep.json``) and per-item cells into ``out``:
    the same ``sweep.csv``, ``attn_error.csv``, ``linear_error.csv`` and ``gold_ll.csv`` as the run wrote (tested on
    the committed docs/). No model runs."""
    run_dir = Path(run_dir)
    rec = read_record(run_dir / "sweep.json", ("settings", "cells"), "sweep record")
    s = SweepSettings.from_record(rec["settings"])
    tasks = rec.get("tasks") or {s.tasks[0]: {k: rec[k] for k in ("n_items", "items_sha256")} | {
        "label": task_label(s.tasks[0]), "metrics": list(task_metrics(s.tasks[0])), "chance": rec.get("chance", 25.0)}}
    cells = []
    for c in rec["cells"]:
        res = EvalResult.load(run_dir / "cells", c["cell"])
        if res is None:
            raise OutlierscopeError(f"{run_dir / 'cells'}: cell {c['cell']} is missing or incomplete; run the sweep again")
        for key in ("attn_error", "linear_error"):  # the cell's side tables, as load_cell reads them
            if (side := run_dir / "cells" / f"{c['cell']}.{key}.csv").exists():
                res.extra[f"{key}_table"] = pd.read_csv(side, float_precision="round_trip")
        cells.append((c["model"], c.get("task", s.tasks[0]), s.spec_of(c), c["cell"], res))
    out = Path(out)
    with output_dir(out):
        return _tabulate(s, cells, tasks, out, **{k: rec[k] for k in ("model_sources", "processes", "merged_shards",
                                                                      "calibration") if k in rec})


def merge_sweep(dirs: list[str | Path], out: str | Path | None = None, log=print) -> SweepResult:
    """Combine the shards of a sweep run with ``shard=Shard(i, N)`` (``--shard i/N``) for i = 0..N-1, found
    in ``dirs``, into whole cells and tables in ``out`` (default: the first directory): the same files as
    one process would write. Every part is read before anything is written: a missing or damaged part writes
    nothing."""
    dirs = [Path(d) for d in dirs]
    files = find_shards(dirs, "sweep", ".json", "sweep")
    n = len(files)
    recs = [(f.parent, read_record(f, ("settings", "cells", "tasks"), "sweep shard record")) for f in files]
    first = recs[0][1]
    for _, r in recs[1:]:
        if r["settings"] != first["settings"] or r["cells"] != first["cells"] or r["tasks"] != first["tasks"]:
            raise OutlierscopeError("the shards were run with different settings; merge only the shards of one sweep")
    s = SweepSettings.from_record(first["settings"])
    out = Path(out) if out is not None else dirs[0]
    # every part read and merged before anything is written
    merged = [(c, *merged_cell(c["cell"], [d for d, _ in recs], f"{c['model']} {c['bits']} bits")) for c in first["cells"]]
    cells = []
    with output_dir(out), output_dir(out / "cells") as cells_dir:
        for c, res, tables in merged:
            res.save_cell(cells_dir, c["cell"], res.extra["cell"], tables)
            cells.append((c["model"], c["task"], s.spec_of(c), c["cell"], res))
    log(f"merged {n} shards of {len(cells)} cells into {out}")
    calib = {"calibration": first["calibration"]} if "calibration" in first else {}
    return _tabulate(s, cells, first["tasks"], out, model_sources=first.get("model_sources", {}), merged_shards=n,
                     **calib)
