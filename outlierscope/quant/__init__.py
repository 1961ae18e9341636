"""Post-training quantization: one spec type (``QuantSpec``) for attention (logits,
q/k/v, P), linear layers (inputs and weights) and bitsandbytes weights, applied by one ``quantize_model``."""

import importlib

# public name -> module; imported on first use
_EXPORTS = {"quantize_model": "apply", "quantize_linears": "linears.schemes", "calibration_for": "weights.calibration",
            "bnb_weights": "bnb", "LINEAR_RECIPES": "specs.spec", "absmax_scale": "numerics.primitives",
            "fake_quant": "numerics.primitives", "quantize_absmax": "numerics.primitives", "QuantSpec": "specs.spec",
            "TensorQuant": "specs.parts", "RECIPES": "specs.recipes"}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'outlierscope.quant' has no attribute {name!r}")
    return getattr(importlib.import_module(f"outlierscope.quant.{module}"), name)


__all__ = sorted(_EXPORTS)
