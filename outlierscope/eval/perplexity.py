"""Per-token negative log-likelihood and KL divergence to the unquantized model on running text.

For every scored token of the windows (``outlierscope.eval.windows``) and every quantization spec, from both
models' full distributions in the same pass (no stored base, nothing rounded; the unquantized trunk runs once per
batch and is shared by every spec)::

    lq = log_softmax(logits of the quantized model)      lb = log_softmax(logits of the unquantized model)   (V,)
    nll      = -lq[target]                               nll_base = -lb[target]
    kld      = sum_v exp(lb[v]) * (lb[v] - lq[v])        (KL(base || quantized), llama.cpp's direction)
    same_top = argmax lq == argmax lb                    p_diff   = exp(-nll) - exp(-nll_base)

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.eval.scorer import HEAD_ROWS, gathered_hidden, lm_head
from outlierscope.eval.windows import Window
from outlierscope.hooks.prefix import recording_outputs, replaying
from outlierscope.parallel import shard_of
from outlierscope.quant.apply import quantize_model
from outlierscope.quant.linears.schemes import HeldWeights
from outlierscope.quant.specs.spec import QuantSpec

FLOATS = ("nll", "nll_base", "kld", "p_diff")
LOGPROBS = ("float64", "lmeval")  # how a token's NLL is taken from its logits (``_nll``)
HOLD_BYTES = 4 * 2**30  # quantized weights a run keeps from batch to batch (all sides together); beyond: per batch
F64_ROWS = 32  # rows per float64 block of a spec's values: its (F64_ROWS, V) temporaries stay small and in cache


@dataclass
class TokenScores:
    """One spec's values at every scored token, in window order; each array is ``(N,)``.

    Attributes:
        window: the window of each token (int64).
        nll: its negative log-likelihood under the spec.
        nll_base: its negative log-likelihood under the base.
        kld: KL(base || spec) of the next-token distributions.
        same_top: whether both put the same token first (bool).
        p_diff: ``exp(-nll) - exp(-nll_base)``."""

    window: np.ndarray
    nll: np.ndarray
    nll_base: np.ndarray
    kld: np.ndarray
    same_top: np.ndarray
    p_diff: np.ndarray

    def __len__(self) -> int:
        return len(self.window)

    def summary(self, seed: int = 0) -> dict:
        """llama.cpp's statistics of these tokens, and the NLL change and mean KLD with 95% intervals over windows.

        Args:
            seed: the bootstrap's seed.

        Returns:
            PPL, ln PPL ratio, KLD mean and percentiles, same top token and RMS dp, each with its uncertainty
            (``outlierscope.analysis.kld.summary``)."""
        from outlierscope.analysis.kld import summary

        return summary(self, seed)

    def save(self, path: str | Path) -> None:
        """Write the arrays as a compressed ``.npz``.

        Args:
            path: a file name or a binary file."""
        np.savez_compressed(path, **{k: getattr(self, k) for k in ("window", "same_top", *FLOATS)})

    @classmethod
    def load(cls, path) -> TokenScores:
        """What ``save`` wrote.

        Args:
            path: a file name or a binary file."""
        with np.load(path) as z:
            return cls(**{k: z[k] for k in ("window", "same_top", *FLOATS)})

    def to_bytes(self) -> bytes:
        """The bytes ``save`` writes."""
        import io

        buf = io.BytesIO()
        self.save(buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> TokenScores:
        """What ``to_bytes`` returned.

        Args:
            data: the bytes ``save`` writes."""
        import io

        return cls.load(io.BytesIO(data))

    @classmethod
    def concat(cls, parts: Sequence[TokenScores]) -> TokenScores:
        """Parts of disjoint windows joined into one, in window order (a stable sort: tokens keep their order).

        Args:
            parts: the parts, in any order."""
        whole = {k: np.concatenate([getattr(p, k) for p in parts]) for k in ("window", "same_top", *FLOATS)}
        order = np.argsort(whole["window"], kind="stable")
        return cls(**{k: v[order] for k, v in whole.items()})


def token_values(logits_q: torch.Tensor, logits_b: torch.Tensor, targets: torch.Tensor,
                 logprobs: str = "float64") -> dict[str, torch.Tensor]:
    """The per-token values (NLL, base NLL, KLD, same top, p diff) of the quantized and the unquantized logits.

    Args:
        logits_q: the quantized model's logits ``(n, V)``.
        logits_b: the unquantized model's ``(n, V)``.
        targets: each row's target token ``(n,)``.
        logprobs: how each NLL is taken from the logits (``LOGPROBS``)."""
    return _values(logits_q, _base(logits_b, targets, logprobs=logprobs), targets, logprobs)


def _nll(logits: torch.Tensor, targets: torch.Tensor, lp: torch.Tensor, logprobs: str) -> torch.Tensor:
    """Each row's NLL of its target (n,) float64: from ``lp``, the float64 log-probabilities of ``logits`` (n, V), or
    with ``logprobs="lmeval"`` as lm-eval 0.4.13 takes it from a float32 model: a float32 log-softmax (which
    overstates a token's log-likelihood by a few 1e-6 nats), its value held exactly in float64."""
    if logprobs == "float64":
        return -lp.gather(1, targets[:, None])[:, 0]
    if logits.dtype != torch.float32:
        raise OutlierscopeError(f"logprobs='lmeval' is lm-eval's arithmetic of a float32 model; the logits are "
                                f"{str(logits.dtype).removeprefix('torch.')}: load the model in float32")
    return -torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0].double()


