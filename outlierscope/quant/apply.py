"""Apply quantization to a model: attention (logits, q/k/v, P), linear layers' inputs and weights (our primitives),
and weights through bitsandbytes.

What quantization does to attention is measured in :mod:`outlierscope.analysis.attention_error`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.attention import QKV, LogitContext, QKVContext, Stage, attention_stages
from outlierscope.hooks.points import attention_layers, decoder_layers
from outlierscope.quant.linear import Calibration, check_linear_shapes, quantize_linears
from outlierscope.quant.names import WEIGHT_MODES
from outlierscope.quant.ops import hadamard, quantize_probs, quantize_tokens, smooth_k, smooth_q
from outlierscope.quant.recipe import TARGETS, AttnQuant, TensorQuant
from outlierscope.quant.spec import QuantSpec


def check_layers(spec: QuantSpec, n_layers: int, attention: list[int] | None = None) -> None:
    """A one-line error when ``spec`` names layers the model does not have, or (``attention``: the indices of the
    layers that hold attention, in a hybrid model) layers without attention."""
    if spec.layers is None:
        return
    if max(spec.layers) >= n_layers:
        raise OutlierscopeError(f"layers {list(spec.layers)} out of range: the model has layers 0..{n_layers - 1}")
    other = sorted(set(spec.layers) - set(attention if attention is not None else range(n_layers)))
    if other:
        raise OutlierscopeError(f"layers {other} hold no attention (a hybrid model); its attention layers are "
                                f"{','.join(map(str, attention))}")


def check_spec(spec, config) -> None:
    """What an attention spec needs of the model's shape, from its config (before anything loads): group sizes that
    divide head_dim, a power-of-2 head_dim for a Hadamard rotation; linear parts: ``linears`` patterns that match,
    group sizes that divide each quantized linear's in_features, rotations of its order. A logits spec needs
    nothing."""
    if not isinstance(spec, AttnQuant):
        return
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
    if spec.hadamard is not None and d & (d - 1):
        raise OutlierscopeError(f"hadamard needs a power-of-2 head_dim; the model's is {d}")


def absmax_reduction(spec: QuantSpec):
    """A :class:`~outlierscope.hooks.attention.Stage` ``reduce`` for blocked attention: a scale over query rows
    (per_head, per_tensor) is the absmax over all blocks of rows; None for a spec whose scale stays in a block."""
    if not spec.spans_rows:
        return None
    return lambda ctx, logits: spec.absmax(logits, ctx.valid) if spec.applies_to(ctx.layer) else None


def logits_spec(tq: TensorQuant | None, layers) -> QuantSpec | None:
    """The paper's absmax logits quantization (:class:`QuantSpec`) of an :class:`AttnQuant`'s logits part."""
    if tq is None:
        return None
    bits, fmt = tq.grid
    return QuantSpec(bits=bits, format=fmt, granularity=tq.granularity, layers=layers)


def _logit_stage(spec: QuantSpec) -> Stage:
    def quantize(ctx: LogitContext, logits):
        return spec(logits, ctx.valid, ctx.reduced(stage)) if spec.applies_to(ctx.layer) else logits

    stage = Stage(apply=quantize, reduce=absmax_reduction(spec), name=f"quantize {spec.label}")
    return stage


def _qkv_transform(spec: AttnQuant):
    """The stage's ``qkv``: Hadamard rotation, K smoothing, Q smoothing (with its full-precision correction), then
    q, k, v quantized per their parts; layers outside ``spec.layers`` pass through."""
    parts = {t: spec.part(t) for t in ("q", "k", "v")}

    def transform(ctx: QKVContext, q, k, v) -> QKV:
        if not spec.applies_to(ctx.layer):
            return QKV(q, k, v)
        if spec.hadamard is not None:
            rot = hadamard(q.shape[-1], spec.hadamard, q.dtype, q.device)  # (d, d)
            q, k = q @ rot, k @ rot  # q k^T unchanged: rot is orthonormal
        if spec.smooth_k:
            k = smooth_k(k, ctx.k_valid)
        q_mean = None
        if spec.smooth_q is not None:
            q, q_mean = smooth_q(q, ctx.q_valid, spec.smooth_q)
        k_exact = k
        q = quantize_tokens(q, ctx.q_valid, parts["q"]) if parts["q"] else q
        k = quantize_tokens(k, ctx.k_valid, parts["k"]) if parts["k"] else k
        v = quantize_tokens(v, ctx.k_valid, parts["v"]) if parts["v"] else v
        return QKV(q, k, v, q_mean, k_exact if q_mean is not None else None)

    return transform


def attention_stage(spec: AttnQuant) -> Stage:
    """One :class:`~outlierscope.hooks.attention.Stage` that does everything ``spec`` asks: q/k/v transforms and
    quantization, logits quantization (with its reduction over blocks), P quantization."""
    ls = logits_spec(spec.part("logits"), spec.layers)
    base = _logit_stage(ls) if ls is not None else None
    p = spec.part("probs")
    qkv_needed = any(spec.part(t) for t in ("q", "k", "v")) or spec.smooth_k or spec.smooth_q is not None \
        or spec.hadamard is not None

    def probs(ctx: LogitContext, x):
        return quantize_probs(x, ctx.valid, p, ctx.key_start) if spec.applies_to(ctx.layer) else x

    return Stage(apply=base.apply if base else (lambda ctx, logits: logits), reduce=base.reduce if base else None,
                 name=f"quantize {spec.label}", qkv=_qkv_transform(spec) if qkv_needed else None,
                 probs=probs if p is not None else None)


def as_attn_quant(spec: QuantSpec | AttnQuant | str) -> QuantSpec | AttnQuant:
    """A spec as given (the paper's :class:`QuantSpec`, or an :class:`AttnQuant`), or one from a recipe name / text."""
    return AttnQuant.parse(spec) if isinstance(spec, str) else spec


@contextlib.contextmanager
def quantize_model(model: nn.Module, spec: QuantSpec | AttnQuant | str, block_rows: int | None = None,
                   calibration: Calibration | None = None, linear_error=None) -> Iterator[QuantSpec | AttnQuant]:
    """Quantize ``model`` as ``spec`` says: a :class:`QuantSpec` (the paper: the attention logits, after scaling,
    before soft-capping, masking and softmax), or an :class:`AttnQuant` / recipe name / spec text (attention: q, k, v,
    logits, P, with smoothing and rotations; linear layers: inputs and weights, with SmoothQuant, rotations, LLM.int8;
    see :mod:`outlierscope.quant.recipe` and :mod:`outlierscope.quant.linear`). ``calibration``:
    :func:`~outlierscope.quant.linear.calibrate`'s, for a spec with ``smooth`` or static activation scales.
    ``linear_error``: a :class:`~outlierscope.analysis.linear_error.LinearErrorStats` that receives each quantized
    linear's relative output error.

    For DiffLlama both maps are quantized together (they are one logits tensor, heads [0, H/2) and
    [H/2, H)). Composes with :func:`outlierscope.hooks.capture`: stages and hooks run in the order the
    contexts were entered, so ``quantize_model`` outside ``capture`` profiles the quantized model.
    ``block_rows``: query rows per attention block (see :mod:`outlierscope.hooks.attention`); per_head
    and per_tensor logit scales then take a first pass over the blocks for the absmax: same result
    (q, k and v are quantized once per call, whole; P per row, inside its block).
    Everything is restored in ``finally``.
    """
    spec = as_attn_quant(spec)
    check_layers(spec, len(decoder_layers(model)), attention_layers(model) if _touches_attention(spec) else None)
    stage = _logit_stage(spec) if isinstance(spec, QuantSpec) else attention_stage(spec)
    linear = quantize_linears(model, spec, calibration, linear_error) if isinstance(spec, AttnQuant) \
        else contextlib.nullcontext()
    # 16 bits too goes through the same attention function (spec returns the logits unchanged), for identical arithmetic
    with linear, attention_stages(model, stage, block_rows=block_rows):
        yield spec


def _touches_attention(spec) -> bool:
    return not isinstance(spec, AttnQuant) or spec.has_attention or not spec.has_linear


quantize_attention = quantize_model  # the name before linear layers joined


def quantize_weights(model: nn.Module, mode: str) -> nn.Module:
    """Replace the decoder's ``nn.Linear`` layers (not embeddings or the LM head) by bitsandbytes
    ``Linear8bitLt`` (int8, absmax per output row) or ``Linear4bit`` (NF4, block 64), in place.

    Works on x86 CPUs with bitsandbytes >= 0.47. Returns the model.
    """
    if mode not in WEIGHT_MODES:
        raise OutlierscopeError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {mode!r}")
    if mode == "none":
        return model
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise OutlierscopeError(f"weight quantization needs bitsandbytes: {e}") from None
    dtype = next(model.parameters()).dtype
    for layer in decoder_layers(model):
        for child in list(layer.modules()):
            for cname, lin in list(child.named_children()):
                if type(lin) is not nn.Linear:
                    continue
                if mode == "int8":
                    new = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                              has_fp16_weights=False, threshold=0.0)
                else:
                    new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                            compute_dtype=dtype, quant_type="nf4")
                new.load_state_dict(lin.state_dict())
                new = new.to(lin.weight.device)  # quantizes the weights
                setattr(child, cname, new)
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device))
    except Exception as e:  # a backend that does not run here: say so instead of failing later
        raise OutlierscopeError(f"bitsandbytes {mode} weights do not run on this device ({type(e).__name__}: {e})") from None
    return model
