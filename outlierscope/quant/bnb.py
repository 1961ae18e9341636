"""bitsandbytes' own weight quantization (``w=bnb-int8``, ``w=bnb-nf4``): every ``nn.Linear`` of the decoder layers
(not embeddings or the LM head) replaced by ``Linear8bitLt`` (int8, absmax per output row, threshold 0) or
``Linear4bit`` (NF4, blocks of 64), for as long as a context lasts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.points import decoder_layers
from outlierscope.quant.numerics.names import WEIGHT_MODES


def _bnb_linear(lin: nn.Linear, mode: str, dtype: torch.dtype) -> nn.Module:
    """bitsandbytes' module for ``lin``, its weights quantized on ``lin``'s device."""
    import bitsandbytes as bnb

    if mode == "int8":
        new = bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                  has_fp16_weights=False, threshold=0.0)
    else:
        new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=dtype,
                                quant_type="nf4")
    new.load_state_dict(lin.state_dict())
    return new.to(lin.weight.device)  # quantizes the weights


def _swap_in(model: nn.Module, mode: str) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Replace the decoder's linears by bitsandbytes' modules; returns (parent, name, original) to put back."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise OutlierscopeError(f"w=bnb-{mode} needs bitsandbytes: {e}") from None
    dtype = next(model.parameters()).dtype
    swapped = []
    for layer in decoder_layers(model):
        for child in list(layer.modules()):
            for cname, lin in list(child.named_children()):
                if type(lin) is nn.Linear:
                    setattr(child, cname, _bnb_linear(lin, mode, dtype))
                    swapped.append((child, cname, lin))
    return swapped


def _check_runs(model: nn.Module, mode: str) -> None:
    """A backend that does not run here: say so now instead of failing in the middle of an evaluation."""
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device))
    except Exception as e:
        raise OutlierscopeError(f"bitsandbytes {mode} weights do not run on this device ({type(e).__name__}: {e})") from None


@contextlib.contextmanager
def bnb_weights(model: nn.Module, mode: str) -> Iterator[nn.Module]:
    """bitsandbytes weights in the decoder's linears while the context lasts; the originals are put back in ``finally``.

    The original modules are kept meanwhile (their memory stays allocated). Works on x86 CPUs with bitsandbytes >=
    0.47.

    Args:
        model: the model.
        mode: ``int8`` or ``nf4``; ``none``: nothing.

    Yields:
        The model."""
    if mode not in WEIGHT_MODES:
        raise OutlierscopeError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {mode!r}")
    swapped = _swap_in(model, mode) if mode != "none" else []
    try:
        if swapped:
            _check_runs(model, mode)
        yield model
    finally:
        for parent, cname, lin in swapped:
            setattr(parent, cname, lin)
