"""outlierscope: activation outliers and low-bit quantization of attention in transformer language models.

Reference: Ye et al., Differential Transformer (arXiv 2410.05258), Table 5 and Figure 8. The names a notebook needs
import from here, on first use (``import outlierscope`` stays light and changes no environment variable)::

    from outlierscope import load_model, capture, OutlierStats, QuantSpec, quantize_model, evaluate, sweep, load_run

Everything else is public in its sub-package (``outlierscope.quant.numerics.registry``, ...) and in the API reference.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

# public name -> module that defines it
_EXPORTS = {
    "OutlierscopeError": "outlierscope.errors",
    "load_model": "outlierscope.models.loading",
    "inspect_model": "outlierscope.models.record",
    "DEFAULT_PAIR": "outlierscope.models.presets",
    "capture": "outlierscope.hooks.capture",
    "OutlierStats": "outlierscope.analysis.outliers",
    "QuantSpec": "outlierscope.quant.specs.spec",
    "RECIPES": "outlierscope.quant.specs.recipes",
    "quantize_model": "outlierscope.quant.apply",
    "evaluate": "outlierscope.eval.evaluate",
    "load_text": "outlierscope.data.running_text",
    "profile_model": "outlierscope.runs.profile",
    "profile": "outlierscope.runs.profile",
    "ProfileSettings": "outlierscope.runs.profile",
    "sweep": "outlierscope.runs.sweep",
    "SweepSettings": "outlierscope.runs.sweep_settings",
    "sensitivity": "outlierscope.runs.sensitivity",
    "SensitivitySettings": "outlierscope.runs.sensitivity_settings",
    "perplexity": "outlierscope.runs.perplexity",
    "PerplexitySettings": "outlierscope.runs.perplexity",
    "reproduce": "outlierscope.runs.reproduce",
    "ReproduceSettings": "outlierscope.runs.reproduce",
    "compare_quant": "outlierscope.runs.compare",
    "CompareSettings": "outlierscope.runs.compare",
    "load_run": "outlierscope.report.load",
}
_MODULES = {"plots": "outlierscope.report.plots", "activation_plots": "outlierscope.report.activation_plots"}  # whole modules
__all__ = sorted(_EXPORTS.keys() | _MODULES.keys())


def __getattr__(name: str):
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
        globals()[name] = value
        return value
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
