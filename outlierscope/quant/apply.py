"""Apply quantization to a model: attention (logits, q/k/v, P), linear layers' inputs and weights (our primitives),
and weights through bitsandbytes.

What quantization does to attention is measured in ``outlierscope.analysis.attention_error``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.attention import QKV, LogitContext, QKVContext, Stage, attention_stages
from outlierscope.hooks.points import attention_layers, decoder_layers
from outlierscope.quant.attention.logits import LogitsQuant, logits_quant
from outlierscope.quant.attention.ops import quantize_probs, quantize_tokens, smooth_q
from outlierscope.quant.bnb import bnb_weights
from outlierscope.quant.linears.schemes import quantize_linears
from outlierscope.quant.linears.sites import Calibration
from outlierscope.quant.specs.spec import TARGETS, QuantSpec
from outlierscope.quant.specs.transforms import Hadamard, SmoothQ
from outlierscope.quant.weights.calibration import check_linear_shapes


def check_layers(spec: QuantSpec, n_layers: int, attention: list[int] | None = None) -> None:
    """Refuse, in one line, a spec naming layers the model does not have, or layers without attention.

    Args:
        spec: the spec.
        n_layers: the model's decoder layers.
        attention: in a hybrid model, the layers that hold attention; None: all."""
    if spec.layers is None:
        return
    if max(spec.layers) >= n_layers:
        raise OutlierscopeError(f"layers {list(spec.layers)} out of range: the model has layers 0..{n_layers - 1}")
    other = sorted(set(spec.layers) - set(attention if attention is not None else range(n_layers)))
    if other:
        raise OutlierscopeError(f"layers {other} hold no attention (a hybrid model); its attention layers are "
                                f"{','.join(map(str, attention))}")


def check_spec(spec: QuantSpec | str, config) -> None:
    """Check what a spec needs of the model's shape, from its config, before anything loads.

    Group sizes that divide head_dim, a power-of-2 head_dim for a Hadamard rotation; linear parts: ``linears``
    patterns that match, group sizes that divide each quantized linear's in_features, rotations of its order.

    Args:
        spec: a ``QuantSpec``, its text or a recipe name.
        config: the model's config."""
    spec = QuantSpec.of(spec)
    if spec.has_linear:
        check_linear_shapes(spec, config)
    cfg = getattr(config, "text_config", None) or config
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    d = getattr(cfg, "head_dim", None) or ((getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", 0)) // heads
                                           if heads else None)
    if not d:
        return
    for p in spec.parts:
        if p.target in TARGETS and p.granularity == "per_group" and d % p.size:  # a/w groups: check_linear_shapes
            raise OutlierscopeError(f"{p}: the model's head_dim {d} is not a multiple of the group size {p.size}")
    if spec.get(Hadamard) is not None and d & (d - 1):
        raise OutlierscopeError(f"hadamard needs a power-of-2 head_dim; the model's is {d}")


def absmax_reduction(lq: LogitsQuant):
    """A ``Stage`` ``reduce`` for blocked attention: a scale over query rows is the absmax over all blocks of rows.

    Args:
        lq: the logits operator.

    Returns:
        The reduction; None for a scale that stays in a block (per_row)."""
    if not lq.spans_rows:
        return None
    return lambda ctx, logits: lq.absmax(logits, ctx.valid) if lq.applies_to(ctx.layer) else None


def _qkv_transform(spec: QuantSpec):
    """The stage's ``qkv``: Hadamard rotation, K smoothing, Q smoothing (with its full-precision correction), then
    q, k, v quantized per their parts; layers outside ``spec.layers`` pass through."""
    parts = {t: spec.part(t) for t in ("q", "k", "v")}
    exact = sorted((t for t in spec.transforms if t.attention and not isinstance(t, SmoothQ)), key=lambda t: t.qk_rank)
    sq = spec.get(SmoothQ)

    def transform(ctx: QKVContext, q, k, v) -> QKV:
        if not spec.applies_to(ctx.layer):
            return QKV(q, k, v)
        for t in exact:  # q k^T unchanged: a rotation, K smoothing, a registered transform
            q, k = t.qk(q, k, ctx.q_valid, ctx.k_valid)
        q_mean = None
        if sq is not None:
            q, q_mean = smooth_q(q, ctx.q_valid, sq.rows)
        k_exact = k
        q = quantize_tokens(q, ctx.q_valid, parts["q"]) if parts["q"] else q
        k = quantize_tokens(k, ctx.k_valid, parts["k"]) if parts["k"] else k
        v = quantize_tokens(v, ctx.k_valid, parts["v"]) if parts["v"] else v
        return QKV(q, k, v, q_mean, k_exact if q_mean is not None else None)

    return transform


def attention_stage(spec: QuantSpec) -> Stage:
    """One ``Stage`` that does everything a spec asks inside attention: q/k/v, the logits, P.

    Args:
        spec: the spec."""
    lq = logits_quant(spec)
    p = spec.part("probs")
    qkv_needed = any(spec.part(t) for t in ("q", "k", "v")) or any(t.attention for t in spec.transforms)

    def logits(ctx: LogitContext, x):
        return lq(x, ctx.valid, ctx.reduced(stage)) if lq is not None and lq.applies_to(ctx.layer) else x

    def probs(ctx: LogitContext, x):
        return quantize_probs(x, ctx.valid, p, ctx.key_start) if spec.applies_to(ctx.layer) else x

    stage = Stage(apply=logits, reduce=absmax_reduction(lq) if lq is not None else None, name=f"quantize {spec.label}",
                  qkv=_qkv_transform(spec) if qkv_needed else None, probs=probs if p is not None else None)
    return stage


@contextlib.contextmanager
def quantize_model(model: nn.Module, spec: QuantSpec | str, block_rows: int | None = None,
                   calibration: Calibration | None = None, linear_error=None,
                   hold_weights: bool | None = None, held: tuple | None = None) -> Iterator[QuantSpec]:
    """Quantize a model as a spec says, inside the block; everything is restored in ``finally``.

    Attention (the paper's logits after scaling, before soft-capping, masking and softmax; q, k, v and P, with
    smoothing and rotations), linear layers (inputs and weights, SmoothQuant, rotations, LLM.int8, GPTQ, AWQ) and
    bitsandbytes weights. DiffLlama's two maps are quantized together, as one logits tensor. Entered outside
    ``capture``, it profiles the quantized model (stages run in the order the contexts were entered).

    Args:
        model: the model to quantize (never changed outside the block).
        spec: a ``QuantSpec``, its text or a recipe name.
        block_rows: query rows per attention block; per-head and per-tensor logit scales then take a first pass over
            the blocks for the absmax. The same result either way.
        calibration: ``calibrate``'s result, for a spec with ``smooth`` or static activation scales.
        linear_error: a ``LinearErrorStats`` that receives each quantized linear's relative output error.
        hold_weights: quantize each linear's weight once on entry and hold it (one more copy in the model's dtype);
            False: again at every forward; None: held on the CPU, and on a GPU where the copies fit half its free
            memory. The same values either way.
        held: ``(HeldWeights, key)``: keep the quantized weights beyond the block, within the holder's budget, for the
            next block with the same key.

    Yields:
        The spec, parsed.

    Raises:
        OutlierscopeError: a spec that does not fit the model (layers, group sizes, rotations)."""
    spec = QuantSpec.of(spec)
    check_layers(spec, len(decoder_layers(model)), attention_layers(model) if _touches_attention(spec) else None)
    # 16 bits too goes through the same attention function (nothing quantized), for identical arithmetic
    with bnb_weights(model, spec.weights_mode), \
            quantize_linears(model, spec, calibration, linear_error, hold_weights, held), \
            attention_stages(model, attention_stage(spec), block_rows=block_rows):
        yield spec


def _touches_attention(spec: QuantSpec) -> bool:
    return spec.has_attention or not spec.has_linear
