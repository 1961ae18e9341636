"""Quantization sweep over bit widths (Figure 8): every cell is one ``evaluate`` run.

For each model, task and setting (bits, format, granularity, weights) a cell records the task's
metrics (acc, and acc_norm where lm-eval reports it) with their standard errors, and against the same model at 16 bits (unquantized): the accuracy
difference with a 95% paired bootstrap interval, the exact McNemar p-value, the flip rate (share
of items whose choice changed) and the mean |score change|; optionally the language-model loss
on held-out text. Each cell is written atomically when it finishes; a rerun skips cells whose
settings match and recomputes those whose settings changed. A directory that holds a sweep with
other settings is refused unless ``force=True``. Under ``torchrun``, or split into ``--shard i/N`` runs
merged by ``merge_sweep``, the cells and tables are byte-identical to a single process's.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from outlierscope.analysis.attention_error import AttentionErrorStats
from outlierscope.data.tasks import task_label, task_metrics
from outlierscope.errors import OutlierscopeError, warnings_to
from outlierscope.eval.evaluate import EvalResult, evaluate
from outlierscope.io import git_commit, machine, output_dir, read_record, versions, write_csv, write_record
from outlierscope.models.loading import (
    inspect_model,
    num_layers,
    preview_config,
)
from outlierscope.parallel import Shard, World, find_shards
from outlierscope.quant.apply import check_layers, check_spec
from outlierscope.quant.numerics.fused import fused_kernels
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.weights.calibration import calibration_records
from outlierscope.runs.cells import DEFAULT_BATCH, cached_cell, merged_cell, refuse_other_settings, revised
from outlierscope.runs.sweep_settings import SweepSettings, _current_keys
from outlierscope.runs.sweep_tables import SweepResult, _cell_entry, _tabulate, cell_label, task_record


def cell_settings(model: str, weights_sha: str, spec: QuantSpec, s: SweepSettings, items_sha: str, dtype: str,
                  device: str = "cpu", task: str = "hellaswag") -> dict:
    """A sweep cell's identity: what its numbers depend on.

    The device type enters only off the CPU (CPU cells keep their ids); the attention block size never (blocked and
    unblocked attention give the same numbers); a quantized cell's batch size when it is not the default 32 (its
    scores depend on it by float32 rounding; an unquantized cell's differ by ~1e-5 nats at most and keep their ids).

    Args:
        model: the model's spec.
        weights_sha: its weights' digest.
        spec: the cell's spec.
        s: the sweep's settings.
        items_sha: the items' digest.
        dtype: the loaded model's dtype.
        device: its device.
        task: the task."""
    ident = spec.is_identity
    out = {"model": model, "weights_sha256": weights_sha, "bits": spec.bits, "format": None if ident else spec.columns.format,
           "granularity": None if ident else spec.columns.granularity, "layers": list(spec.layers) if spec.layers else None,
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


def _requests_once(lm, items):
    """A function returning the items' requests (``build_requests``), built at its
    first call (the first cell of a model and task that runs) and shared by the others: tokenising all of HellaSwag
    takes seconds, a cached cell needs none."""
    from functools import cache

    from outlierscope.eval.requests import build_requests, lmeval_max_length

    return cache(lambda: build_requests(items, lm.tokenizer, lmeval_max_length(lm.model, lm.tokenizer)))


def _load_or_run_cell(lm, items, requests, spec: QuantSpec, s: SweepSettings, text_seqs, settings: dict,
                      cells_dir: Path, progress: bool, log, shard: Shard, world: World) -> tuple[EvalResult | None, str]:
    """A sweep cell through the shared cache (``cached_cell``); ``requests()``: the items'
    requests (``_requests_once``). With ``attn_error`` in the settings, ``cells/<cell>.attn_error.csv`` (per layer
    and head) is written with the cell and put in ``res.extra["attn_error_table"]``."""
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
        res = evaluate(lm, quant=spec.with_weights(s.weights), items=items, requests=requests(), text_seqs=text_seqs,
                       batch_size=s.batch_size, progress=progress, desc=desc, block_rows=s.attn_block, shard=shard, world=world, task=task, attn_error=stats,
                       linear_error=lin, calibration_dir=str(cells_dir.parent / "calibration"))
        # a --shard part keeps the raw numbers of its virtual shards, which merge exactly (merge_sweep)
        whole = shard is None or shard.whole
        side = {name: st.table() if whole else st.shard_table() for name, st in (("attn_error", stats),
                                                                                  ("linear_error", lin)) if st is not None}
        return res, (side or None)

    return cached_cell(cells_dir, settings, compute, desc, log, tables, shard, world)


def check_previous(out: Path, settings: dict, force: bool, shard: Shard | None = None) -> None:
    """Refuse to replace the tables (or shard record) of a sweep with other settings in ``out``, unless forced.

    A setting an older record lacks counts as equal when it has its default value now.

    Args:
        out: the output directory.
        settings: this sweep's settings (``asdict``).
        force: replace them.
        shard: a partial shard (its own record); None: the whole run."""
    prev = out / ("sweep.json" if shard is None or shard.whole else f"sweep.{shard.tag}.json")
    refuse_other_settings(prev, json.loads(json.dumps(settings)), json.loads(json.dumps(asdict(SweepSettings()))),
                          "a sweep", force, _current_keys)


def check_models(s: SweepSettings, records: dict | None = None) -> dict:
    """Every model of a sweep found, a causal LM, with the layers it quantizes, before the first cell runs.

    GGUF files' specs are checked against their metadata first, before any conversion (minutes each).

    Args:
        s: the sweep's settings.
        records: model -> its ``inspect_model``, where the caller made it already.

    Returns:
        Each model's ``ModelRecord``."""
    for m in s.models:  # every GGUF file first: a conversion takes minutes
        if (config := preview_config(m)) is not None:
            check_specs(m, s.specs(), config)
    records = {m: (records or {}).get(m) or inspect_model(m, s.trust_remote_code) for m in s.models}
    for m, record in records.items():
        check_specs(m, s.specs(), record.config)
    return records


