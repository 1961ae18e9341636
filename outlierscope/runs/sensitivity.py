"""Per-layer sensitivity of a model to quantized attention (the logits, or a recipe), and a mixed-precision suggestion.

    base       = evaluate(model)                                  # unquantized
    only[i]    = evaluate(model, quant=spec with layers=(i,))     # one layer quantized
    all_but[i] = evaluate(model, quant=spec with every layer but i)
    damage[i]  = mean over items of (gold log-likelihood of only[i] - of base)   # nats, < 0 hurts
    rank layers by damage (most harmful first); keep[k] = the k most harmful layers unquantized
    greedy: the fewest k with change(keep[k]) >= -tolerance, by bisection over k (the found one verifies it):
            a loss bound (a gain of any size passes; a loss of more than ``tolerance`` nats fails)
            (kept layers unquantized, or at ``keep_bits`` bits: a mixed 4/8-bit assignment)

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from outlierscope.analysis.attention_error import (
    pool_heads,
)
from outlierscope.analysis.harm import RANK_BY, RankBy
from outlierscope.errors import OutlierscopeError, warnings_to
from outlierscope.eval.evaluate import EvalResult, items_digest, layout_for, select_items
from outlierscope.hooks.points import attention_layers, decoder_layers
from outlierscope.io import (
    git_commit,
    machine,
    output_dir,
    read_record,
    versions,
    write_csv,
    write_record,
)
from outlierscope.parallel import Shard, World, find_shards
from outlierscope.quant.apply import check_spec
from outlierscope.quant.numerics.fused import fused_kernels
from outlierscope.quant.numerics.names import UNQUANTIZED_BITS
from outlierscope.quant.specs.transforms import Linears
from outlierscope.quant.weights.calibration import calibrate_layers_alone
from outlierscope.runs.cells import merged_cell, refuse_other_settings
from outlierscope.runs.sensitivity_cells import _Run, change
from outlierscope.runs.sensitivity_record import (
    _in_attention,
    _log_summary,
    _record,
    _write,
    outlier_points,
)
from outlierscope.runs.sensitivity_settings import SensitivitySettings


def greedy_keep(order: list[int], layers: list[int], within) -> tuple[list[int], list[dict]]:
    """The fewest of the most harmful layers to keep at higher precision so that the rest stays within the bound.

    k = 0 and k = all are tried first, then a bisection over k (about log2(n) evaluations: 7 for an 80-layer model),
    which finds the fewest when keeping more harmful layers never hurts. When even keeping every layer is not within
    (kept layers at 8 bits can miss), every layer is returned and its record says ``within_tolerance`` False.

    Args:
        order: the layers, most harmful first.
        layers: every candidate (the attention layers).
        within: ``within(quantized_layers)`` -> ``(bool, record)``.

    Returns:
        ``(kept layers, the records of every try, by k)``; the kept layers' is the verification."""
    tries, n_layers = {}, len(layers)

    def ok(k: int) -> bool:
        keep = sorted(order[:k])
        good, rec = within([i for i in layers if i not in keep])
        tries[k] = {"kept": k, "kept_layers": " ".join(map(str, keep)), **rec, "within_tolerance": good}
        return good

    if ok(0):
        hi = 0
    elif not ok(n_layers):
        hi = n_layers
    else:
        lo, hi = 0, n_layers  # not within at lo, within at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return sorted(order[:hi]), [tries[k] for k in sorted(tries)]


