"""Apply quantization to a model: attention logits (our primitives) and weights (bitsandbytes).

What quantization does to attention is measured in :mod:`outlierscope.analysis.attention_error`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.attention import LogitContext, Stage, attention_stages
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


def absmax_reduction(spec: QuantSpec):
    """A :class:`~outlierscope.hooks.attention.Stage` ``reduce`` for blocked attention: a scale over query rows
    (per_head, per_tensor) is the absmax over all blocks of rows; None for a spec whose scale stays in a block."""
    if not spec.spans_rows:
        return None
    return lambda ctx, logits: spec.absmax(logits, ctx.valid) if spec.applies_to(ctx.layer) else None


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

    def quantize(ctx: LogitContext, logits):
        return spec(logits, ctx.valid, ctx.reduced(stage)) if spec.applies_to(ctx.layer) else logits

    stage = Stage(apply=quantize, reduce=absmax_reduction(spec), name=f"quantize {spec.label}")
    # 16 bits too goes through the same attention function (spec returns the logits unchanged), for identical arithmetic
    with attention_stages(model, stage, block_rows=block_rows):
        yield spec


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
