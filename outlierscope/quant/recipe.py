"""Before #47 the spec type of attention kernels and linear layers (``AttnQuant``) and the recipes lived here. The
one spec type is :class:`outlierscope.quant.spec.QuantSpec`; the recipes are :mod:`outlierscope.quant.recipes`.
This module keeps the old names importable for one release: ``AttnQuant`` warns and is ``QuantSpec``."""

from __future__ import annotations

import warnings

from outlierscope.quant.parts import ALL_TARGETS, LINEAR_TARGETS, TARGETS, TensorQuant  # noqa: F401 (old import path)
from outlierscope.quant.recipes import RECIPES, Recipe  # noqa: F401 (old import path)
from outlierscope.quant.spec import LINEAR_RECIPES, QuantSpec  # noqa: F401 (old import path)


def __getattr__(name: str):
    if name == "AttnQuant":
        warnings.warn("AttnQuant is deprecated: it is outlierscope.QuantSpec, the one spec type of logits, attention "
                      "kernels, linear layers and bitsandbytes weights", DeprecationWarning, stacklevel=2)
        return QuantSpec
    raise AttributeError(f"module 'outlierscope.quant.recipe' has no attribute {name!r}")