def sensitivity(s: SensitivitySettings, out: str | Path, progress: bool = True, log=print, force: bool = False,
                shard: Shard | None = None, world: World | None = None) -> dict | None:
    """Run (or resume) a layer sensitivity study of ``s.model`` into ``out``: which layers a spec harms most.

    Writes ``sensitivity.csv`` (per layer), ``greedy.csv`` (each tried assignment), ``attn_error.csv`` (per layer and
    head), ``sensitivity.md``, ``figures/`` and the sealed ``sensitivity.json`` (settings, ranking, suggestion, rank
    correlation, each evaluation's cell). Any split over processes or ``--shard`` jobs gives the same bytes.

    Args:
        s: the study's settings.
        out: the output directory.
        progress: show progress bars.
        log: where progress lines go.
        force: replace a run with other settings in ``out``.
        shard: compute only this share of the unquantized and per-layer cells and write
            ``sensitivity.shard-i-of-N.json`` (``outlierscope merge`` joins them; a whole run then finishes).
        world: the ``torchrun`` processes; every cell, the greedy's tries too, is split over them and rank 0 writes.

    Returns:
        The record; None for a partial ``shard`` and on ranks other than 0."""
    out = Path(out)
    shard, world = shard or Shard(), world or World()
    main = world.is_main
    if main:
        check_previous(out, s, force, shard)
    if RANK_BY[s.metric].on_text and not shard.whole:
        raise OutlierscopeError(f"shard: whole with metric={s.metric!r} (its text cells split over torchrun's "
                                "processes, not over --shard runs)")
    with output_dir(out) if main else contextlib.nullcontext(), output_dir(out / "cells") if main else \
            contextlib.nullcontext(), fused_kernels(s.fused), warnings_to(log if main else (lambda *a, **k: None)):
        run = _prepare(s, out / "cells", progress, log, shard, world)
        run.base = _base_cell(run)
        _calibrate_alone(run)
        table = _per_layer(run)
        kinds = _per_kind(run)
        if not shard.whole:
            return _write_shard(run, out) if main else None
        if run.base is not None and "attn_error_table" in run.base.extra:
            table = _with_attention_error(table, run.base, out if main else None)
        table = _with_outlier_ratio(run, table)
        order = _by_harm(table, run.rank_by, "only_", "layer")["layer"].tolist()  # most harmful first
        keep, tries = greedy_keep(order, run.layers, _within(run))
        record = _record(run, table, order, keep, tries)
        if kinds is not None:
            record["kinds"] = _by_harm(kinds, run.rank_by, "", "linear")["linear"].tolist()  # most harmful first
        if main:
            _write(out, run.s, record, table, tries, kinds)
    if main:
        _log_summary(run, record)
    return record if main else None


def _base_cell(run: _Run) -> EvalResult | None:
    """The unquantized cell of the gold_ll metric, with each layer's attention error of the spec measured (not
    applied) when asked; the text metrics have none (each text cell holds the unquantized values per token)."""
    s = run.s
    if run.rank_by.on_text:
        return None
    return run.cell("base", None, measure=s.spec() if s.attn_error and _in_attention(s.spec()) else None)


def _by_harm(table: pd.DataFrame, rank_by: RankBy, prefix: str, key: str) -> pd.DataFrame:
    """``table`` sorted most harmful first by its ``prefix + rank_by.column`` (ties: by ``key``)."""
    harm = rank_by.harm(table[prefix + rank_by.column])
    return table.assign(_harm=harm).sort_values(["_harm", key], ascending=[False, True]).drop(columns="_harm")


def _write_shard(run: _Run, out: Path) -> None:
    """A --shard run's record: its settings and the cells whose parts it computed (for ``outlierscope merge``)."""
    rec = {"settings": asdict(run.s), "shard": [run.shard.index, run.shard.count], "cells": run.cells,
           "n_layers": len(decoder_layers(run.lm.model)), "versions": versions(), "machine": machine(),
           "git_commit": git_commit()}
    write_record(out / f"sensitivity.{run.shard.tag}.json", rec)
    run.log(f"shard {run.shard.index}/{run.shard.count}: its parts of {len(run.cells)} cells in {out / 'cells'}; "
            f"when every shard is done: `outlierscope merge DIR...`, then the same sensitivity command without "
            "--shard (it reads the merged cells and runs the greedy's tries)")
    return None


def merge_sensitivity(dirs: list[str | Path], out: str | Path | None = None, log=print) -> Path:
    """Combine the cells of the ``--shard i/N`` runs of one sensitivity study into whole cells: one process's files.

    The same command without ``--shard`` then reads them and runs the greedy's tries. Every part is read before
    anything is written.

    Args:
        dirs: the directories holding the shards.
        out: where the cells go; None: the first directory.
        log: where progress lines go.

    Returns:
        The directory."""
    dirs = [Path(d) for d in dirs]
    files = find_shards(dirs, "sensitivity", ".json", "sensitivity")
    recs = [(f.parent, read_record(f, ("settings", "cells"), "sensitivity shard record")) for f in files]
    first = recs[0][1]
    if any(r["settings"] != first["settings"] or r["cells"] != first["cells"] for _, r in recs[1:]):
        raise OutlierscopeError("the shards were run with different settings; merge only the shards of one "
                                "sensitivity study")
    merged = [(cid, *merged_cell(cid, [d for d, _ in recs], role)) for role, cid in first["cells"].items()]
    out = Path(out) if out is not None else dirs[0]
    with output_dir(out), output_dir(out / "cells") as cells_dir:
        for cid, res, tables in merged:
            res.save_cell(cells_dir, cid, res.extra["cell"], tables)
    log(f"merged {len(recs)} shards of {len(merged)} sensitivity cells into {out / 'cells'}; now run the same "
        f"`outlierscope sensitivity` command with --out {out} and without --shard (ranking, greedy tries, tables)")
    return out


