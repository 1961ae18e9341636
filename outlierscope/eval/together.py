"""Item scores of several specs in one pass over the batches, each batch's unquantized trunk shared: a spec that
quantizes only decoder layers >= s (``layers:``; sensitivity's one-layer cells) starts from the unquantized
forward's output of layer s - 1 of the same batch (``outlierscope.hooks.prefix``), as a perplexity run's text
cells do (``outlierscope.eval.perplexity.score_sides``).

    for batch in plan_batches(requests, layout, batch_size):           # the batches every spec alone would run
        with quantize_model(model, QuantSpec()), recording_outputs(model, {s - 1 for s in starts}) as outs:
            model(batch)                            # the unquantized forward, recorded, up to the highest start - 1
        for spec, s in zip(specs, starts):
            with quantize_model(model, spec, held=...), replaying(model, s, outs[s - 1]):
                scores[spec][batch] = score(model(batch))               # layers < s not run again

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

import numpy as np
import torch

from outlierscope.eval.evaluate import (
    EvalOptions,
    EvalResult,
    checked_layout,
    eval_options,
    finished,
    model_and_tokenizer,
    partial_result,
    result_settings,
)
from outlierscope.eval.perplexity import HOLD_BYTES, prefix_start
from outlierscope.eval.requests import Request, build_requests, lmeval_max_length
from outlierscope.eval.scorer import (
    BatchProgress,
    batch_rows,
    empty_scores,
    fill_scores,
    gathered_hidden,
    lm_head,
    plan_batches,
    score_rows,
    unchanged_logits,
)
from outlierscope.hooks.attention import attention_stages
from outlierscope.hooks.prefix import recording_outputs, replaying, stopping_after
from outlierscope.models.loading import check_causal
from outlierscope.parallel import Shard, World, owned_shards
from outlierscope.quant.apply import check_spec, quantize_model
from outlierscope.quant.linears.schemes import HeldWeights
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.weights.calibration import calibration_for


@torch.no_grad()
def score_requests_together(model, requests: Sequence[Request], specs: Sequence[QuantSpec], layout: str,
                            batch_size: int = 32, calibrations: Sequence | None = None, block_rows: int | None = None,
                            shards: Collection[int] | None = None, progress=None,
                            hold_bytes: int = HOLD_BYTES) -> list[np.ndarray]:
    """Per spec, the summed log-probabilities ``score_requests`` gives under it, computed batch by batch for all.

    Args:
        model: the causal LM.
        requests: the items' requests.
        specs: the specs.
        layout: the one layout they all take.
        batch_size: sequences per forward.
        calibrations: each spec's ``calibration_for``; None: none needed.
        block_rows: query rows per attention block.
        shards: compute only the batches of these virtual shards.
        progress: ``progress(n)`` after each batch: the items every spec has scored.
        hold_bytes: the budget for quantized weights kept from batch to batch."""
    calibrations = list(calibrations) if calibrations is not None else [None] * len(specs)
    if len(calibrations) != len(specs):
        raise ValueError(f"calibrations must have one entry per spec ({len(specs)}), got {len(calibrations)}")
    numbered = plan_batches(requests, layout, batch_size, shards)
    starts = [prefix_start(spec) for spec in specs]
    needed = {s - 1 for s in starts if s > 0}
    held = HeldWeights(hold_bytes)
    scores = [empty_scores(requests) for _ in specs]
    done = BatchProgress(requests, numbered, progress)
    for _, batch in numbered:
        rows = batch_rows(requests, batch)
        recorded = _record_trunk(model, rows, needed, block_rows) if needed else {}
        for j, (spec, calibration, start) in enumerate(zip(specs, calibrations, starts)):
            key = (str(spec), id(calibration))
            with quantize_model(model, spec, block_rows, calibration, held=(held, key)), \
                    replaying(model, start, recorded.get(start - 1)), attention_stages(model, unchanged_logits):
                fill_scores(scores[j], batch, score_rows(model, lm_head(model), rows))
        done.batch_done(batch)
    return scores


def _record_trunk(model, rows: list[dict], layers: set[int], block_rows: int | None) -> dict:
    """The unquantized forward of one batch's rows (in the context an unquantized cell scores in) up to the highest
    of ``layers``: each one's output, as ``replaying`` takes it."""
    with quantize_model(model, QuantSpec(), block_rows), recording_outputs(model, layers) as outs, \
            attention_stages(model, unchanged_logits), stopping_after(model, max(layers)):
        gathered_hidden(model, rows)
    return dict(outs)


def evaluate_together(model, tokenizer=None, *, specs: Sequence[QuantSpec | str], items, task: str = "hellaswag",
                      shard: Shard | None = None, world: World | None = None, options: EvalOptions | None = None,
                      **option_kwargs) -> list[EvalResult | None]:
    """``evaluate`` of each spec, computed in one pass; each result is the one ``evaluate`` gives for the spec alone.

    Its ``seconds`` is the pass's wall time shared equally. The specs must take one layout.

    Args:
        model: a ``LoadedModel``, or a causal LM module.
        tokenizer: the module's tokenizer.
        specs: the specs.
        items: the items.
        task: the task.
        shard: as in ``evaluate`` (a partial shard gives partial results).
        world: as in ``evaluate`` (rank 0 gets the results, the other ranks Nones).
        options: an ``EvalOptions``.
        **option_kwargs: its fields as keywords."""
    model, tokenizer = model_and_tokenizer(model, tokenizer)
    check_causal(model)
    opt = eval_options(options, option_kwargs)
    shard, world = shard or Shard(), world or World()
    specs = [QuantSpec.of(spec) for spec in specs]
    for spec in specs:
        check_spec(spec, model.config)  # every spec fits the model before the first forward
    layouts = {checked_layout(spec, opt.layout) for spec in specs}
    if len(layouts) != 1:
        raise ValueError(f"specs must take one layout; got {sorted(layouts)}: evaluate them in groups by layout")
    (layout,) = layouts
    requests = build_requests(items, tokenizer, lmeval_max_length(model, tokenizer))
    calibrations = [calibration_for(model, tokenizer, spec, opt.calibration_dir) for spec in specs]
    parts = _score_together(model, requests, specs, layout, opt, calibrations, shard, world, opt.desc or task)
    results = [partial_result(requests, sc, None, result_settings(model, spec, layout, items, opt, task), wall, own, layout)
               for spec, (sc, wall, own) in zip(specs, parts)]
    return [finished(part, shard, world, opt.desc or task) for part in results]  # one gather per spec, in order


def _score_together(model, requests, specs, layout: str, opt: EvalOptions, calibrations, shard: Shard, world: World,
                    desc: str) -> list[tuple[np.ndarray, float, list[int]]]:
    """This process's share of every spec's scores (its virtual shards), with each spec's share of the wall time."""
    from tqdm.auto import tqdm

    own = owned_shards(shard, world)
    whole = shard.whole and world.size == 1
    t0 = time.time()
    with world.failing_together(), tqdm(total=len(requests) if whole else None, desc=f"{desc} ({len(specs)} together)",
                                        unit="item", disable=not opt.progress or not world.is_main or None,
                                        dynamic_ncols=True) as bar:
        scores = score_requests_together(model, requests, specs, layout, opt.batch_size, calibrations,
                                         opt.block_rows, shards=None if whole else own,
                                         progress=lambda done: bar.update(done - bar.n))
    wall = (time.time() - t0) / max(len(specs), 1)
    return [(sc, wall, own) for sc in scores]