def _top(logits: torch.Tensor) -> torch.Tensor:
    """Each row's top token: the first largest logit, which is the first largest log-probability (log-softmax in
    float64 keeps the order of the float32 or bfloat16 logits, and their ties). ``max`` returns the first maximal
    index as ``argmax`` does and reads the narrower logits: a third of float64 ``argmax``'s time on the CPU."""
    return logits.max(dim=-1).indices


def _base(logits_b: torch.Tensor, targets: torch.Tensor, workspaces: dict | None = None,
          logprobs: str = "float64") -> dict[str, torch.Tensor]:
    """What every spec's values need of the base's logits (n, V): its float64 log-probabilities, their probabilities,
    top token and the targets' NLL (computed once per block, shared by every spec). Both float64 arrays are made
    F64_ROWS rows at a time (the probabilities from the block of log-probabilities still in cache), into
    ``_workspace`` of ``workspaces`` when given: a caller that scores block after block reuses one buffer
    instead of two fresh (n, V) allocations per block (for a large vocabulary each one page-faulted anew)."""
    n, v = logits_b.shape
    if workspaces is None:
        workspace = torch.empty((2, n, v), dtype=torch.float64, device=logits_b.device)
    else:
        workspace = _workspace(workspaces, logits_b)
    lb, pb = workspace[0, :n], workspace[1, :n]  # (n, V) each
    for r in range(0, n, F64_ROWS):
        torch.log_softmax(logits_b[r:r + F64_ROWS].double(), dim=-1, out=lb[r:r + F64_ROWS])  # (m, V)
        torch.exp(lb[r:r + F64_ROWS], out=pb[r:r + F64_ROWS])
    return {"lb": lb, "pb": pb, "top": _top(logits_b), "nll": _nll(logits_b, targets, lb, logprobs)}