def check_previous(out: Path, s: SensitivitySettings, force: bool, shard: Shard | None = None) -> None:
    """Refuse to replace the tables (or shard record) of a sensitivity run with other settings, unless forced.

    Cells with matching settings are reused either way; a setting an older record lacks counts as its default.

    Args:
        out: the output directory.
        s: this run's settings.
        force: replace them.
        shard: a partial shard (its own record); None: the whole run."""
    import json

    prev = out / ("sensitivity.json" if shard is None or shard.whole else f"sensitivity.{shard.tag}.json")
    defaults, now = (json.loads(json.dumps(asdict(x))) for x in (SensitivitySettings(model=s.model), s))
    refuse_other_settings(prev, now, defaults, "a sensitivity run", force)


def _prepare(s: SensitivitySettings, cells_dir: Path, progress: bool, log, shard: Shard, world: World) -> _Run:
    """Load the model and the items (gold_ll) or the text's windows (kld, ppl; checked before the weights load);
    the identity every cell shares."""
    from outlierscope.data.tasks import task_metrics
    from outlierscope.models.loading import inspect_model, load_model, preview_config
    from outlierscope.report.tables import headline_metric

    if (config := preview_config(s.model)) is not None:  # a GGUF file's metadata: before its conversion
        check_spec(s.spec(), config)
    record = inspect_model(s.model, s.trust_remote_code)  # config and tokenizer: read once, handed on
    check_spec(s.spec(), record.config)  # the spec fits the model's shape: before it loads
    rank_by = RANK_BY[s.metric]
    text = _text_windows(s, record) if rank_by.on_text else None
    lm = load_model(s.model, dtype=s.dtype, device=world.device(s.device), device_map=s.device_map,
                    trust_remote_code=s.trust_remote_code, record=record)
    say = log if world.is_main else (lambda *_: None)
    if text is not None:
        return _Run(s, lm, [], s.metric, attention_layers(lm.model), {}, cells_dir, progress and world.is_main, say,
                    {}, shard, world, rank_by, _text_cells(s, lm, text, cells_dir, world, say))
    items = select_items(s.limit, s.sample, s.seed, None, s.task)
    layout = layout_for(s.spec())  # every cell's, the unquantized one's too: sequences as the quantized ones see them
    ident = {"model": s.model, "weights_sha256": lm.weights_sha256(), "task": s.task, "items_sha256": items_digest(items),
             "dtype": lm.dtype, "layout": layout}
    return _Run(s, lm, items, headline_metric(task_metrics(s.task)), attention_layers(lm.model), ident, cells_dir,
                progress and world.is_main, say, {}, shard, world)


def _text_windows(s: SensitivitySettings, record) -> dict:
    """The text metrics' text, window length and windows (the tokenizer alone decides them)."""
    from outlierscope.runs.perplexity import prepare_windows

    text, length, windows = prepare_windows(s, record)
    return {"text": text, "length": length, "windows": windows}


def _text_cells(s: SensitivitySettings, lm, text: dict, cells_dir: Path, world: World, log) -> dict:
    """What every text cell shares (the perplexity cells' identity) and how they run."""
    from outlierscope.runs.perplexity import text_ident, windows_said
    from outlierscope.runs.text_cells import CellRun

    windows = text["windows"]
    log(windows_said(s, text["text"], text["length"], windows))
    return {**text, "ident": text_ident(s, lm, text["text"], text["length"], windows),
            "cells": CellRun(cells_dir, s.text_batch_size, s.attn_block, s.seed, Shard(), world, log)}


def _calibrate_alone(run: _Run) -> None:
    """GPTQ / AWQ: every ``only_i`` cell's calibration (layer i on the float layers' outputs) in one pass before the
    cells, which then find theirs saved: L layer passes instead of L^2 / 2 (the ``all_but_i`` cells and the kinds
    each calibrate every layer: a pass each)."""
    calibrate_layers_alone(run.lm.model, run.lm.tokenizer, run.s.spec(), run.layers,
                           run.cells_dir.parent / "calibration", progress=run.progress)


