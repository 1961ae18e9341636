"""What quantized logits do to attention, per layer and head, streamed.

For every real query row, against the unquantized logits of the same forward (same layer input)::

    p = softmax(logits over valid keys),  p~ = softmax(quantized logits over valid keys)   # float64
    kl      = sum_k p_k (log p_k - log p~_k)                     KL(p || p~), nats
    changed = the reference's top key is no longer the sole top of the quantized row: another key
              passes it, or more keys now share the maximum (absmax rounding keeps order, so for
              it only the second happens: the top key's weight is split with keys that were below)
    rel_out = ||(p - p~) @ V|| / ||p @ V||                        relative error of the head's output row

``measure_attention_error`` streams it from any forward; ``AttentionErrorStats`` keeps per (layer, head) the row count, the sums and maxima of kl and
rel_out and the count of changed argmaxes; memory is O(layers x heads). Counts and maxima merge
exactly; sums are float64 (relative error about rows x 1e-16). Soft-capped models are measured before
the cap. For DiffLlama, V is the value half of the layer's first attention call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pandas as pd
import torch
from torch import nn

from outlierscope.errors import ParamError
from outlierscope.hooks.attention import (
    QKV,
    LogitContext,
    QKVContext,
    Stage,
    attention_logits,
    attention_stages,
    repeat_kv,
    repeat_kv_t,
)
from outlierscope.parallel import VIRTUAL_SHARDS
from outlierscope.quant.apply import absmax_reduction, attention_stage
from outlierscope.quant.attention.logits import LogitsQuant, logits_quant
from outlierscope.quant.specs.spec import QuantSpec


def attention_row_errors(ref: torch.Tensor, quant: torch.Tensor, valid: torch.Tensor,
                         value: torch.Tensor | None = None, quant_probs: torch.Tensor | None = None,
                         quant_value: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-row errors of quantized logits against the unquantized ones.

    The quantized output is ``softmax(quant) @ value``, or ``quant_probs @ quant_value`` for what a kernel multiplies
    after quantizing P and V.

    Args:
        ref: the unquantized logits ``(B, H, t, S)``.
        quant: the quantized logits.
        valid: bool ``(B, 1|H, t, S)``.
        value: ``(B, H, S, d)``, for the output's relative error; None: not measured.
        quant_probs: the probabilities a kernel multiplies after quantizing P; None: ``softmax(quant)``.
        quant_value: the values it multiplies after quantizing V; None: ``value``.

    Returns:
        ``rows (B, H, t)`` bool (rows with a valid key) and, for them, ``kl``, ``changed`` (top key) and with
        ``value`` ``rel_out``; 0 in other rows."""
    v = valid.expand_as(ref)
    rows = v.any(-1)  # (B, H, t)
    neg = torch.tensor(float("-inf"), dtype=torch.float64, device=ref.device)
    a = torch.where(v, ref.double(), neg)  # (B, H, t, S)
    b = torch.where(v, quant.double(), neg)
    safe = rows.unsqueeze(-1)  # rows without a valid key: softmax of all -inf is NaN; give them zeros
    lp = torch.where(safe, torch.log_softmax(torch.where(safe, a, 0.0), -1), neg)
    lq = torch.where(safe, torch.log_softmax(torch.where(safe, b, 0.0), -1), neg)
    p = lp.exp()
    kl = torch.where(v, p * (lp - lq), 0.0).sum(-1)  # (B, H, t)
    top = a.argmax(-1, keepdim=True)  # the reference's argmax key (first maximum)
    a_max, b_max = a.amax(-1, keepdim=True), b.amax(-1, keepdim=True)
    passed = b.gather(-1, top) < b_max  # another key is now above it
    shared = (b == b_max).sum(-1, keepdim=True) > (a == a_max).sum(-1, keepdim=True)  # more keys tie at the top
    changed = (passed | shared).squeeze(-1) & rows  # (B, H, t)
    out = {"rows": rows, "kl": torch.where(rows, kl, 0.0), "changed": changed}
    if value is not None:
        val = value.double()
        o_ref = torch.matmul(p, val)  # (B, H, t, d)
        pq = lq.exp() if quant_probs is None else torch.where(v, quant_probs.double(), 0.0)
        o_q = torch.matmul(pq, val if quant_value is None else quant_value.double())
        norm = o_ref.norm(dim=-1)
        rel = (o_ref - o_q).norm(dim=-1) / norm.clamp_min(torch.finfo(torch.float64).tiny)
        out["rel_out"] = torch.where(rows, rel, 0.0)
    return out


