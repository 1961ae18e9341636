"""A sensitivity study's cells: its state (``_Run``: the model, items, settings, cell cache), how each cell is
named (``cell_settings``) and computed (one by one, the one-layer item cells together from the unquantized
prefix, the text cells per token), and each cell's change against the unquantized one (``change``,
``text_change``). The study's steps are in ``outlierscope.runs.sensitivity``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from outlierscope.analysis.attention_error import AttentionErrorStats
from outlierscope.analysis.harm import RANK_BY, RankBy
from outlierscope.eval.evaluate import EvalResult, evaluate
from outlierscope.hooks.points import decoder_layers
from outlierscope.parallel import Shard, World
from outlierscope.quant.apply import quantize_model
from outlierscope.quant.numerics.names import UNQUANTIZED_BITS
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.runs.cells import DEFAULT_BATCH, cached_cell, cell_id, revised
from outlierscope.runs.sensitivity_settings import SensitivitySettings


def gold_scores(res: EvalResult) -> np.ndarray:
    """Each item's log-likelihood of its gold choice ``(N,)``.

    Args:
        res: the cell's result."""
    return res.gold_loglik()


def change(res: EvalResult, base: EvalResult, metric: str) -> dict:
    """A cell's change against the unquantized one: mean gold log-likelihood change (nats), metric change, flip rate.

    Args:
        res: the cell's result.
        base: the unquantized cell's.
        metric: the headline metric."""
    col = "pred_norm" if metric == "acc_norm" else "pred"
    return {"delta_gold_ll": float((gold_scores(res) - gold_scores(base)).mean()),
            f"delta_{metric}": float(res.metrics[metric] - base.metrics[metric]),
            "flip_rate": float((res.items[col].to_numpy() != base.items[col].to_numpy()).mean())}


TEXT_CHANGE = ("kld_mean", "kld_ci_low", "kld_ci_high", "kld_p99.9", "ln_ppl_ratio", "delta_nll_ci_low",
               "delta_nll_ci_high", "same_top")


def text_change(tokens, seed: int) -> dict:
    """A text cell's change against the unquantized model: mean KLD (with its interval) and 99.9% point, ln PPL ratio.

    Args:
        tokens: the cell's ``TokenScores``.
        seed: the bootstrap's seed."""
    from outlierscope.analysis.kld import summary

    stats = summary(tokens, seed)
    return {k: stats[k] for k in TEXT_CHANGE}


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
        """Each (role, spec, keep)'s change against the unquantized model (``change``, or ``text_change`` of
        its text cell; the text cells of one call share each batch's unquantized trunk). None where this process
        computed only its parts (a partial --shard run)."""
        if not self.rank_by.on_text:
            res = self.item_cells(cells)
            return [change(r, self.base, self.metric) for r in res] if self.shard.whole else None
        from outlierscope.runs.text_cells import cell_settings as text_cell_settings
        from outlierscope.runs.text_cells import token_cells

        specs = [spec or QuantSpec() for _, spec, _ in cells]
        settings = [text_cell_settings(self.text["ident"], spec, self.s.text_batch_size) for spec in specs]
        self.cells.update({role: cell_id(st) for (role, _, _), st in zip(cells, settings)})
        tokens = token_cells(self.lm, self.text["windows"], specs, settings, self.text["cells"], kind="text ")
        out = [text_change(t, self.s.seed) for t in tokens] if tokens is not None else None
        return self.world.broadcast(out)  # every rank takes the same next step (the greedy's bisection)

    def item_cells(self, cells: list[tuple[str, QuantSpec | None, QuantSpec | None]]) -> list[EvalResult]:
        """Each (role, spec, keep)'s item cell: those whose spec changes only layers >= s > 0 (one-layer cells; no
        ``keep``), when there are several, in one pass that shares each batch's unquantized trunk
        (``evaluate_together``: the same results as one by one); the others one by
        one (``cell``)."""
        from outlierscope.eval.perplexity import prefix_start

        joint = [n for n, (_, spec, keep) in enumerate(cells) if keep is None and spec and prefix_start(spec) > 0]
        out: list = [None] * len(cells)
        if len(joint) > 1:
            for n, res in zip(joint, self.cells_together([cells[n][:2] for n in joint])):
                out[n] = res
        return [res if res is not None else self.cell(role, spec, keep)
                for res, (role, spec, keep) in zip(out, cells)]

    def cells_together(self, cells: list[tuple[str, QuantSpec]]) -> list[EvalResult]:
        """The item cells of (role, spec) pairs, the missing ones computed together (``item_cells``)."""
        from outlierscope.eval.together import evaluate_together
        from outlierscope.runs.cells import cached_cells

        s = self.s
        settings = [cell_settings(self.ident, spec, None, None, s.batch_size) for _, spec in cells]

        def compute(missing: list[int]) -> list:
            return evaluate_together(self.lm, specs=[cells[n][1] for n in missing], items=self.items,
                                     batch_size=s.batch_size, progress=self.progress,
                                     desc=f"{cells[missing[0]][0]}..{cells[missing[-1]][0]}",
                                     block_rows=s.attn_block, task=s.task, layout=self.ident["layout"],
                                     shard=self.shard, world=self.world,
                                     calibration_dir=str(self.cells_dir.parent / "calibration"))

        got = cached_cells(self.cells_dir, settings, [role for role, _ in cells], compute, self.log, self.shard,
                           self.world)
        for (role, _), (_, cid) in zip(cells, got):
            self.cells[role] = cid
        return [self.world.broadcast(res) for res, _ in got]  # every rank takes the same next step

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
    """A sensitivity cell's identity: what every cell shares and its quantization.

    Args:
        ident: model, weights, task, items, dtype, layout.
        spec: the spec, with its layers; None: unquantized.
        keep: the kept layers' spec.
        measure: the spec whose attention error is measured.
        batch_size: recorded for a quantized cell when it is not the default."""
    settings = {**ident, "bits": spec.bits if spec else UNQUANTIZED_BITS,
                "quant": spec.description if spec else "16",  # the paper's logits in words, any other spec its text
                "layers": list(spec.layers) if spec and spec.layers else None,
                "keep": {"quant": keep.label, "layers": list(keep.layers)} if keep else None,
                "attn_error": measure.label if measure else False, **revised(spec, keep)}
    if (spec or keep) and batch_size != DEFAULT_BATCH:  # a quantized cell's scores depend on its batch size by
        settings["batch_size"] = batch_size  # float32 rounding; cells at the default keep their ids
    return settings
