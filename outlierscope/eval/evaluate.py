"""``evaluate``: zero-shot HellaSwag (and optional held-out LM loss) of a model in memory, under a ``QuantSpec``.

    from outlierscope import evaluate, load_model, QuantSpec
    lm = load_model("pair-tiny:diff")
    res = evaluate(lm, quant=QuantSpec.logits(bits=4), limit=200)
    res.metrics["acc_norm"], res.items.head()      # per-item scores, predictions, token counts
    res.save("runs/diff-4bit")                       # items.csv + eval.json (settings, timing)

Scores follow lm-eval 0.4.13 exactly (see ``outlierscope.eval.requests``); reference numbers on
all 10,042 validation items (``bench/results/eval_vs_lmeval_diff_10042.json``): pair-tiny:diff
unquantized acc 0.260307, acc_norm 0.257518, identical to lm-eval item by item.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from outlierscope.analysis.attention_error import measure_attention_error, measured_spec
from outlierscope.analysis.paired import compare, mean_stderr
from outlierscope.data.hellaswag import load_hellaswag
from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.eval.requests import (
    Request,
    build_requests,
    check_requests,
    items_digest,
    lmeval_max_length,
    predictions,
)
from outlierscope.eval.scorer import LAYOUTS, score_requests
from outlierscope.io import Damaged, check_files, check_seal, file_digests, write_csv, write_record
from outlierscope.models.float64 import float64_model
from outlierscope.models.loading import LoadedModel, check_causal, model_device, model_dtype
from outlierscope.parallel import VIRTUAL_SHARDS, Shard, World, owned_shards, shard_of
from outlierscope.quant.apply import check_spec, quantize_model
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.weights.calibration import calibration_for

METRICS = {"acc": "pred", "acc_norm": "pred_norm"}  # metric -> prediction column


def item_columns(n_choices: int) -> list[str]:
    """The columns of a per-item table: index, label, score and token count per choice, pred, pred_norm.

    Args:
        n_choices: the most choices an item has."""
    return ["index", "label", *[f"score{j}" for j in range(n_choices)], *[f"tokens{j}" for j in range(n_choices)],
            "pred", "pred_norm"]


def layout_for(spec: QuantSpec) -> str:
    """The layout a spec is scored in: ``shared`` only where sharing a context's prefix is exact, else ``separate``.

    Sharing is exact when each attention row depends on its own keys alone (the logits per_row; q/k/v scales and
    smoothing span tokens) and each linear's output at a token on that token alone (per-token, per-group, static and
    MX activations and bitsandbytes' weights; not per-sequence scales or outlier columns).

    Args:
        spec: the spec."""
    core = spec.without_weights()  # bitsandbytes' linears quantize a token's activations alone
    if core.is_identity:
        return "shared"
    if core.is_logits_only:
        return "shared" if core.columns.granularity == "per_row" else "separate"
    from outlierscope.quant.linears.sites import token_local

    return "shared" if not core.has_attention and token_local(core) else "separate"


def select_items(limit: int | None = None, sample: int | None = None, seed: int = 0,
                 data: str | None = None, task: str = "hellaswag") -> list:
    """The validation items to score: all, the first ``limit``, or ``sample`` drawn at random with ``seed``.

    Args:
        limit: the first this many.
        sample: this many drawn at random (kept in order).
        seed: the draw's seed.
        data: a HellaSwag validation file instead of the cached set.
        task: ``hellaswag`` or a zero-shot task of ``outlierscope.data.tasks`` (its rows as ``TaskDoc``)."""
    if limit is not None and sample is not None:
        raise OutlierscopeError("limit and sample exclude each other; pass one")
    if task == "hellaswag":
        items = load_hellaswag(data)
    else:
        from outlierscope.data.tasks import get_task, load_docs

        if data is not None:
            raise ParamError("data", "None for a task other than hellaswag (its rows come from the cache)", data)
        items = load_docs(get_task(task).name)
    return subset_items(items, limit, sample, seed)


def subset_items(items: list, limit: int | None = None, sample: int | None = None, seed: int = 0,
                 at_most: bool = False) -> list:
    """All items, the first ``limit``, or ``sample`` drawn at random with ``seed`` (kept in order).

    Args:
        items: the items.
        limit: the first this many.
        sample: this many drawn at random.
        seed: the draw's seed.
        at_most: a ``limit`` or ``sample`` above ``len(items)`` takes them all (a suite's small tasks) instead of
            raising."""
    if at_most:
        limit, sample = (None if v is None or v >= len(items) else v for v in (limit, sample))
    for name, v in (("limit", limit), ("sample", sample)):
        if v is not None and not 0 < v <= len(items):
            raise ParamError(name, f"in 1..{len(items)} (the items available)", v)
    if limit is not None:
        return items[:limit]
    if sample is not None:
        idx = np.sort(np.random.default_rng(seed).choice(len(items), sample, replace=False))
        return [items[i] for i in idx]
    return items


def lm_loss(model, seqs, batch_size: int) -> float:
    """The mean next-token loss (nats per token) over packed sequences.

    Args:
        model: the model.
        seqs: token ids ``(N, T)``.
        batch_size: sequences per forward."""
    import torch

    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(seqs), batch_size):
            x = seqs[i : i + batch_size].to(model_device(model))  # (B, T)
            with float64_model(model):
                logits = model(input_ids=x, use_cache=False).logits[:, :-1]  # (B, T-1, V)
            logits = logits.float()
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),  # (B*(T-1), V)
                                                       x[:, 1:].reshape(-1), reduction="sum").item()  # (B*(T-1),)
            n += x[:, 1:].numel()
    return total / n


@dataclass
class EvalResult:
    """Per-item results of one evaluation and the exact settings that made them.

    Attributes:
        items: one row per item (``item_columns``: each choice's summed log-likelihood and token count, the acc and
            acc_norm predictions).
        metrics: acc and acc_norm with their standard errors (and ``lm_loss``).
        settings: what produced it (quantization, layout, the items' digest, batch size).
        seconds: the evaluation's wall time.
        extra: side tables (``{key}_table``) and the cell's identity, where a sweep adds them."""

    items: pd.DataFrame
    metrics: dict
    settings: dict
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def correct(self, metric: str) -> np.ndarray:
        """Whether each item's prediction under a metric is its gold choice.

        Args:
            metric: ``acc`` or ``acc_norm``.

        Returns:
            A bool array, one entry per item."""
        return (self.items[METRICS[metric]] == self.items["label"]).to_numpy()

    def gold_loglik(self) -> np.ndarray:
        """Each item's summed log-likelihood of its gold choice (N,)."""
        scores = self.items[self.score_columns].to_numpy()  # (N, choices)
        return scores[np.arange(len(scores)), self.items["label"].to_numpy()]

    def compare(self, base: EvalResult, seed: int = 0) -> dict:
        """The paired change against ``base``, on the same items in the same order.

        Args:
            base: the result to compare with (the unquantized model's, usually).
            seed: the bootstrap's seed.

        Returns:
            Per metric: the delta with its 95% bootstrap interval, McNemar's p and the flip rate; and the mean |change|
            of the per-choice log-likelihoods."""
        if not np.array_equal(self.items["index"].to_numpy(), base.items["index"].to_numpy()):
            raise OutlierscopeError("the two evaluations are not of the same items in the same order; compare like with like")
        out = {}
        for m, col in METRICS.items():
            out[m] = compare(base.correct(m), self.correct(m), base.items[col], self.items[col], seed=seed)
        cols = self.score_columns
        change = np.abs(self.items[cols].to_numpy() - base.items[cols].to_numpy())
        # NaN: choices an item does not have (zero-shot tasks); HellaSwag has none, and a plain mean
        out["mean_abs_score_change"] = float(np.nanmean(change) if np.isnan(change).any() else change.mean())
        return out

    @property
    def score_columns(self) -> list[str]:
        return [c for c in self.items.columns if c.startswith("score")]

    @property
    def is_partial(self) -> bool:
        """A shard's share (NaN scores for the items of other shards): see ``merge_results``."""
        return "shards" in self.extra

    def record(self) -> dict:
        return {"settings": self.settings, "metrics": self.metrics, "seconds": self.seconds, **self.extra}

    def save(self, out: str | Path, name: str = "eval", vouch: tuple[str, ...] = ()) -> Path:
        """Write ``{name}.csv`` (per item), then the sealed ``{name}.json`` (settings, metrics, digests), atomically.

        Args:
            out: the directory.
            name: the files' stem.
            vouch: names of further files in ``out`` whose sha256 the record lists.

        Returns:
            The record's path."""
        out = Path(out)
        write_csv(out / f"{name}.csv", self.items)
        files = file_digests(out, (f"{name}.csv", *vouch))
        write_record(out / f"{name}.json", {**self.record(), "files": files})  # last: marks the result complete
        return out

    def save_cell(self, out: str | Path, name: str, settings: dict, tables: dict | None = None) -> None:
        """Save as a run's cell: the side tables first, then the cell's record, which marks it complete.

        Args:
            out: the cells' directory.
            name: the cell's file stem.
            settings: the cell's identity, stored in its record.
            tables: side tables, key -> DataFrame: written as ``{name}.{key}.csv``, kept in ``extra["{key}_table"]``."""
        self.extra["cell"] = settings
        for key, df in (tables or {}).items():
            write_csv(Path(out) / f"{name}.{key}.csv", df)
        self.save(out, name, tuple(f"{name}.{key}.csv" for key in tables or {}))
        for key, df in (tables or {}).items():
            self.extra[f"{key}_table"] = df

    @classmethod
    def load_cell(cls, out: str | Path, name: str, settings: dict, tables: tuple[str, ...] = ()) -> EvalResult | None:
        """A complete cell saved by ``save_cell`` with exactly these settings and side tables.

        Args:
            out: the cells' directory.
            name: the cell's file stem.
            settings: the identity the cell must have.
            tables: the keys of the side tables to read into ``extra["{key}_table"]``.

        Returns:
            The result; None when there is no such complete cell (the caller computes it).

        Raises:
            Damaged: a cell whose files do not match their digests."""
        res = cls.load(out, name)
        if res is None or res.extra.get("cell") != settings:
            return None
        for key in tables:
            path = Path(out) / f"{name}.{key}.csv"
            if not path.exists():
                return None
            res.extra[f"{key}_table"] = pd.read_csv(path, float_precision="round_trip")
        return res

    @classmethod
    def load(cls, out: str | Path, name: str = "eval") -> EvalResult | None:
        """Read back a result written by ``save``.

        Args:
            out: the directory.
            name: the files' stem.

        Returns:
            The result; None when it is absent (no record: never finished).

        Raises:
            Damaged: a record whose seal, or a file whose digest, does not match."""
        out = Path(out)
        meta_path, items_path = out / f"{name}.json", out / f"{name}.csv"
        if not meta_path.exists():
            return None
        try:
            meta = check_seal(json.loads(meta_path.read_text()), meta_path, required=False)
        except (ValueError, UnicodeDecodeError):
            raise Damaged(f"{meta_path}: not readable JSON (cut or changed)") from None
        if not isinstance(meta, dict):
            raise Damaged(f"{meta_path}: expected a JSON object, got {type(meta).__name__}")
        if not items_path.exists():
            raise Damaged(f"{items_path}: missing (its record {meta_path.name} is there)")
        check_files(out, meta.pop("files", {}))
        try:
            items = pd.read_csv(items_path, float_precision="round_trip")  # exact: merged shards equal one process
        except (ValueError, UnicodeDecodeError, pd.errors.ParserError):
            raise Damaged(f"{items_path}: not a readable table (cut or changed)") from None
        n = meta.get("settings", {}).get("n_items")
        if list(items.columns) != item_columns(sum(c.startswith("score") for c in items.columns)) or \
                n is not None and len(items) != n:  # a truncated or cut file written before digests
            raise Damaged(f"{items_path}: not the table its record describes (cut or changed)")
        extra = {k: v for k, v in meta.items() if k not in ("settings", "metrics", "seconds")}
        return cls(items, meta.get("metrics", {}), meta.get("settings", {}), meta.get("seconds", 0.0), extra)


def model_and_tokenizer(model, tokenizer):
    """The module and tokenizer of what ``evaluate`` was given.

    Args:
        model: a ``LoadedModel``, or a module.
        tokenizer: the module's tokenizer (None: the ``LoadedModel``'s)."""
    if isinstance(model, LoadedModel):
        return model.model, tokenizer or model.tokenizer
    if tokenizer is None:
        raise ParamError("tokenizer", "a tokenizer when model is a bare torch module", None)
    return model, tokenizer


@dataclass(frozen=True)
class EvalOptions:
    """How an evaluation runs; only the batch size can change a score.

    Attributes:
        batch_size: sequences per forward; ``1`` scores each sequence alone, exactly batch-invariant (larger batches
            differ by float32 rounding, which can cross a quantizer's rounding boundary).
        block_rows: query rows per attention block; None: from a 256 MiB budget. The same scores either way.
        layout: ``"separate"`` (one sequence per context and choice) or ``"shared"`` (a context's choices share its
            prefix; exact only where each attention row depends on its own keys); None: ``layout_for(quant)``.
        progress: show a progress bar.
        desc: the progress bar's label; None: the task's name.
        calibration_dir: GPTQ/AWQ: each calibrated layer is saved there and a rerun continues; None: not kept."""

    batch_size: int = 32
    block_rows: int | None = None
    layout: str | None = None
    progress: bool = True
    desc: str | None = None
    calibration_dir: str | None = None

    def __post_init__(self):
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ParamError("batch_size", ">= 1", self.batch_size)
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ParamError("layout", "'separate' or 'shared' (or None: from the quantization)", self.layout)


def eval_options(options: EvalOptions | None, kwargs: dict) -> EvalOptions:
    """The ``EvalOptions`` of an evaluation: the one given, or one made of its fields given as keywords.

    Args:
        options: an ``EvalOptions``, or None.
        kwargs: ``EvalOptions`` fields as keywords (``batch_size=8``); an unknown one is refused with the closest."""
    if options is not None and kwargs:
        raise ParamError("options", "either an EvalOptions or its fields as keywords, not both", sorted(kwargs))
    try:
        return options or EvalOptions(**kwargs)
    except TypeError:
        import dataclasses
        import difflib

        names = [f.name for f in dataclasses.fields(EvalOptions)]
        bad = next(k for k in kwargs if k not in names)
        close = difflib.get_close_matches(bad, names, n=1)
        raise ParamError(bad, f"a keyword of evaluate or of EvalOptions ({', '.join(names)})", kwargs[bad],
                         f"did you mean {close[0]}?" if close else "") from None


def evaluate(model, tokenizer=None, *, quant: QuantSpec | str | None = None, task: str = "hellaswag", items=None,
             limit: int | None = None, sample: int | None = None, seed: int = 0, data: str | None = None,
             text_seqs=None, attn_error=None, attn_error_spec=None, linear_error=None, shard: Shard | None = None,
             world: World | None = None, requests: list[Request] | None = None,
             options: EvalOptions | None = None, **option_kwargs) -> EvalResult | None:
    """Zero-shot accuracy of a model on a task, scored as lm-evaluation-harness 0.4.13 scores it.

    Args:
        model: a ``LoadedModel``, or a causal LM module (with ``tokenizer``).
        tokenizer: the module's tokenizer; None with a ``LoadedModel``.
        quant: a ``QuantSpec``, its text (``"a=int8/per_token; w=int4/per_group:64"``) or a recipe name; None: unquantized.
        task: ``hellaswag`` or a zero-shot task of ``outlierscope.data.tasks``.
        items: the items to score (HellaSwag items or task rows); None: the task's cached validation set.
        limit: score the first ``limit`` items.
        sample: score ``sample`` items drawn with ``seed``.
        seed: the seed of ``sample``.
        data: a HellaSwag validation file to read instead of the cached one.
        text_seqs: (N, T) token ids whose mean LM loss is also reported.
        attn_error: an ``AttentionErrorStats`` that receives, per layer and head, what ``quant`` does to attention.
        attn_error_spec: measure this spec into ``attn_error`` instead of ``quant``, without applying it.
        linear_error: a ``LinearErrorStats`` that receives each quantized linear's relative output error.
        shard: score only this share of the virtual shards (``EvalResult.is_partial``; ``merge_results`` joins parts).
        world: the ``torchrun`` processes; each scores its shards and rank 0 gets the whole result.
        requests: the items' tokenised requests (``build_requests``), checked to be these items' and tokenizer's.
        options: an ``EvalOptions`` (batch size, attention block rows, layout, progress bar).
        **option_kwargs: ``EvalOptions`` fields as keywords (``batch_size=8, progress=False``).

    Returns:
        The ``EvalResult`` (per-item scores and the task's metrics); None on ranks other than 0.

    Raises:
        OutlierscopeError: a model that is not causal, a spec that does not fit it, or a non-finite log-likelihood."""
    model, tokenizer = model_and_tokenizer(model, tokenizer)
    check_causal(model)
    opt = eval_options(options, option_kwargs)
    shard, world = shard or Shard(), world or World()
    spec = QuantSpec.of(quant)
    attn_error_spec = QuantSpec.of(attn_error_spec) if attn_error_spec else None
    for sp in (spec, attn_error_spec):
        check_spec(sp, model.config)  # group sizes, patterns, rotations fit the model: before the first forward
    if attn_error is not None:
        measured_spec(attn_error_spec or spec)  # a spec it cannot measure fails here, before any forward
    layout = checked_layout(spec, opt.layout)
    if items is None:
        items = select_items(limit, sample, seed, data, task)
    max_length = lmeval_max_length(model, tokenizer)
    if requests is None:
        requests = build_requests(items, tokenizer, max_length)
    else:
        check_requests(requests, items, tokenizer, max_length)
    settings = result_settings(model, spec, layout, items, opt, task)
    measure = None if attn_error is None else (attn_error, attn_error_spec or spec)
    calibration = calibration_for(model, tokenizer, spec, opt.calibration_dir)
    part = _score(model, requests, spec, settings, opt, text_seqs, measure, shard, world, opt.desc or task, calibration,
                  linear_error)
    for stats in (attn_error, linear_error):  # each rank measured its virtual shards: rank 0 gets them all
        if world.size > 1 and stats is not None:
            for other in (world.gather(stats) or [])[1:]:
                stats.merge(other)
    return finished(part, shard, world, opt.desc or task)


def finished(part: EvalResult, shard: Shard, world: World, desc: str) -> EvalResult | None:
    """This process's part as the caller's result.

    Args:
        part: the scores of this process's virtual shards.
        shard: a partial shard's result stays partial; a whole one gets predictions and metrics.
        world: with several processes rank 0 gathers and combines every rank's part.
        desc: the task's label, for the metrics.

    Returns:
        The result; None on ranks other than 0."""
    if world.size > 1:
        parts = world.gather(part)
        if not world.is_main:
            return None
        part = _combine(parts)
        part.extra["processes"] = world.size
    if not shard.whole:
        return part
    return _complete(part, desc)


def checked_layout(spec: QuantSpec, layout: str | None) -> str:
    """The layout to score in, refused where the spec does not allow it.

    Args:
        spec: the spec.
        layout: ``separate``, ``shared``, or None: ``layout_for(spec)``."""
    layout = layout or layout_for(spec)
    if layout == "shared" and layout_for(spec) != "shared":
        raise ParamError("layout", f"'separate' or, for {spec.label} logits, {layout_for(spec)!r}", layout)
    return layout


def result_settings(model, spec: QuantSpec, layout: str, items, opt: EvalOptions, task: str) -> dict:
    """What an evaluation's scores depend on, as its result records them.

    Args:
        model: the scored module.
        spec: its spec.
        layout: the layout.
        items: the scored items.
        opt: the options.
        task: the task's name."""
    return {"quant": spec.label, "bits": spec.bits, "format": None if spec.is_identity else spec.columns.format,
            "granularity": None if spec.is_identity else spec.columns.granularity,
            "layers": list(spec.layers) if spec.layers else None, "layout": layout, "n_items": len(items),
            "items_sha256": items_digest(items), "batch_size": opt.batch_size, "dtype": model_dtype(model),
            "device": model_device(model), "attn_block": opt.block_rows, "task": task}


def _score(model, requests, spec: QuantSpec, settings: dict, opt: EvalOptions, text_seqs, measure, shard: Shard,
           world: World, desc: str, calibration=None, linear_error=None) -> EvalResult:
    """This process's part: the scores of its virtual shards (all of them in one process), timed; ``settings``: what
    produced them (the result's record)."""
    from tqdm.auto import tqdm

    own = owned_shards(shard, world)
    whole = shard.whole and world.size == 1
    t0 = time.time()
    if world.size > 1:
        desc = f"{desc} (rank 0 of {world.size}: its share)"
    with world.failing_together(), tqdm(total=len(requests) if whole else None, desc=desc, unit="item",
                                        disable=not opt.progress or not world.is_main or None, dynamic_ncols=True) as bar:
        stats = [st for st in (measure[0] if measure is not None else None, linear_error) if st is not None]

        def on_batch(k: int) -> None:  # the measured rows belong to the batch's virtual shard
            for st in stats:
                st.set_shard(shard_of(k))

        with measure_attention_error(model, measure[1], measure[0], opt.block_rows) if measure is not None \
                else contextlib.nullcontext(), quantize_model(model, spec, opt.block_rows, calibration, linear_error):
            scores = score_requests(model, requests, settings["layout"], opt.batch_size,
                                    lambda done: bar.update(done - bar.n), shards=None if whole else own,
                                    on_batch=on_batch if stats else None)
            # the LM loss is one process's job: the one with virtual shard 0
            loss = lm_loss(model, text_seqs, opt.batch_size) if text_seqs is not None and 0 in own else None
    return partial_result(requests, scores, loss, settings, time.time() - t0, own, settings["layout"])


def partial_result(requests, scores: np.ndarray, loss, settings: dict, wall: float, own, layout: str) -> EvalResult:
    """One process's scores as a partial ``EvalResult`` (predictions and metrics come when the parts are combined).

    Args:
        requests: the scored requests.
        scores: ``(N, choices)`` summed log-likelihoods (NaN for the requests of other shards).
        loss: the LM loss, where this process computed it.
        settings: what produced the scores.
        wall: seconds taken.
        own: the virtual shards this process scored.
        layout: the layout."""
    df = pd.DataFrame({"index": [r.index for r in requests], "label": [r.label for r in requests]})
    for j in range(scores.shape[1]):
        df[f"score{j}"] = scores[:, j]
    for j in range(scores.shape[1]):
        df[f"tokens{j}"] = [len(r.conts[j]) if j < len(r.conts) else 0 for r in requests]  # 0: no such choice
    df["pred"], df["pred_norm"] = -1, -1
    extra = {"layout": layout, "shards": sorted(own), "choice_chars": [list(r.choice_chars) for r in requests]}
    if loss is not None:
        extra["lm_loss"] = loss
    return EvalResult(df, {}, settings, round(wall, 2), extra)


def _combine(parts: list[EvalResult]) -> EvalResult:
    """Parts of one evaluation (disjoint virtual shards) as one: each score comes from the part that computed it."""
    first = parts[0]
    for p in parts[1:]:
        if p.settings != first.settings or not np.array_equal(p.items["index"].to_numpy(), first.items["index"].to_numpy()):
            raise OutlierscopeError("the parts to merge are of different evaluations (settings or items differ); "
                                    "merge only the shards of one run")
    shards = [v for p in parts for v in p.extra["shards"]]
    if len(set(shards)) != len(shards):
        raise OutlierscopeError(f"the parts to merge overlap (virtual shards {sorted(shards)}); each shard once")
    cols = first.score_columns
    stack = np.stack([p.items[cols].to_numpy() for p in parts])  # (P, N, 4)
    done = ~np.isnan(stack)
    scores = np.where(done, stack, 0.0).sum(0)  # one part holds each score: adding zeros is exact
    scores[~done.any(0)] = np.nan
    df = first.items.copy()
    df[cols] = scores
    losses = [p.extra["lm_loss"] for p in parts if "lm_loss" in p.extra]
    extra = {**first.extra, "shards": sorted(shards)}
    extra.pop("lm_loss", None)
    if losses:
        extra["lm_loss"] = losses[0]
    return EvalResult(df, {}, first.settings, round(max(p.seconds for p in parts), 2), extra)


def _complete(part: EvalResult, desc: str) -> EvalResult:
    """A whole evaluation from its combined parts: predictions, metrics; errors for missing or non-finite scores."""
    extra = dict(part.extra)
    shards, chars = extra.pop("shards"), extra.pop("choice_chars")
    missing = sorted(set(range(VIRTUAL_SHARDS)) - set(shards))
    if missing:
        raise OutlierscopeError(f"virtual shards {missing} of {VIRTUAL_SHARDS} are missing; merge every shard of the run")
    df = part.items.copy()
    scores = df[part.score_columns].to_numpy()
    has = df[[c.replace("score", "tokens") for c in part.score_columns]].to_numpy() > 0  # the choices each item has
    bad = np.flatnonzero((has & ~np.isfinite(scores)).any(axis=1))
    if len(bad):
        raise OutlierscopeError(
            f"{desc}: {len(bad)} of {len(df)} items got non-finite log-likelihoods (first: item "
            f"{df['index'].iloc[bad[0]]}); the model outputs NaN or inf: check its weights and dtype"
        )
    df["pred"], df["pred_norm"] = predictions(scores, chars)
    metrics = {}
    for m, col in METRICS.items():
        metrics[m], metrics[f"{m}_stderr"] = mean_stderr(df[col].to_numpy() == df["label"].to_numpy())
    loss = extra.pop("lm_loss", None)
    if loss is not None:
        metrics["lm_loss"] = loss
    extra["items_per_s"] = round(len(df) / max(part.seconds, 1e-9), 2)
    return EvalResult(df, metrics, part.settings, part.seconds, extra)


def merge_results(parts: list[EvalResult], desc: str = "hellaswag") -> EvalResult:
    """Combine the partial results of ``evaluate(..., shard=Shard(i, N))`` for i = 0..N-1 into the whole result.

    Args:
        parts: every shard's result.
        desc: the task's label, for the metrics."""
    if not parts:
        raise ParamError("parts", "at least one partial result", parts)
    return _complete(_combine(parts), desc)