class AttentionErrorStats:
    """Per (layer, head): counts, sums and maxima of each attention row's error, kept per virtual shard.

    The shards' float64 sums are added in shard order only at the end, so 1 process, N processes and N ``--shard``
    runs give the same bytes; ``set_shard`` before each batch.

    Args:
        n_layers: the model's decoder layers.
        n_heads: attention heads per layer; None: from the first observation."""

    FIELDS = ("rows", "changed", "kl_sum", "kl_max", "rel_sum", "rel_max")
    SHARD_COLUMNS = ["vshard", "layer", "head", *FIELDS]

    def __init__(self, n_layers: int, n_heads: int | None = None):
        """``n_heads``: the heads of the logits (DiffLlama: both maps); None: taken from the first update."""
        self.n_layers = n_layers
        self.has_output = False
        self.n_heads = None
        self.shard = 0
        if n_heads is not None:
            self._allocate(n_heads)

    def _allocate(self, n_heads: int) -> None:
        self.n_heads = n_heads
        shape = (VIRTUAL_SHARDS, self.n_layers, n_heads)  # (S, L, H)
        self.per_shard = {f: torch.zeros(shape, dtype=torch.int64 if f in ("rows", "changed") else torch.float64)
                          for f in self.FIELDS}

    def set_shard(self, shard: int) -> None:
        """Set the virtual shard the next rows belong to (the batch's: ``shard_of(batch)``).

        Args:
            shard: 0 .. VIRTUAL_SHARDS - 1."""
        self.shard = shard

    def __getattr__(self, name: str):
        """``rows``, ``changed``, ``kl_sum``, ... (L, H): over the virtual shards (sums in shard order, maxima)."""
        if name in AttentionErrorStats.FIELDS and "per_shard" in self.__dict__:
            t = self.per_shard[name]
            return t.amax(0) if name.endswith("_max") else _ordered_sum(t)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def update(self, layer: int, ref: torch.Tensor, quant: torch.Tensor, valid: torch.Tensor,
               value: torch.Tensor | None = None, quant_probs: torch.Tensor | None = None,
               quant_value: torch.Tensor | None = None) -> None:
        """Add the rows of one attention block of a layer (``attention_row_errors`` of the arguments).

        Args:
            layer: the decoder layer.
            ref: the unquantized logits ``(B, H, t, S)``.
            quant: the quantized logits, the same shape.
            valid: bool ``(B, 1|H, t, S)``: the entries that count.
            value: the values ``(B, H, S, d)``, for the output's relative error; None: not measured.
            quant_probs: the probabilities a kernel multiplies after quantizing P; None: ``softmax(quant)``.
            quant_value: the values it multiplies after quantizing V; None: ``value``."""
        if self.n_heads is None:
            self._allocate(ref.shape[1])
        e = {k: t.cpu() for k, t in attention_row_errors(ref, quant, valid, value, quant_probs, quant_value).items()}
        at = self.per_shard
        s = self.shard
        at["rows"][s, layer] += e["rows"].sum((0, 2))  # (B, H, t) -> (H,)
        at["changed"][s, layer] += e["changed"].sum((0, 2))
        at["kl_sum"][s, layer] += e["kl"].sum((0, 2))
        at["kl_max"][s, layer] = torch.maximum(at["kl_max"][s, layer], e["kl"].amax((0, 2)))
        if "rel_out" in e:
            self.has_output = True
            at["rel_sum"][s, layer] += e["rel_out"].sum((0, 2))
            at["rel_max"][s, layer] = torch.maximum(at["rel_max"][s, layer], e["rel_out"].amax((0, 2)))

    def merge(self, other: AttentionErrorStats) -> AttentionErrorStats:
        """Add another's rows: other virtual shards of the same run (exact), or other data (sums in float64).

        Args:
            other: statistics of the same layers and heads.

        Returns:
            self."""
        if other.n_heads is None:
            return self
        if self.n_heads is None:
            self._allocate(other.n_heads)
        if (other.n_layers, other.n_heads) != (self.n_layers, self.n_heads):
            raise ValueError(f"shapes differ: ({self.n_layers}, {self.n_heads}) vs ({other.n_layers}, {other.n_heads})")
        for f, t in self.per_shard.items():
            t.copy_(torch.maximum(t, other.per_shard[f]) if f.endswith("_max") else t + other.per_shard[f])
        self.has_output |= other.has_output
        return self

    def shard_table(self) -> pd.DataFrame:
        """The raw per virtual shard numbers (one row per shard, layer and head with rows): what a ``--shard`` run
        saves beside its partial cell, for ``from_shard_tables`` to merge exactly."""
        if self.n_heads is None:
            return pd.DataFrame(columns=self.SHARD_COLUMNS)
        idx = torch.nonzero(self.per_shard["rows"] > 0)  # (R, 3): (shard, layer, head)
        cols = {"vshard": idx[:, 0], "layer": idx[:, 1], "head": idx[:, 2]}
        cols.update({f: self.per_shard[f][idx[:, 0], idx[:, 1], idx[:, 2]] for f in self.FIELDS})
        return pd.DataFrame({k: v.numpy() for k, v in cols.items()}).assign(has_output=self.has_output)

    @classmethod
    def from_shard_tables(cls, tables: list[pd.DataFrame], n_layers: int) -> AttentionErrorStats:
        """The statistics of ``shard_table`` parts (disjoint virtual shards) combined.

        Args:
            tables: the parts' shard tables.
            n_layers: the model's decoder layers."""
        st = cls(n_layers)
        rows = pd.concat([t for t in tables if len(t)], ignore_index=True) if any(len(t) for t in tables) else None
        if rows is None:
            return st
        st._allocate(int(rows["head"].max()) + 1)
        i = [torch.as_tensor(rows[c].to_numpy().copy(), dtype=torch.long) for c in ("vshard", "layer", "head")]
        for f, t in st.per_shard.items():
            t[i[0], i[1], i[2]] = torch.as_tensor(rows[f].to_numpy().copy(), dtype=t.dtype)
        st.has_output = bool(rows["has_output"].any())
        return st

    def table(self) -> pd.DataFrame:
        """One row per layer and head: rows, mean and max KL, argmax change rate, mean and max relative output error."""
        if self.n_heads is None:
            return pd.DataFrame(columns=["layer", "head", "rows", "kl_mean", "kl_max", "argmax_change_rate"])
        rows, changed, kl_sum, kl_max, rel_sum, rel_max = (getattr(self, f) for f in self.FIELDS)  # (L, H) each
        n = rows.clamp_min(1).double()
        recs = []
        for layer in range(self.n_layers):
            for h in range(self.n_heads):
                if rows[layer, h] == 0:
                    continue
                r = {"layer": layer, "head": h, "rows": int(rows[layer, h]),
                     "kl_mean": float(kl_sum[layer, h] / n[layer, h]), "kl_max": float(kl_max[layer, h]),
                     "argmax_change_rate": float(changed[layer, h] / n[layer, h])}
                if self.has_output:
                    r["rel_out_mean"] = float(rel_sum[layer, h] / n[layer, h])
                    r["rel_out_max"] = float(rel_max[layer, h])
                recs.append(r)
        return pd.DataFrame(recs)

    def per_layer(self) -> pd.DataFrame:
        """Pooled over heads: ``pool_heads`` of ``table``."""
        return pool_heads(self.table())


