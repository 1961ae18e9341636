"""Before #47 the spec type of attention kernels and linear layers (``AttnQuant``) and the recipes lived here. The
one spec type is :class:`outlierscope.quant.specs.spec.QuantSpec`; the recipes are :mod:`outlierscope.quant.specs.recipes`.
This module keeps the old names importable for one release: ``AttnQuant`` warns and is ``QuantSpec``."""

from __future__ import annotations

import warnings

from outlierscope.quant.specs.parts import ALL_TARGETS, LINEAR_TARGETS, TARGETS, TensorQuant  # noqa: F401 (old import path)
from outlierscope.quant.specs.recipes import RECIPES, Recipe  # noqa: F401 (old import path)
from outlierscope.quant.specs.spec import LINEAR_RECIPES, QuantSpec  # noqa: F401 (old import path)

ATTNQUANT_DEPRECATED = ("AttnQuant is deprecated: it is outlierscope.QuantSpec, the one spec type of logits, attention "
                        "kernels, linear layers and bitsandbytes weights")


def __getattr__(name: str):
    if name == "AttnQuant":
        warnings.warn(ATTNQUANT_DEPRECATED, DeprecationWarning, stacklevel=2)
        return QuantSpec
    raise AttributeError(f"module 'outlierscope.quant.specs.recipe' has no attribute {name!r}")


def deprecated_name(module, name: str):
    """``module.name`` for a package's ``__getattr__``: ``AttnQuant`` warns at the line that asked for it (two frames
    up, the user's, where Python's default filters show a DeprecationWarning); the old functions warn when called."""
    if name == "AttnQuant":
        warnings.warn(ATTNQUANT_DEPRECATED, DeprecationWarning, stacklevel=3)
        return QuantSpec
    return getattr(module, name)