def check_inputs(s: SweepSettings, records: dict | None = None) -> dict:
    """Every model and file a sweep reads, checked before its first cell.

    The models and specs (``check_models``), the ``text`` packed as each model's cells pack it, the ``kld_text`` cut
    into each model's windows.

    Args:
        s: the sweep's settings.
        records: model -> its ``inspect_model``, where the caller made it already.

    Returns:
        Each model's ``ModelRecord``."""
    records = check_models(s, records)
    if s.text:
        for m in s.models:
            _text_seqs(s, records[m].tokenizer, records[m].config)
    if s.kld_text is not None:
        _check_text_cells(s, records)
    return records


def _text_seqs(s: SweepSettings, tokenizer, config):
    """The sequences of ``s.text`` a model's cells measure their LM loss on (``s.text_tokens`` tokens)."""
    from outlierscope.data.text import pack_sequences, text_documents
    from outlierscope.models.loading import resolve_seq_len

    return pack_sequences(tokenizer, text_documents(s.text), resolve_seq_len(config, None), s.text_tokens)


def check_specs(model: str, specs, config) -> None:
    """Check that each spec fits a model's config (its layers exist, its groups and blocks divide the shapes).

    Args:
        model: the model's spec, named in the error.
        specs: the specs.
        config: its config."""
    for spec in specs:
        try:
            check_layers(spec, num_layers(config))
            check_spec(spec, config)
        except OutlierscopeError as e:
            raise OutlierscopeError(f"{model}: {e}") from None


def sweep(s: SweepSettings, out: str | Path, progress: bool = True, log=print, force: bool = False,
          shard: Shard | None = None, world: World | None = None, records: dict | None = None) -> SweepResult | None:
    """Run (or resume) a sweep into ``out``: one cell per model, spec and task, then the tables and figures.

    Any split over processes or ``--shard`` jobs gives the same numbers (see the GPUs guide).

    Args:
        s: the sweep's settings.
        out: the output directory.
        progress: show progress bars.
        log: where progress lines go.
        force: replace a run with other settings in ``out``.
        shard: score only this share of each cell and write ``sweep.shard-i-of-N.json`` for ``merge_sweep``.
        world: the ``torchrun`` processes (``World.from_env()``); rank 0 writes the cells and tables.
        records: model spec -> its ``inspect_model``, where the caller made it already.

    Returns:
        The ``SweepResult`` (``.table``: one row per model, task, bit width and metric; also ``sweep.csv``); None for
        a partial ``shard`` and on ranks other than 0."""
    from outlierscope.models.loading import load_model

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
            error = e
    world.agree(error)
    records = check_inputs(s, records)
    items = s.task_items()
    tasks = {t: task_record(t, items[t]) for t in s.tasks}
    cells, sources, calibs = [], {}, {}
    log = log if world.is_main else (lambda *a, **k: None)
    with output_dir(out) if world.is_main else contextlib.nullcontext(out), fused_kernels(s.fused), warnings_to(log), \
            output_dir(out / "cells") if world.is_main else contextlib.nullcontext(out / "cells") as cells_dir:
        for spec_str in s.models:
            lm = load_model(spec_str, dtype=s.dtype, device=world.device(s.device), device_map=s.device_map,
                            trust_remote_code=s.trust_remote_code, record=records[spec_str])
            wsha = lm.weights_sha256()
            sources[spec_str] = lm.provenance(wsha)  # as given, resolved commit / GGUF details, weights digest
            if cal := calibration_records(s.specs(), lm.model, lm.tokenizer):  # each calibrated spec's text, tokens
                calibs[spec_str] = cal
            text_seqs = _text_seqs(s, lm.tokenizer, lm.model.config) if s.text else None
            for t in s.tasks:
                requests = _requests_once(lm, items[t])
                for spec in s.specs():
                    settings = cell_settings(spec_str, wsha, spec, s, tasks[t]["items_sha256"], lm.dtype, lm.device, t)
                    res, cid = _load_or_run_cell(lm, items[t], requests, spec, s, text_seqs, settings, cells_dir,
                                                 progress, log, shard, world)
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
    """Each model's perplexity run of every cell on ``kld_text`` (``SweepSettings.kld_settings``, resumable) in
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
    """A finished sweep's tables computed again from its record and per-item cells, no model run.

    The same ``sweep.csv``, ``attn_error.csv``, ``linear_error.csv`` and ``gold_ll.csv`` as the run wrote (tested on
    the committed docs/).

    Args:
        run_dir: the sweep's directory.
        out: where the tables go."""
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
    """Combine the shards of a ``--shard i/N`` sweep into whole cells and tables: the files one process writes.

    Every part is read before anything is written: a missing or damaged part writes nothing.

    Args:
        dirs: the directories holding the shards.
        out: where the whole sweep goes; None: the first directory.
        log: where progress lines go."""
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