_POOLED = {"kl_mean": "mean", "kl_max": "max", "argmax_change_rate": "mean", "rel_out_mean": "mean",
           "rel_out_max": "max"}  # how each column of a table pools: row-weighted mean or maximum


def _ordered_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` (S, ...) summed over its first dim one slice after another, in order: the same bytes whatever process
    computed which slice."""
    out = t[0].clone()
    for x in t[1:]:
        out += x
    return out


def pool_rows(table: pd.DataFrame, by: list[str], sort: bool = False) -> pd.DataFrame:
    """Rows of a per layer and head table pooled: the rows summed, the means weighted by rows, the maxima.

    A column missing in some pooled row (a cell measured without the output error beside one with it) pools to NaN,
    not to a mean of the rows that have it.

    Args:
        table: ``AttentionErrorStats.table`` (or tables of it).
        by: the columns to pool per.
        sort: sort the groups."""
    if table.empty:
        return table
    cols = [c for c in _POOLED if c in table]

    def one(g: pd.DataFrame) -> dict:
        n = g["rows"].sum()
        return {"rows": n, **{c: float("nan") if g[c].isna().any() else
                              ((g[c] * g["rows"]).sum() / n if _POOLED[c] == "mean" else g[c].max()) for c in cols}}

    return pd.DataFrame([{**dict(zip(by, k)), **one(g)} for k, g in table.groupby(by, sort=sort)])


def pool_heads(table: pd.DataFrame) -> pd.DataFrame:
    """A per layer and head table pooled over heads, in layer order.

    Args:
        table: ``AttentionErrorStats.table``."""
    return pool_rows(table, ["layer"], sort=True)


@contextlib.contextmanager
def measure_attention_error(model: nn.Module, spec: QuantSpec | str, stats,
                            block_rows: int | None = None) -> Iterator:
    """Measure what quantizing with a spec does to each layer's attention, without changing the model.

    An observing stage quantizes copies and compares. Entered before ``quantize_model`` with the same spec, it
    measures each layer against the unquantized attention of the same forward (same layer input)::

        stats = AttentionErrorStats(n_layers, n_heads)
        with measure_attention_error(model, spec, stats), quantize_model(model, spec):
            model(input_ids=ids, attention_mask=mask)

    Args:
        model: the model to observe.
        spec: a ``QuantSpec``, its text or a recipe name: the paper's logits part alone, or q, k, v and P with their
            transforms (not both; linear parts and bitsandbytes weights act outside attention and are not measured).
        stats: the ``AttentionErrorStats`` that receives the errors.
        block_rows: query rows per attention block; None: whole.

    Yields:
        None; the errors stream into ``stats``."""
    spec = measured_spec(spec)
    lq = logits_quant(spec)
    stage = _logit_stage(lq, stats, spec.label) if spec.is_logits_only else _kernel_stage(spec, stats)
    with attention_stages(model, stage, block_rows=block_rows):
        yield stats


def measured_spec(spec: QuantSpec | str) -> QuantSpec:
    """The attention part of a spec that ``measure_attention_error`` measures (linear parts and bitsandbytes left out).

    Call it before anything expensive.

    Args:
        spec: a ``QuantSpec``, its text or a recipe name.

    Raises:
        ParamError: a spec that quantizes the logits and q/k/v/P together."""
    spec = QuantSpec.of(spec).without_weights()
    if spec.part("logits") is not None and not spec.is_logits_only:
        raise ParamError("spec", "logits quantization or q/k/v/P quantization, not both, when the attention error is "
                         "measured (measure the two parts in separate cells)", str(spec))
    return spec


def _logit_stage(lq: LogitsQuant | None, stats, label: str) -> Stage:
    """Compares each block of logits with its quantized copy (the paper's logits quantization); ``lq`` None
    (unquantized): nothing to measure."""
    def measure(ctx: LogitContext, logits):
        if lq is not None and lq.applies_to(ctx.layer):
            stats.update(ctx.layer, logits, lq(logits, ctx.valid, ctx.reduced(stage)), ctx.valid, ctx.value)
        return logits

    # observes: returns its input, runs once per layer (not again in DiffLlama's second call)
    stage = Stage(apply=measure, observes=True, reduce=absmax_reduction(lq) if lq is not None else None,
                  name=f"attention error {label}")
    return stage


def _kernel_stage(spec: QuantSpec, stats) -> Stage:
    """Compares, per block of query rows, the attention of the call's own q, k, v (as the stage receives them) with
    the attention a kernel computes after ``spec``'s transforms (``attention_stage``'s
    own ``qkv`` and ``probs``, run on copies)::

        ref    = (q @ k^T) * scaling                   p = softmax(cap(ref)),  out = p @ v
        q~, k~, v~ = spec's qkv(q, k, v)                quant = (q~ @ k~^T) * scaling (+ Q smoothing's correction)
        p~ = spec's probs(softmax(cap(quant)))          out~ = p~ @ v~

    kl and changed compare ``cap(ref)`` with ``cap(quant)`` (what the softmax gets: the effect of quantizing q and k);
    rel_out compares ``out`` with ``out~`` (everything: q, k, P and V). For DiffLlama, v is the value half of the
    layer's first call, as for the logits."""
    kernel = attention_stage(spec)
    seen: dict = {}  # the current call's raw and transformed q/k/v (one layer's worth)

    def stash(ctx: QKVContext, q, k, v) -> QKV:
        seen.clear()
        if not ctx.second and spec.applies_to(ctx.layer):
            H = q.shape[1]
            t = kernel.qkv(ctx, q, k, v) if kernel.qkv else QKV(q, k, v)
            seen.update(layer=ctx.layer, q=q, k_t=repeat_kv_t(k, H), v=repeat_kv(v, H // v.shape[1]), qq=t.query,
                        qk_t=repeat_kv_t(t.key, H), qv=repeat_kv(t.value, H // t.value.shape[1]), q_mean=t.q_mean,
                        k_mean_t=None if t.k_for_mean is None else repeat_kv_t(t.k_for_mean, H))
        return QKV(q, k, v)

    def measure(ctx: LogitContext, logits):
        if seen.get("layer") != ctx.layer:
            return logits
        rows = slice(ctx.q_start, ctx.q_start + logits.shape[2])
        ref = _capped(attention_logits(seen["q"][:, :, rows], seen["k_t"], ctx.scaling), ctx.softcap)  # (B, H, t, S)
        q_mean = None if seen["q_mean"] is None else seen["q_mean"][:, :, rows]
        quant = _capped(attention_logits(seen["qq"][:, :, rows], seen["qk_t"], ctx.scaling, q_mean, seen["k_mean_t"]),
                        ctx.softcap)
        probs = torch.softmax(quant.masked_fill(~ctx.valid, torch.finfo(quant.dtype).min), -1, dtype=torch.float32)
        probs = kernel.probs(ctx, probs.to(seen["qq"].dtype)) if kernel.probs else probs  # (B, H, t, S)
        stats.update(ctx.layer, ref, quant, ctx.valid, seen["v"], probs, seen["qv"])
        return logits

    return Stage(apply=measure, observes=True, name=f"attention error {spec.label}", qkv=stash)


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap
