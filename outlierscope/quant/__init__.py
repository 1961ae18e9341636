"""Post-training quantization: one spec type (:class:`~outlierscope.quant.specs.spec.QuantSpec`) for attention (logits,
q/k/v, P), linear layers (inputs and weights) and bitsandbytes weights, applied by one ``quantize_model``."""

import importlib

# public name -> module; imported on first use, so that `outlierscope.quant.numerics.names` stays free of torch
_EXPORTS = {"quantize_model": "apply", "quantize_linears": "linears.schemes", "calibration_for": "weights.calibration",
            "bnb_weights": "bnb", "LINEAR_RECIPES": "specs.spec", "absmax_scale": "numerics.primitives",
            "fake_quant": "numerics.primitives", "quantize_absmax": "numerics.primitives", "QuantSpec": "specs.spec",
            "TensorQuant": "specs.parts", "RECIPES": "specs.recipes"}
# the names before one spec type (#47): resolved for one release, with a DeprecationWarning, not in __all__
_DEPRECATED = {"AttnQuant": "specs.recipe", "quantize_attention": "apply", "quantize_weights": "bnb"}


def __getattr__(name: str):
    module = _EXPORTS.get(name) or _DEPRECATED.get(name)
    if module is None:
        raise AttributeError(f"module 'outlierscope.quant' has no attribute {name!r}")
    if name in _DEPRECATED:
        from outlierscope.quant.specs.recipe import deprecated_name

        return deprecated_name(importlib.import_module(f"outlierscope.quant.{module}"), name)
    return getattr(importlib.import_module(f"outlierscope.quant.{module}"), name)


__all__ = sorted(_EXPORTS)
