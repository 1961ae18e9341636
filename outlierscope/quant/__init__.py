"""Post-training quantization: attention (logits, q/k/v, P), linear layers (inputs and weights), bitsandbytes weights."""

import importlib

# public name -> module; imported on first use, so that `outlierscope.quant.names` stays free of torch
_EXPORTS = {"quantize_attention": "apply", "quantize_model": "apply", "quantize_weights": "apply",
            "quantize_linears": "linear", "calibration_for": "linear", "LINEAR_RECIPES": "recipe", "absmax_scale": "primitives",
            "fake_quant": "primitives", "quantize_absmax": "primitives", "QuantSpec": "spec",
            "AttnQuant": "recipe", "TensorQuant": "recipe", "RECIPES": "recipe"}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'outlierscope.quant' has no attribute {name!r}")
    return getattr(importlib.import_module(f"outlierscope.quant.{_EXPORTS[name]}"), name)

__all__ = ["LINEAR_RECIPES", "RECIPES", "AttnQuant", "QuantSpec", "TensorQuant", "absmax_scale", "calibration_for",
           "fake_quant", "quantize_absmax", "quantize_attention", "quantize_linears", "quantize_model", "quantize_weights"]
