"""A float64 model computed in float64 in every operation of its own code.

transformers' modeling code upcasts to float32 wherever a bf16/fp16 model needs it, whatever the model's dtype:
``LlamaRMSNorm`` and its kin cast the hidden states ``.to(torch.float32)``, ``LlamaRotaryEmbedding`` builds its
inverse frequencies with ``torch.arange(..., dtype=torch.float)`` and its angles with ``position_ids.float()``, MoE
routers take ``softmax(..., dtype=torch.float)``, DiffLlama's lambda a ``sum(..., dtype=torch.float32)``. In a float64
model those casts round the values to float32 and back (about 3e-5 nats per token on SmolLM2).

``Float64Mode`` is a ``TorchFunctionMode`` that widens each such request made by the model's code::

    t.float()                 -> t.double()
    t.to(torch.float32)       -> t.to(torch.float64)       (also .to(device, dtype), .to(dtype=...), .type(...))
    f(..., dtype=float32)     -> f(..., dtype=float64)     (arange, zeros, softmax, sum, ...)

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_TO = {torch.Tensor.to, torch.Tensor.type}
_FLOAT = torch.Tensor.float


def _model_code(depth: int = 2) -> bool:
    """Whether the first caller outside torch (``depth`` frames up, past this mode) is transformers' code."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name == "torch" or name.startswith("torch.")):
            return name.startswith("transformers")
        frame = frame.f_back
    return False


def _widen_args(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with every float32 dtype asked for made float64 (positional only for ``Tensor.to/type``)."""
    if kwargs.get("dtype") is torch.float32:
        kwargs = {**kwargs, "dtype": torch.float64}
    if func in _TO and any(a is torch.float32 for a in args[1:]):
        args = tuple(torch.float64 if (i > 0 and a is torch.float32) else a for i, a in enumerate(args))
    return args, kwargs


class Float64Mode(TorchFunctionMode):
    """Widen the float32 casts and ``dtype=torch.float32`` arguments of transformers' code to float64 (module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _FLOAT:
            if _model_code():
                func, kwargs = torch.Tensor.to, {**kwargs, "dtype": torch.float64}
        elif (kwargs.get("dtype") is torch.float32 or (func in _TO and any(a is torch.float32 for a in args[1:]))) and _model_code():
            args, kwargs = _widen_args(func, args, kwargs)
        return func(*args, **kwargs)


def is_float64(model) -> bool:
    """Whether a model's floating parameters are float64.

    Args:
        model: the model."""
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    return p is not None and p.dtype == torch.float64


@contextlib.contextmanager
def float64_model(model) -> Iterator[None]:
    """Inside, a float64 model's forwards are float64 in every operation of its own code; others are unchanged.

    Args:
        model: the model (None, or not float64: nothing is entered)."""
    if model is None or not is_float64(model):
        yield
        return
    with Float64Mode():
        yield


def build_options(dtype: str) -> dict:
    """The ``from_pretrained`` / ``from_config`` options a model of a dtype needs (float64 MoE experts run eager).

    Args:
        dtype: the model's dtype."""
    return {"experts_implementation": "eager"} if dtype == "float64" else {}


def float64_build(dtype: str):
    """The context a model of a dtype is built in: ``Float64Mode`` for float64 (its buffers become float64), else none.

    Args:
        dtype: the model's dtype."""
    return Float64Mode() if dtype == "float64" else contextlib.nullcontext()
