"""Apply quantization to a model: attention logits (our primitives) and weights (bitsandbytes)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.attention import LogitContext, attention_stages
from outlierscope.hooks.points import attention_layers, decoder_layers
from outlierscope.quant.names import WEIGHT_MODES
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


def _blocked_amax(stage, spec: QuantSpec, ctx: LogitContext):
    """The absmax ``stage``'s prepass kept over all blocks of rows; None with one block (the logits' own)."""
    return ctx.state[stage] if spec.spans_rows and ctx.state is not None else None


def _attach_prepass(stage, spec: QuantSpec):
    """Blocked attention: a scale over query rows (per_head, per_tensor) takes the absmax over all blocks first."""
    def prepass(ctx: LogitContext, logits) -> None:
        if spec.applies_to(ctx.layer):
            amax = spec.absmax(logits, ctx.valid)
            prev = ctx.state.get(stage)
            ctx.state[stage] = amax if prev is None else torch.maximum(prev, amax)

    if spec.spans_rows:
        stage.prepass = prepass
    return stage


@contextlib.contextmanager
def quantize_attention(model: nn.Module, spec: QuantSpec, block_rows: int | None = None) -> Iterator[QuantSpec]:
    """Quantize ``layers.{i}.attn.logits`` after scaling, before soft-capping, masking and softmax.

    For DiffLlama both maps are quantized together (they are one logits tensor, heads [0, H/2) and
    [H/2, H)). Composes with :func:`outlierscope.hooks.capture`: stages run in the order the
    contexts were entered, so ``quantize_attention`` outside ``capture`` profiles the quantized logits.
    ``block_rows``: query rows per attention block (see :mod:`outlierscope.hooks.attention`); per_head
    and per_tensor scales then take a first pass over the blocks for the absmax: same result.
    Everything is restored in ``finally``.
    """
    check_layers(spec, len(decoder_layers(model)), attention_layers(model))

    def stage(ctx: LogitContext, logits):
        if not spec.applies_to(ctx.layer):
            return logits
        return spec(logits, ctx.valid, _blocked_amax(stage, spec, ctx))

    _attach_prepass(stage, spec)
    # 16 bits too goes through the same attention function (spec returns the logits unchanged), for identical arithmetic
    with attention_stages(model, stage, block_rows=block_rows):
        yield spec


@contextlib.contextmanager
def measure_attention_error(model: nn.Module, spec: QuantSpec, stats, block_rows: int | None = None) -> Iterator:
    """Stream into ``stats`` (:class:`~outlierscope.stats.attention_error.AttentionErrorStats`) what quantizing the
    logits with ``spec`` does to each layer's attention, without changing the model: an observing stage
    quantizes a copy and compares. Entered before :func:`quantize_attention` with the same spec, it
    measures each layer against the unquantized logits of the same forward (same layer input)::

        stats = AttentionErrorStats(n_layers, n_heads)
        with measure_attention_error(model, spec, stats), quantize_attention(model, spec):
            model(input_ids=ids, attention_mask=mask)
    """
    def stage(ctx: LogitContext, logits):
        if spec.applies_to(ctx.layer) and not spec.is_identity:
            stats.update(ctx.layer, logits, spec(logits, ctx.valid, _blocked_amax(stage, spec, ctx)), ctx.valid, ctx.value)
        return logits

    stage.observes = True  # returns its input: runs once per layer (not again in DiffLlama's second call)
    _attach_prepass(stage, spec)
    with attention_stages(model, stage, block_rows=block_rows):
        yield stats


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