def _values(logits_q: torch.Tensor, base: dict[str, torch.Tensor], targets: torch.Tensor,
            logprobs: str = "float64") -> dict[str, torch.Tensor]:
    """The per-token values of the quantized model's logits (n, V) against ``_base``'s, in blocks of F64_ROWS
    rows (each row's values do not depend on the block; the float64 temporaries stay small)."""
    parts = [_values_block(logits_q[r:r + F64_ROWS], {k: v[r:r + F64_ROWS] for k, v in base.items()},
                           targets[r:r + F64_ROWS], logprobs) for r in range(0, max(len(targets), 1), F64_ROWS)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _values_block(logits_q: torch.Tensor, base: dict[str, torch.Tensor],
                  targets: torch.Tensor, logprobs: str = "float64") -> dict[str, torch.Tensor]:
    lq = torch.log_softmax(logits_q.double(), dim=-1)  # (m, V)
    nll, nll_base = _nll(logits_q, targets, lq, logprobs), base["nll"]
    diff = base["lb"] - lq
    kld = diff.mul_(base["pb"]).sum(-1)  # sum_v p_b (ln p_b - ln p_q), in place: one (m, V) buffer, not two
    return {"nll": nll, "nll_base": nll_base, "kld": kld, "same_top": _top(logits_q) == base["top"],
            "p_diff": torch.exp(-nll) - torch.exp(-nll_base)}


def _rows(windows: Sequence[Window]) -> list[dict]:
    return [{"ids": list(w.input_ids), "pos": list(range(len(w.input_ids))), "mask": None,
             "gathers": [(list(range(w.first, w.first + len(w.targets))), list(w.targets))]} for w in windows]


def _workspace(cache: dict, logits: torch.Tensor) -> torch.Tensor:
    """The base's float64 arrays, (2, max(HEAD_ROWS, n), V) for logits (n, V), on their device: made once per
    vocabulary and device (again only for more rows) and held in ``cache`` (a run's), then reused by every block of
    every batch."""
    n, v = logits.shape
    key = (v, logits.device)
    if key not in cache or cache[key].shape[1] < n:
        cache[key] = logits.new_empty((2, max(HEAD_ROWS, n), v), dtype=torch.float64)
    return cache[key]


def _compare(heads: Sequence, hqs: Sequence[torch.Tensor], head_b, hb: torch.Tensor, targets: torch.Tensor,
             workspaces: dict, logprobs: str = "float64") -> list[dict[str, np.ndarray]]:
    """Per-token values of several quantized models' hidden states ``hqs`` (each (N, D), with its head) against the
    unquantized ``hb`` (N, D): in blocks of HEAD_ROWS rows, the base's log-probabilities computed once per block and
    shared by every spec (one block of HEAD_ROWS x vocabulary float64 values per model at a time, in
    ``_workspace`` from ``workspaces``: a run's, kept from batch to batch)."""
    parts: list[list[dict]] = [[] for _ in hqs]
    for s in range(0, len(targets), HEAD_ROWS):
        t = targets[s:s + HEAD_ROWS]
        base = _base(head_b(hb[s:s + HEAD_ROWS]), t, workspaces, logprobs)  # (n, V) and per token; logits freed
        for j, (head, hq) in enumerate(zip(heads, hqs)):
            parts[j].append(_values(head(hq[s:s + HEAD_ROWS]), base, t, logprobs))  # logits (n, V)
    return [{k: torch.cat([p[k] for p in ps]).cpu().numpy() for k in ps[0]} for ps in parts]


def quantizes_head(spec: QuantSpec) -> bool:
    """Whether a spec quantizes the LM head (``linears:lm_head``).

    Args:
        spec: the spec."""
    from outlierscope.quant.linears.sites import HEAD

    return HEAD in (spec.linears or ())


def score_windows(model, windows: Sequence[Window], specs: Sequence[QuantSpec], batch_size: int = 1,
                  calibrations: Sequence | None = None, block_rows: int | None = None,
                  shards: Collection[int] | None = None, progress=None, logprobs: str = "float64",
                  hold_bytes: int = HOLD_BYTES) -> list[TokenScores]:
    """Each spec's ``TokenScores`` over the windows, against the unquantized model as the base.

    The unquantized model runs once per batch, through the same attention function as the quantized ones (a spec
    that quantizes nothing has KLD 0 exactly), and its log-probabilities are computed once for every spec whose LM
    head is not quantized.

    Args:
        model: the model.
        windows: the ``Window`` list (``protocol_windows``).
        specs: the specs to score.
        batch_size: windows per forward.
        calibrations: each spec's ``calibration_for`` (None: none needed).
        block_rows: query rows per attention block; None: whole.
        shards: score only the batches of these virtual shards (batch k is in ``shard_of(k)``); None: all.
        progress: called as ``progress(k)`` after the k-th batch.
        logprobs: how each NLL is taken from the logits (``LOGPROBS``); the KLD is float64 either way.
        hold_bytes: the budget for quantized weights kept from batch to batch; the same values either way.

    Returns:
        One ``TokenScores`` per spec."""
    calibrations = list(calibrations) if calibrations is not None else [None] * len(specs)
    base = Side("model", QuantSpec())
    pairs = [(base, Side("model", spec, cal)) for spec, cal in zip(specs, calibrations)]
    return score_sides({"model": model}, windows, pairs, batch_size, block_rows, shards, progress, logprobs, hold_bytes)


def _owned_batches(n: int, batch_size: int, shards: Collection[int] | None) -> list[list[int]]:
    """The batches (window indices) of ``n`` windows that belong to ``shards`` (all with None): batch k of
    ``batch_size`` consecutive windows belongs to virtual shard ``shard_of(k)``."""
    batches = [list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]
    owned = None if shards is None else set(shards)
    return [b for k, b in enumerate(batches) if owned is None or shard_of(k) in owned]


def score_noise(model, ref_model, windows: Sequence[Window], specs: Sequence[QuantSpec], batch_size: int = 1,
                calibrations: Sequence | None = None, ref_calibrations: Sequence | None = None,
                block_rows: int | None = None, shards: Collection[int] | None = None) -> list[TokenScores]:
    """The numerical noise floor of each spec: the spec under one arithmetic against itself under another.

    ``kld`` is KL(ref || model) of one scheme computed by two models with the same weights (float32 and float64,
    say): ``score_pairs`` with each spec on both sides.

    Args:
        model: the model in the arithmetic measured.
        ref_model: the same weights in the reference arithmetic (the base).
        windows: the ``Window`` list.
        specs: the specs.
        batch_size: windows per forward.
        calibrations: each spec's ``calibration_for`` for ``model`` (None: none needed).
        ref_calibrations: each spec's for ``ref_model``.
        block_rows: query rows per attention block; None: whole.
        shards: score only the batches of these virtual shards; None: all."""
    return score_pairs(model, ref_model, windows, specs, specs, batch_size, calibrations, ref_calibrations,
                       block_rows, shards)


@dataclass(frozen=True, eq=False)
class Side:
    """One forward of a pair of ``score_sides``.

    Attributes:
        model: the key of its model in ``score_sides``' models.
        spec: the spec it runs under.
        calibration: the spec's ``calibration_for``, or None."""

    model: str
    spec: QuantSpec
    calibration: object = None

    @property
    def key(self) -> tuple:
        """Sides with equal keys are one forward."""
        return self.model, "none" if self.spec.is_identity else str(self.spec), id(self.calibration)


@torch.no_grad()
def score_sides(models: dict, windows: Sequence[Window], pairs: Sequence[tuple[Side, Side]], batch_size: int = 1,
                block_rows: int | None = None, shards: Collection[int] | None = None,
                progress=None, logprobs: str = "float64", hold_bytes: int = HOLD_BYTES) -> list[TokenScores]:
    """Token by token, for each pair ``(base, other)``: ``other``'s forward against ``base``'s as the base.

    Each distinct side runs once per batch however many pairs hold it, and a base's log-probabilities are computed
    once for every pair that shares it. An ``other`` that quantizes the LM head is scored inside its own context; a
    base that does is refused. A side that quantizes only layers >= s starts from the unquantized side's output of
    layer s - 1 in the same batch (the same bytes, the layers below not run again).

    Args:
        models: key -> model; they share the tokenizer the windows were made with.
        windows: the ``Window`` list.
        pairs: ``(base, other)`` pairs of ``Side``; ``kld`` is KL(base || other), ``nll_base`` the base's.
        batch_size: windows per forward.
        block_rows: query rows per attention block; None: whole.
        shards: score only the batches of these virtual shards; None: all.
        progress: called as ``progress(k)`` after the k-th batch.
        logprobs: how each NLL is taken from the logits (``LOGPROBS``); the KLD is float64 either way.
        hold_bytes: the sides' quantized weights are kept from batch to batch, in order of first use, within this
            many bytes; the rest is quantized again at each batch. The same values either way.

    Returns:
        One ``TokenScores`` per pair."""
    if logprobs not in LOGPROBS:
        raise ParamError("logprobs", f"one of {', '.join(LOGPROBS)}", logprobs)
    sides = _sides(pairs)
    heads = {k: lm_head(m, frozen=True) for k, m in models.items()}  # unquantized, also inside a spec's context
    by_base, by_head = _group_pairs(pairs)
    workspaces: dict = {}  # the base's float64 arrays, reused by every batch (_workspace)
    held = HeldWeights(hold_bytes)  # the sides' quantized weights, from batch to batch while they fit
    out: list[list[dict]] = [[] for _ in pairs]
    for done, batch in enumerate(_owned_batches(len(windows), batch_size, shards)):
        rows = _rows([windows[i] for i in batch])
        window = np.repeat(batch, [len(windows[i].targets) for i in batch])
        hidden, targets = _trunks(models, sides, rows, block_rows, held)
        for key, js in by_base.items():
            hb = hidden[key]
            others = [pairs[j][1] for j in js]
            values = _compare([heads[o.model] for o in others], [hidden[o.key].to(hb.device) for o in others],
                              heads[sides[key].model], hb, targets.to(hb.device), workspaces, logprobs)
            for j, v in zip(js, values):
                out[j].append({"window": window, **v})
        for js in by_head.values():
            for j, v in zip(js, _head_quantized(models, heads, [pairs[j] for j in js], hidden, rows, targets,
                                                block_rows, workspaces, logprobs, held)):
                out[j].append({"window": window, **v})
        if progress is not None:
            progress(done + 1)
    return [_scores(parts) for parts in out]


def _sides(pairs: Sequence[tuple[Side, Side]]) -> dict[tuple, Side]:
    """The distinct sides of ``pairs`` (key -> side, in order of first use) whose trunks every batch runs: all but
    the others that quantize the LM head. A base that quantizes it is refused."""
    sides: dict[tuple, Side] = {}
    for base, other in pairs:
        if quantizes_head(base.spec):
            raise OutlierscopeError(f"{base.spec}: a spec that quantizes the LM head cannot be the base of a "
                                    "comparison (its head exists only inside its context); leave lm_head out of "
                                    "linears: there")
        sides.setdefault(base.key, base)
        if not quantizes_head(other.spec):
            sides.setdefault(other.key, other)
    return sides


def _trunks(models: dict, sides: dict[tuple, Side], rows: list[dict], block_rows: int | None, held: HeldWeights):
    """Each side's hidden states at the scored positions of one batch (side key -> (N, D)), and the targets (N,).
    ``held``: the run's quantized weights, kept from batch to batch (``HeldWeights``). A side that quantizes
    only layers >= s of a model whose unquantized side runs too starts from that side's output of layer s - 1
    (``outlierscope.hooks.prefix``): the same bytes, layers below s not run again."""
    hidden = {}
    starts = {key: prefix_start(side.spec) for key, side in sides.items()}
    plain = {side.model: key for key, side in sides.items() if side.spec.is_identity and side.calibration is None}
    needed = {m: {starts[k] - 1 for k, s in sides.items() if s.model == m and starts[k] > 0} for m in plain}
    order = [*plain.values(), *(k for k in sides if k not in plain.values())]  # each model's plain side first
    recorded: dict = {}
    for key in order:
        side = sides[key]
        model = models[side.model]
        start = starts[key] if side.model in plain else 0  # the plain side's own start is 0
        with quantize_model(model, side.spec, block_rows, side.calibration, held=(held, key)), \
                recording_outputs(model, needed[side.model]) if key == plain.get(side.model) else \
                contextlib.nullcontext({}) as outs, \
                replaying(model, start, recorded.get((side.model, start - 1))):
            hidden[key], _, tgt = gathered_hidden(model, rows)
        recorded.update({(side.model, j): out for j, out in outs.items()})
    return hidden, torch.tensor(tgt)


def prefix_start(spec: QuantSpec) -> int:
    """The first decoder layer a spec changes: ``min(spec.layers)``, or 0 where it changes anything else.

    Args:
        spec: the spec (without ``layers``, with bitsandbytes weights or quantizing the LM head: 0)."""
    if spec.layers is None or spec.weights_mode != "none" or quantizes_head(spec):
        return 0
    return min(spec.layers)


def _group_pairs(pairs: Sequence[tuple[Side, Side]]) -> tuple[dict[tuple, list[int]], dict[tuple, list[int]]]:
    """The pairs' indices grouped once: by base key those whose other shares the unquantized head (compared in one
    block per base), and by other key those whose other quantizes the LM head (one forward per batch each)."""
    by_base: dict[tuple, list[int]] = {}
    by_head: dict[tuple, list[int]] = {}
    for j, (base, other) in enumerate(pairs):
        if quantizes_head(other.spec):
            by_head.setdefault(other.key, []).append(j)
        else:
            by_base.setdefault(base.key, []).append(j)
    return by_base, by_head


def _head_quantized(models: dict, heads: dict, pairs: Sequence[tuple[Side, Side]], hidden: dict, rows: list[dict],
                    targets: torch.Tensor, block_rows: int | None, workspaces: dict,
                    logprobs: str, held: HeldWeights) -> list[dict[str, np.ndarray]]:
    """The pairs of one other side that quantizes the LM head, each against its base's hidden states: the side's
    forward once, inside its context (its head exists only there)."""
    other = pairs[0][1]
    model = models[other.model]
    with quantize_model(model, other.spec, block_rows, other.calibration, held=(held, other.key)):
        hq, _, _ = gathered_hidden(model, rows)
        head = lm_head(model)
        return [_compare([head], [hq.to(hidden[b.key].device)], heads[b.model], hidden[b.key],
                         targets.to(hidden[b.key].device), workspaces, logprobs)[0] for b, _ in pairs]


def score_pairs(model, ref_model, windows: Sequence[Window], specs: Sequence[QuantSpec],
                ref_specs: Sequence[QuantSpec], batch_size: int = 1, calibrations: Sequence | None = None,
                ref_calibrations: Sequence | None = None, block_rows: int | None = None,
                shards: Collection[int] | None = None) -> list[TokenScores]:
    """Two models compared token by token: ``model`` under ``specs[j]`` against ``ref_model`` under ``ref_specs[j]``.

    The noise floor (one spec, two arithmetics) and a quantized checkpoint against its emulation are such pairs; a
    reference spec shared by several pairs runs once per batch.

    Args:
        model: the compared model.
        ref_model: the reference (the base: ``kld`` is KL(ref || model), ``nll_base`` the reference's).
        windows: the ``Window`` list.
        specs: the compared model's spec of each pair.
        ref_specs: the reference's spec of each pair.
        batch_size: windows per forward.
        calibrations: each spec's ``calibration_for`` (None: none needed).
        ref_calibrations: each reference spec's.
        block_rows: query rows per attention block; None: whole.
        shards: score only the batches of these virtual shards; None: all.

    Returns:
        One ``TokenScores`` per pair."""
    if len(ref_specs) != len(specs):
        raise OutlierscopeError(f"{len(specs)} specs and {len(ref_specs)} reference specs; give one of each per pair")
    calibrations = list(calibrations) if calibrations is not None else [None] * len(specs)
    ref_calibrations = list(ref_calibrations) if ref_calibrations is not None else [None] * len(specs)
    pairs = [(Side("ref", r, rc), Side("model", q, qc))
             for q, r, qc, rc in zip(specs, ref_specs, calibrations, ref_calibrations)]
    return score_sides({"model": model, "ref": ref_model}, windows, pairs, batch_size, block_rows, shards)


def _scores(parts: list[dict]) -> TokenScores:
    if not parts:
        empty = np.zeros(0)
        return TokenScores(np.zeros(0, dtype=np.int64), empty, empty, empty, np.zeros(0, dtype=bool), empty)
    return TokenScores(**{k: np.concatenate([p[k] for p in parts]) for k in parts[0]})


def document_metrics(tokens: TokenScores, windows: Sequence[Window], docs: Sequence[str],
                     logprobs: str = "float64") -> dict:
    """lm-evaluation-harness 0.4.13's metrics of a ``loglikelihood_rolling`` task (its wikitext), from token values.

    Per document the log-likelihood (0 for an empty one), its words (``len(re.split(r"\\s+", doc))``) and UTF-8
    bytes; word_perplexity = exp(-sum ll / sum words), byte_perplexity = exp(-sum ll / sum bytes), bits_per_byte =
    -sum ll / sum bytes / ln 2; of the quantized model and (``*_base``) of the unquantized one.

    Args:
        tokens: the per-token values of lmeval windows.
        windows: those windows.
        docs: the documents.
        logprobs: ``float64``, or ``lmeval`` to add as lm-eval does."""
    import math
    import re

    words = sum(len(re.split(r"\s+", d)) for d in docs)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    out = {}
    for suffix, nll in (("", tokens.nll), ("_base", tokens.nll_base)):
        ll = float(_document_sums(nll, tokens, windows, len(docs), logprobs).sum())
        out.update({f"word_perplexity{suffix}": math.exp(-ll / words),
                    f"byte_perplexity{suffix}": math.exp(-ll / n_bytes),
                    f"bits_per_byte{suffix}": -ll / n_bytes / math.log(2)})
    return out


def document_loglikelihoods(tokens: TokenScores, windows: Sequence[Window], n_docs: int,
                            logprobs: str = "float64") -> np.ndarray:
    """Each document's log-likelihood under the quantized model (lm-eval's ``loglikelihood_rolling`` result).

    Args:
        tokens: the per-token values of lmeval windows.
        windows: those windows.
        n_docs: the number of documents.
        logprobs: ``float64`` (each document's tokens summed in float64), or ``lmeval`` (as lm-eval adds them: each
            window's in float32, in order, the windows' in Python floats)."""
    return _document_sums(tokens.nll, tokens, windows, n_docs, logprobs)


def _document_sums(nll: np.ndarray, tokens: TokenScores, windows: Sequence[Window], n_docs: int,
                   logprobs: str) -> np.ndarray:
    doc_of = _token_documents(tokens, windows)
    if logprobs == "float64":
        return -np.bincount(doc_of, weights=nll, minlength=n_docs)
    out = [0.0] * n_docs
    for w in np.unique(tokens.window):  # window order; each window's tokens in order (TokenScores keeps them so)
        at = tokens.window == w
        out[int(doc_of[at][0])] += float(torch.from_numpy(-nll[at]).float().sum())
    return np.array(out)


def _token_documents(tokens: TokenScores, windows: Sequence[Window]) -> np.ndarray:
    """(N,): the document of each scored token (lmeval windows: each of one document)."""
    doc_of = np.array([w.doc for w in windows])[tokens.window]
    if (doc_of < 0).any():
        raise ValueError("document metrics need lmeval windows (each of one document)")
    return doc_of
