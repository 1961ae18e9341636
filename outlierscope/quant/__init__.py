"""Absmax post-training quantization of attention logits (and bitsandbytes weights)."""

import importlib

# public name -> module; imported on first use, so that `outlierscope.quant.names` stays free of torch
_EXPORTS = {"quantize_attention": "apply", "quantize_weights": "apply", "absmax_scale": "primitives",
            "fake_quant": "primitives", "quantize_absmax": "primitives", "QuantSpec": "spec",
            "AttnQuant": "recipe", "TensorQuant": "recipe", "RECIPES": "recipe"}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'outlierscope.quant' has no attribute {name!r}")
    return getattr(importlib.import_module(f"outlierscope.quant.{_EXPORTS[name]}"), name)

__all__ = ["RECIPES", "AttnQuant", "QuantSpec", "TensorQuant", "absmax_scale", "fake_quant", "quantize_absmax",
           "quantize_attention", "quantize_weights"]
