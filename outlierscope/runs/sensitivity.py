"""Per-layer sensitivity of a model to quantized attention (the logits, or a recipe), and a mixed-precision suggestion.

    base       = evaluate(model)                                  # unquantized
    only[i]    = evaluate(model, quant=spec with layers=(i,))     # one layer quantized
    all_but[i] = evaluate(model, quant=spec with every layer but i)
    damage[i]  = mean over items of (gold log-likelihood of only[i] - of base)   # nats, < 0 hurts
    rank layers by damage (most harmful first); keep[k] = the k most harmful layers unquantized
    greedy: the fewest k with change(keep[k]) >= -tolerance, by bisection over k (the found one verifies it):
            a loss bound (a gain of any size passes; a loss of more than ``tolerance`` nats fails)
            (kept layers unquantized, or at ``keep_bits`` bits: a mixed 4/8-bit assignment)

With ``metric`` kld (or ppl) the same steps run on running text instead of items: damage[i] = - the mean KL
divergence of only[i] to the unquantized model at every scored token (or - ln(PPL(only[i]) / PPL(base))), and the
greedy's bound is a mean KLD (ln PPL ratio) of at most ``tolerance``; each cell is a perplexity cell
(:mod:`outlierscope.runs.perplexity`: per-token values, resumable per virtual shard), and the specs of one pass
share the unquantized trunk and head of every batch.

Each evaluation is a resumable cell of the cache sweep uses (:mod:`outlierscope.runs.cells`: ``cells/<cell id>``,
reused when its settings match; ``sensitivity.json`` maps each role, ``base``, ``only_3``, ``keep_0_1``, ..., to its
cell). With
``attn_error`` the unquantized cell also measures, for every layer, what ``spec`` does to that layer's
attention (KL, top-key changes, output error; :mod:`outlierscope.analysis.attention_error`) without
applying it: each layer's input is then the unquantized one, exactly what its one-layer cell quantizes,
so one measured forward gives every one-layer cell's own attention error. All cells, the unquantized one
too, score the same sequences (the layout of ``spec``: with a per_tensor scale, one per context and
choice). The layer's outlier statistic (top-1 / median |logit| from a short profile) is put beside its
damage, with the Spearman rank correlation, to ask whether outliers predict where quantization hurts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from outlierscope.analysis.attention_error import (
    AttentionErrorStats,
    measured_spec,
    pool_heads,
)
from outlierscope.analysis.harm import RANK_BY, TEXT_METRICS, RankBy, rank_by_of
from outlierscope.errors import OutlierscopeError, ParamError, check_seed
from outlierscope.eval.evaluate import EvalResult, evaluate, items_digest, layout_for, select_items
from outlierscope.hooks.points import attention_layers, decoder_layers
from outlierscope.io import (
    git_commit,
    machine,
    output_dir,
    read_record,
    versions,
    write_csv,
    write_record,
    write_text,
)
from outlierscope.models.loading import (
    attn_block_option,
    check_placement,
    device_map_option,
    device_option,
    dtype_option,
    trust_remote_code_option,
)
from outlierscope.parallel import Shard, World, find_shards
from outlierscope.quant.apply import check_spec, quantize_model
from outlierscope.quant.numerics.names import FORMATS, GRANULARITIES, UNQUANTIZED_BITS
from outlierscope.quant.specs.spec import QuantSpec, build_spec
from outlierscope.quant.weights.calibration import calibrate_layers_alone, calibration_records
from outlierscope.runs.cells import DEFAULT_BATCH, cached_cell, cell_id, merged_cell, refuse_other_settings, revised
from outlierscope.runs.perplexity import (
    TEXT_FIELDS,
    check_text_fields,
    length_option,
    max_windows_option,
    protocol_option,
    text_batch_size_option,
    text_option,
)
from outlierscope.settings import check_defaults, option

ITEM_FIELDS = ("task", "limit", "sample", "batch_size")  # what only the gold_ll metric reads


@dataclass(frozen=True)
class SensitivitySettings:
    """Settings of a per-layer sensitivity study (``outlierscope sensitivity``): one model, one spec quantized layer
    by layer, ranked by a metric, with a greedy mixed-precision suggestion. Each field is a CLI flag of the same name
    (its help is the field's ``option`` text) and is written to the study's record."""

    model: str = option(MISSING, "Hub id (ORG/NAME[@REVISION]), HF model directory, .gguf file, preset role or fetched model", metavar="SPEC")
    bits: int = option(4, "bit width of the quantized layers")
    format: str = option("int", "int absmax or FP8 (bits 8)", choices=FORMATS)
    granularity: str = option("per_tensor", "one scale per sequence and layer / per head / per query row",
                              choices=GRANULARITIES)
    quant: str | None = option(None, "a recipe or spec of attention or linear layers (see `outlierscope recipes`) "
                               "instead of --bits, --format, --granularity: each layer in turn gets it",
                               metavar="RECIPE_OR_SPEC")
    task: str = option("hellaswag", "hellaswag or a zero-shot task (see `outlierscope tasks`)", metavar="TASK")
    limit: int | None = option(None, "first N validation items", exclusive="items")
    sample: int | None = option(None, "N items drawn at random (with --seed)", exclusive="items")
    seed: int = option(0, "seeds --sample")
    metric: str = option("gold_ll", "rank layers and bound the suggestion by gold_ll (the task's items: mean change of "
                         "the gold choice's log-likelihood), kld (running text: mean KL divergence to the unquantized "
                         "model at every token) or ppl (running text: ln of the PPL ratio)", choices=tuple(RANK_BY))
    text: str = text_option()
    protocol: str = protocol_option()
    length: int | None = length_option()
    max_windows: int | None = max_windows_option()
    text_batch_size: int = text_batch_size_option()
    tolerance: float = option(0.05, "largest harm the suggested assignment may have, in the metric's unit: nats of mean "
                              "gold log-likelihood lost (gold_ll), nats of mean KLD (kld), ln PPL ratio (ppl); a gain "
                              "always passes")
    keep_bits: int = option(16, "bits of the layers the suggestion keeps (16: unquantized; e.g. 8 for a 4/8-bit mix)")
    all_but: bool = option(True, "skip the second pass (every layer quantized but one)")
    attn_error: bool = option(True, "skip each layer's attention error (measured in the unquantized cell: costs 2-5x "
                              "one cell)")
    kinds: bool = option(True, "skip the pass over linear kinds (a linear spec: each kind, q_proj ... down_proj, "
                         "quantized alone in every layer)")
    profile_tokens: int = option(20_000, "tokens of the short profile for the per-layer outlier statistic")
    batch_size: int = option(DEFAULT_BATCH, "sequences per forward; quantized scores depend on it by float32 rounding (part of a "
                             "quantized cell's identity); 1 is exactly batch-invariant, ~2x slower")
    dtype: str = dtype_option()
    device: str = device_option()
    device_map: str | None = device_map_option()
    attn_block: int | None = attn_block_option()
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self):
        check_seed(self.seed)
        from outlierscope.data.tasks import check_task

        check_task(self.task)
        if self.quant is not None:
            self._check_quant()
        spec = self.spec()  # bits, format, granularity (or the attention spec) checked before anything loads
        if self.attn_error and self.metric == "gold_ll":
            measured_spec(spec)
        if spec.bits == 16:
            raise ParamError("bits", "below 16 (16 is unquantized: nothing to be sensitive to)", self.bits)
        self.spec(bits=self.keep_bits)
        if not spec.bits < self.keep_bits:
            raise ParamError("keep_bits", f"above bits={spec.bits} (16 = kept layers unquantized)", self.keep_bits)
        self._check_metric_fields()
        if not self.tolerance >= 0:
            raise ParamError("tolerance", f">= 0 ({RANK_BY[self.metric].unit})", self.tolerance)
        for n in ("limit", "sample"):
            if getattr(self, n) is not None and getattr(self, n) < 1:
                raise ParamError(n, ">= 1", getattr(self, n))
        if self.profile_tokens < 1:
            raise ParamError("profile_tokens", ">= 1", self.profile_tokens)
        check_placement(self.device, self.dtype, self.device_map, self.attn_block)

    def _check_metric_fields(self) -> None:
        """The item settings only with gold_ll, the text settings only with kld / ppl, whose cells keep no layers at
        other bits."""
        if self.metric not in RANK_BY:
            raise ParamError("metric", f"one of {', '.join(RANK_BY)}", self.metric)
        check_text_fields(self)
        scores = "items of a task" if self.metric == "gold_ll" else "running text"
        check_defaults(self, TEXT_FIELDS if self.metric == "gold_ll" else ITEM_FIELDS,
                       f"with metric={self.metric!r} (it scores {scores})")
        if self.metric in TEXT_METRICS and self.keep_bits != UNQUANTIZED_BITS:
            raise ParamError("keep_bits", f"16 with metric={self.metric!r} (a kept layer at other bits is not built "
                             "for the text metrics)", self.keep_bits)

    def _check_quant(self) -> None:
        """``quant`` replaces bits, format and granularity, quantizes something, and names no layers (each layer in
        turn gets it)."""
        spec = QuantSpec.parse(self.quant)
        if spec.is_identity:
            raise ParamError("quant", "a recipe or spec that quantizes something (see `outlierscope recipes`)",
                             self.quant, "'none' leaves every layer as it is")
        if spec.layers is not None:
            raise ParamError("quant", "a spec that names no layers (each layer in turn gets it)", self.quant)
        if spec.weights_mode != "none":
            raise ParamError("quant", "a spec without bitsandbytes weights (w=bnb-...: they replace every layer's "
                             "linears at once, so no layer can be ranked; rank w=int8/per_channel or "
                             "w=fint4/per_group:128 instead)", self.quant)
        if not spec.parts:
            raise ParamError("quant", "a spec with a quantized part (e.g. 'k=int4/per_token; smooth_k'): smoothing and "
                             "rotations alone are exact, nothing to be sensitive to", self.quant)
        if spec.linears is not None and "lm_head" in spec.linears:
            raise ParamError("quant", "linears inside the decoder layers: sensitivity ranks layers, and the LM head is "
                             "in none (evaluate it with sweep --quant '...; linears:lm_head')", self.quant)
        for name in ("bits", "format", "granularity"):
            default = next(f.default for f in dataclasses.fields(self) if f.name == name)
            if getattr(self, name) != default:
                raise ParamError(name, f"its default {default!r} with quant (quant replaces bits, format and "
                                 "granularity; keep_bits stays the logits' axis)", getattr(self, name))

    def spec(self, layers=None, bits: int | None = None) -> QuantSpec:
        """The quantization of ``layers`` (None: all): :attr:`quant` when given, else the logits at ``bits`` (default:
        :attr:`bits`; ``keep_bits`` for the kept layers are always the logits')."""
        if self.quant is not None and bits is None:
            return dataclasses.replace(QuantSpec.parse(self.quant), layers=tuple(layers) if layers is not None else None)
        return build_spec(self.bits if bits is None else bits, self.format, self.granularity, layers)


def gold_scores(res: EvalResult) -> np.ndarray:
    """Each item's log-likelihood of its gold choice (N,)."""
    return res.gold_loglik()


def change(res: EvalResult, base: EvalResult, metric: str) -> dict:
    """Against ``base``: mean gold log-likelihood change (nats), the headline metric's change and flip rate."""
    col = "pred_norm" if metric == "acc_norm" else "pred"
    return {"delta_gold_ll": float((gold_scores(res) - gold_scores(base)).mean()),
            f"delta_{metric}": float(res.metrics[metric] - base.metrics[metric]),
            "flip_rate": float((res.items[col].to_numpy() != base.items[col].to_numpy()).mean())}


TEXT_CHANGE = ("kld_mean", "kld_ci_low", "kld_ci_high", "kld_p99.9", "ln_ppl_ratio", "delta_nll_ci_low",
               "delta_nll_ci_high", "same_top")


def text_change(tokens, seed: int) -> dict:
    """A text cell's change against the unquantized model: mean KLD (95% interval over windows) and its 99.9%
    point, ln PPL ratio (= the mean NLL change, with its interval), same top token."""
    from outlierscope.analysis.kld import summary

    stats = summary(tokens, seed)
    return {k: stats[k] for k in TEXT_CHANGE}


def greedy_keep(order: list[int], layers: list[int], within) -> tuple[list[int], list[dict]]:
    """The fewest of the most harmful layers (``order``, most harmful first) to keep at higher precision such
    that ``within(quantized_layers)`` returns ``(True, record)`` (``layers``: all the candidates, i.e. the
    attention layers): keeping k = 0 and k = n_layers are tried
    first, then a bisection over k (about log2(n_layers) evaluations, not n_layers: 7 for an 80-layer
    model), which finds the fewest k when keeping more harmful layers never hurts. Returns (kept layers,
    the records of every try, sorted by k; the one of the kept layers is the verification). When even
    keeping every layer is not within (kept layers at 8 bits can miss), every layer is returned and its
    record says ``within_tolerance`` False."""
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


@dataclass
class _Run:
    """What every step of a sensitivity run needs: the model, items, settings and the cell cache."""

    s: SensitivitySettings
    lm: object
    items: list
    metric: str  # the task's headline metric
    layers: list[int]  # the attention layers (a hybrid model's others have nothing to quantize)
    ident: dict  # what every cell's numbers depend on besides its quantization
    cells_dir: Path
    progress: bool
    log: object
    cells: dict  # role (base, only_3, keep_0_1, ...) -> cell id, recorded in sensitivity.json
    shard: Shard = field(default_factory=Shard)  # a --shard run computes its share of the per-layer cells
    world: World = field(default_factory=World)  # the processes of torchrun: every cell split over them
    rank_by: RankBy = RANK_BY["gold_ll"]
    text: dict | None = None  # the text metrics': windows, the cells' identity, how cells run, the text's record
    base: EvalResult | None = None  # the unquantized cell (gold_ll; the text cells hold their base per token)

    def changes(self, cells: list[tuple[str, QuantSpec | None, QuantSpec | None]]) -> list[dict] | None:
        """Each (role, spec, keep)'s change against the unquantized model (:func:`change`, or :func:`text_change` of
        its text cell; the text cells of one call share each batch's unquantized trunk). None where this process
        computed only its parts (a partial --shard run)."""
        if not self.rank_by.on_text:
            res = [(self.cell(role, spec, keep), role) for role, spec, keep in cells]
            return [change(r, self.base, self.metric) for r, _ in res] if self.shard.whole else None
        from outlierscope.runs.perplexity import cell_settings as text_cell_settings
        from outlierscope.runs.perplexity import token_cells

        specs = [spec or QuantSpec() for _, spec, _ in cells]
        settings = [text_cell_settings(self.text["ident"], spec, self.s.text_batch_size) for spec in specs]
        self.cells.update({role: cell_id(st) for (role, _, _), st in zip(cells, settings)})
        tokens = token_cells(self.lm, self.text["windows"], specs, settings, self.text["cells"], kind="text ")
        out = [text_change(t, self.s.seed) for t in tokens] if tokens is not None else None
        return self.world.broadcast(out)  # every rank takes the same next step (the greedy's bisection)

    def cell(self, role: str, spec: QuantSpec | None, keep: QuantSpec | None = None,
             measure: QuantSpec | None = None) -> EvalResult:
        """Evaluate with ``spec`` (None: unquantized) and ``keep`` (the other layers at keep_bits), through the cell
        cache that sweep uses; with ``measure`` also the attention error of ``measure`` (not applied), per layer and
        head in ``extra["attn_error_table"]``."""
        s = self.s
        settings = cell_settings(self.ident, spec, keep, measure, s.batch_size)

        def compute():
            stats = AttentionErrorStats(len(decoder_layers(self.lm.model))) if measure else None
            with quantize_model(self.lm.model, keep, s.attn_block) if keep else contextlib.nullcontext():
                res = evaluate(self.lm, quant=spec, items=self.items, batch_size=s.batch_size, progress=self.progress,
                               desc=role, block_rows=s.attn_block, task=s.task, layout=self.ident["layout"],
                               shard=self.shard, world=self.world, attn_error=stats, attn_error_spec=measure,
                               calibration_dir=str(self.cells_dir.parent / "calibration"))
            table = None if not measure else stats.table() if self.shard.whole else stats.shard_table()
            return res, ({"attn_error": table} if measure else None)

        res, self.cells[role] = cached_cell(self.cells_dir, settings, compute, role, self.log,
                                            ("attn_error",) if measure else (), self.shard, self.world)
        return self.world.broadcast(res)  # every rank takes the same next step (the greedy's bisection)


def cell_settings(ident: dict, spec: QuantSpec | None, keep: QuantSpec | None, measure: QuantSpec | None,
                  batch_size: int) -> dict:
    """A sensitivity cell's identity: ``ident`` (model, weights, task, items, dtype, layout) and the quantization:
    ``spec`` (None: unquantized) with its layers, ``keep`` (the kept layers' logits), the spec whose attention error
    is ``measure``d, and the batch size of a quantized cell when it is not the default."""
    settings = {**ident, "bits": spec.bits if spec else UNQUANTIZED_BITS,
                "quant": spec.description if spec else "16",  # the paper's logits in words, any other spec its text
                "layers": list(spec.layers) if spec and spec.layers else None,
                "keep": {"quant": keep.label, "layers": list(keep.layers)} if keep else None,
                "attn_error": measure.label if measure else False, **revised(spec, keep)}
    if (spec or keep) and batch_size != DEFAULT_BATCH:  # a quantized cell's scores depend on its batch size by
        settings["batch_size"] = batch_size  # float32 rounding; cells at the default keep their ids
    return settings


def sensitivity(s: SensitivitySettings, out: str | Path, progress: bool = True, log=print, force: bool = False,
                shard: Shard | None = None, world: World | None = None) -> dict | None:
    """Run (or resume) the layer sensitivity of ``s.model`` into ``out``: ``sensitivity.csv`` (per layer),
    ``greedy.csv`` (each tried assignment), ``attn_error.csv`` (per layer and head), ``sensitivity.json``
    (settings, ranking, suggestion, rank correlation, the cell of each evaluation), ``sensitivity.md`` (all of it
    as tables) and ``figures/``. A directory that holds a run with other settings is refused unless ``force``.
    Returns the record (None on the ranks other than 0).

    ``world`` (torchrun): every cell, the greedy's tries too, is split over the processes as a sweep's cells are, and
    rank 0 writes. A partial ``shard`` (``--shard i/N``, no communication) computes its share of the unquantized and
    per-layer cells and writes ``sensitivity.shard-i-of-N.json``; ``outlierscope merge`` combines the shards' cells,
    and a run without ``shard`` then reads them and runs the greedy's few tries. Any split gives the same bytes."""
    out = Path(out)
    shard, world = shard or Shard(), world or World()
    main = world.is_main
    if main:
        check_previous(out, s, force, shard)
    if RANK_BY[s.metric].on_text and not shard.whole:
        raise OutlierscopeError(f"shard: whole with metric={s.metric!r} (its text cells split over torchrun's "
                                "processes, not over --shard runs)")
    with output_dir(out) if main else contextlib.nullcontext(), output_dir(out / "cells") if main else \
            contextlib.nullcontext():
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
            _write(out, record, table, tries, kinds)
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
    """Combine the cells of the ``--shard i/N`` runs of one sensitivity study (``sensitivity.shard-i-of-N.json`` in
    ``dirs``) into whole cells in ``out`` (default: the first directory), the files one process writes; then the
    same command without ``--shard`` reads them and runs the greedy's tries. Every part is read before anything is
    written."""
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
    """Refuse to replace the tables (or shard record) of a sensitivity run with other settings in ``out`` unless
    ``force`` (its cells with matching settings are reused either way). A setting an older record lacks counts as its
    default."""
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

    text, _, length, windows = prepare_windows(s, record)
    return {"text": text, "length": length, "windows": windows}


def _text_cells(s: SensitivitySettings, lm, text: dict, cells_dir: Path, world: World, log) -> dict:
    """What every text cell shares (the perplexity cells' identity) and how they run."""
    from outlierscope.runs.perplexity import CellRun, text_ident, windows_said

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


def written_files(s: SensitivitySettings, record: dict) -> list[str]:
    """The files a finished study wrote into its directory, in the order a reader wants them: ``kinds.csv`` only for a
    scheme with linear parts (``record["kinds"]``), ``attn_error.csv`` only where attention was measured."""
    return ["sensitivity.md", "sensitivity.csv", "greedy.csv", *(["kinds.csv"] if "kinds" in record else []),
            *(["attn_error.csv"] if s.attn_error and s.metric == "gold_ll" and _in_attention(s.spec()) else []),
            "sensitivity.json", "figures/"]


def _in_attention(spec) -> bool:
    """Whether ``spec`` changes anything inside attention (a linear-only spec has no attention error to measure)."""
    return spec.is_logits_only or spec.has_attention


def _per_kind(run: _Run) -> pd.DataFrame | None:
    """Per linear kind (its path in a decoder layer: ``self_attn.q_proj`` ... ``mlp.down_proj``): the change with only
    that kind quantized, in every layer. None unless the spec quantizes linear layers (and ``kinds``)."""
    import dataclasses as dc

    from outlierscope.quant.linears.sites import linear_sites

    spec = run.s.spec()
    if not run.s.kinds or not spec.has_linear:
        return None
    paths = list(dict.fromkeys(site.path for site in linear_sites(run.lm.model, spec)))
    res = run.changes([(f"kind_{path}", dc.replace(spec, linears=(path,)), None) for path in paths])
    return pd.DataFrame([{"linear": path, **(res[n] if res else {})} for n, path in enumerate(paths)])


def _with_attention_error(table: pd.DataFrame, base: EvalResult, out: Path | None) -> pd.DataFrame:
    """Each layer's attention error, measured in the unquantized cell (attn_error.csv per head, pooled per layer;
    written into ``out`` unless None)."""
    heads = base.extra["attn_error_table"]
    if out is not None:
        write_csv(out / "attn_error.csv", heads)
    return table.merge(pool_heads(heads).drop(columns=["rows"]), on="layer", how="left")


def outlier_points(spec, model) -> tuple[str, ...]:
    """The points whose top-1 / median |x| is a layer's outlier ratio: the attention logits when the spec quantizes
    attention (or is the logits' bit width), the inputs of the decoder linears it quantizes when it has linear
    parts (both for a mixed spec)."""
    from outlierscope.quant.linears.sites import linear_sites

    linear = getattr(spec, "has_linear", False)
    points = ["layers.*.attn.logits"] if not linear or spec.has_attention else []
    if linear:
        paths = sorted({site.path for site in linear_sites(model, spec) if not site.is_head})
        points += [f"layers.*.{p}.input" for p in paths]
    return tuple(points)


def _with_outlier_ratio(run: _Run, table: pd.DataFrame) -> pd.DataFrame:
    """Each layer's outlier ratio (the largest top-1 / median |x| over its :func:`outlier_points`, from a short
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


def _record(run: _Run, table: pd.DataFrame, order: list[int], keep: list[int], tries: list[dict]) -> dict:
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


def _ranking_stability(run: _Run) -> list[dict]:
    """How many windows the per-layer ranking needs (:func:`~outlierscope.analysis.agreement.ranking_stability` of
    the one-layer text cells' per-window harm: KLD sums, or NLL change sums for ppl)."""
    from outlierscope.analysis.agreement import ranking_stability
    from outlierscope.analysis.kld import window_blocks
    from outlierscope.runs.perplexity import read_cell

    sums = []
    for i in run.layers:
        count, d, k = window_blocks(read_cell(run.cells_dir, run.cells[f"only_{i}"]))
        sums.append(k if run.rank_by.name == "kld" else d)
    return ranking_stability(count, np.stack(sums, 1), run.s.seed)  # (windows, layers)


def _write(out: Path, record: dict, table: pd.DataFrame, tries: list[dict], kinds: pd.DataFrame | None = None) -> None:
    from outlierscope.report.sensitivity import sensitivity_markdown

    write_csv(out / "sensitivity.csv", table)
    if kinds is not None:
        write_csv(out / "kinds.csv", kinds)
    write_csv(out / "greedy.csv", pd.DataFrame(tries))
    write_record(out / "sensitivity.json", record)
    write_text(out / "sensitivity.md", sensitivity_markdown(record, table, tries, kinds))
    _figures(table, out, record)


def _log_summary(run: _Run, record: dict) -> None:
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