def _per_layer(run: _Run) -> pd.DataFrame:
    """Per attention layer: the change with only that layer quantized, and (``all_but``) with all the others. One
    call for every cell (in the order only_0, all_but_0, only_1, ...): the text cells share each batch's unquantized
    trunk."""
    s = run.s
    rest = s.all_but and len(run.layers) > 1
    cells = []
    for i in run.layers:
        cells.append((f"only_{i}", s.spec([i]), None))
        if rest:
            cells.append((f"all_but_{i}", s.spec([j for j in run.layers if j != i]), None))
    got = run.changes(cells)
    step, rows = 2 if rest else 1, []
    for n, i in enumerate(run.layers):
        row = {"layer": i}
        if got is not None:
            row.update({f"only_{k}": v for k, v in got[step * n].items()})
            row.update({f"all_but_{k}": v for k, v in got[step * n + 1].items()} if rest else {})
        rows.append(row)
    return pd.DataFrame(rows)


def _per_kind(run: _Run) -> pd.DataFrame | None:
    """Per linear kind (its path in a decoder layer: ``self_attn.q_proj`` ... ``mlp.down_proj``): the change with only
    that kind quantized, in every layer. None unless the spec quantizes linear layers (and ``kinds``)."""

    from outlierscope.quant.linears.sites import linear_sites

    spec = run.s.spec()
    if not run.s.kinds or not spec.has_linear:
        return None
    paths = list(dict.fromkeys(site.path for site in linear_sites(run.lm.model, spec)))
    res = run.changes([(f"kind_{path}", spec.with_part(Linears((path,))), None) for path in paths])
    return pd.DataFrame([{"linear": path, **(res[n] if res else {})} for n, path in enumerate(paths)])


def _with_attention_error(table: pd.DataFrame, base: EvalResult, out: Path | None) -> pd.DataFrame:
    """Each layer's attention error, measured in the unquantized cell (attn_error.csv per head, pooled per layer;
    written into ``out`` unless None)."""
    heads = base.extra["attn_error_table"]
    if out is not None:
        write_csv(out / "attn_error.csv", heads)
    return table.merge(pool_heads(heads).drop(columns=["rows"]), on="layer", how="left")


def _with_outlier_ratio(run: _Run, table: pd.DataFrame) -> pd.DataFrame:
    """Each layer's outlier ratio (the largest top-1 / median |x| over its ``outlier_points``, from a short
    profile), and the rank of its harm (1 = most harmful)."""
    from outlierscope.runs.profile import ProfileSettings, profile_model

    points = outlier_points(run.s.spec(), run.lm.model)
    prof = profile_model(run.lm, settings=ProfileSettings(tokens=run.s.profile_tokens, points=points,
                                                          attn_block=run.s.attn_block), progress=run.progress,
                         world=run.world)
    pl = run.world.broadcast(prof.tables["per_layer"] if prof is not None else None)  # rank 0's, on every rank
    pl = pl[pl["point"].isin([p.removeprefix("layers.*.") for p in points])]
    ratio = (pl["top1"] / pl["median"]).groupby(pl["layer"]).max().rename("outlier_ratio").reset_index()
    table = table.merge(ratio, on="layer")
    harm = run.rank_by.harm(table["only_" + run.rank_by.column])
    table["rank"] = (-harm).rank(method="first").astype(int)  # 1 = most harmful
    return table


def _within(run: _Run):
    """The greedy's test of an assignment: quantize ``quantized``, keep the rest (unquantized or at keep_bits)."""
    s = run.s
    tag = "keep" if s.keep_bits == UNQUANTIZED_BITS else f"keep{s.keep_bits}"

    def within(quantized):
        kept = [i for i in run.layers if i not in quantized]
        role = "all" if not kept else f"{tag}_" + "_".join(map(str, kept))
        keep = s.spec(kept, bits=s.keep_bits) if kept and s.keep_bits < UNQUANTIZED_BITS else None
        if not quantized and keep is None and run.base is not None:
            c = change(run.base, run.base, run.metric)
        else:
            c = run.changes([(role, s.spec(quantized) if quantized else None, keep)])[0]
        return run.rank_by.within(c, s.tolerance), c  # a harm bound: a gain is never a failure

    return within


