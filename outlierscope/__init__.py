"""outlierscope: activation outliers and low-bit attention quantization of transformer LMs.

Reference: Ye et al., Differential Transformer (arXiv 2410.05258), Table 5 and Figure 8.

One import line for notebooks::

    from outlierscope import load_model, capture, OutlierStats, QuantSpec, RECIPES, \\
        quantize_model, profile_model, evaluate, sweep, load_run

``QuantSpec`` is the one spec of everything quantized (the paper's logits, attention kernels, linear layers,
bitsandbytes weights): ``QuantSpec.logits(bits=4)``, ``QuantSpec.parse("sage2-int4")``, ``QuantSpec.parse("w8a8; kivi-4bit")``,
``QuantSpec.parse("w=bnb-nf4")``. The names before it (``AttnQuant``, ``quantize_attention``, ``quantize_weights``)
still resolve for one release, with a DeprecationWarning.

The names are imported on first use (``import outlierscope`` stays light and changes no environment
variable or logging level).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "OutlierscopeError": "outlierscope.errors",
    "ParamError": "outlierscope.errors",
    "load_model": "outlierscope.models.loading",
    "LoadedModel": "outlierscope.models.loading",
    "generate": "outlierscope.models.loading",
    "inspect_model": "outlierscope.models.record",
    "ModelRecord": "outlierscope.models.record",
    "PairConfig": "outlierscope.models.presets",
    "DEFAULT_PAIR": "outlierscope.models.presets",
    "capture": "outlierscope.hooks.capture",
    "Observation": "outlierscope.hooks.capture",
    "POINT_PRESETS": "outlierscope.hooks.points",
    "OutlierStats": "outlierscope.analysis.outliers",
    "QuantSpec": "outlierscope.quant.specs.spec",
    "TensorQuant": "outlierscope.quant.specs.parts",
    "RECIPES": "outlierscope.quant.specs.recipes",
    "quantize_model": "outlierscope.quant.apply",
    "calibration_for": "outlierscope.quant.weights.calibration",
    "LinearErrorStats": "outlierscope.analysis.linear_error",
    "absmax_scale": "outlierscope.quant.numerics.primitives",
    "fake_quant": "outlierscope.quant.numerics.primitives",
    "fused_kernels": "outlierscope.quant.numerics.fused",
    "evaluate": "outlierscope.eval.evaluate",
    "EvalResult": "outlierscope.eval.evaluate",
    "EvalOptions": "outlierscope.eval.evaluate",
    "profile_model": "outlierscope.runs.profile",
    "profile": "outlierscope.runs.profile",
    "ProfileSettings": "outlierscope.runs.profile",
    "ProfileResult": "outlierscope.runs.profile_result",
    "sweep": "outlierscope.runs.sweep",
    "SweepSettings": "outlierscope.runs.sweep_settings",
    "SweepResult": "outlierscope.runs.sweep_tables",
    "sensitivity": "outlierscope.runs.sensitivity",
    "SensitivitySettings": "outlierscope.runs.sensitivity_settings",
    "measure_attention_error": "outlierscope.analysis.attention_error",
    "AttentionErrorStats": "outlierscope.analysis.attention_error",
    "reproduce": "outlierscope.runs.reproduce",
    "ReproduceSettings": "outlierscope.runs.reproduce",
    "perplexity": "outlierscope.runs.perplexity",
    "PerplexitySettings": "outlierscope.runs.perplexity",
    "compare_quant": "outlierscope.runs.compare",
    "CompareSettings": "outlierscope.runs.compare",
    "load_text": "outlierscope.data.running_text",
    "protocol_windows": "outlierscope.eval.windows",
    "score_windows": "outlierscope.eval.perplexity",
    "score_pairs": "outlierscope.eval.perplexity",
    "score_sides": "outlierscope.eval.perplexity",
    "Side": "outlierscope.eval.perplexity",
    "TokenScores": "outlierscope.eval.perplexity",
    "load_run": "outlierscope.report.load",
    "RunResults": "outlierscope.report.load",
}
_MODULES = {"plots": "outlierscope.report.plots", "activation_plots": "outlierscope.report.activation_plots"}  # public name -> module exported as a whole
# the names before one spec type (#47): resolved for one release, warning, never cached or listed in __all__
_DEPRECATED = {"AttnQuant": "outlierscope.quant.specs.recipe", "quantize_attention": "outlierscope.quant.apply",
               "quantize_weights": "outlierscope.quant.bnb", "as_attn_quant": "outlierscope.quant.apply"}
__all__ = sorted(_EXPORTS.keys() | _MODULES.keys())


def __getattr__(name: str):
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
        globals()[name] = value
        return value
    if name in _DEPRECATED:
        from outlierscope.quant.specs.recipe import deprecated_name

        return deprecated_name(importlib.import_module(_DEPRECATED[name]), name)
    module = _EXPORTS.get(name)
    if module is None:
        import difflib

        close = difflib.get_close_matches(name, __all__, n=3)
        raise AttributeError(f"module 'outlierscope' has no attribute {name!r}"
                             + (f"; did you mean {', '.join(close)}?" if close else ""))
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
