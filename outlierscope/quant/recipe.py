"""Deprecated path (see :mod:`outlierscope.quant._moved`): :mod:`outlierscope.quant.specs.recipe`."""

from outlierscope.quant._moved import moved

moved(__name__, "outlierscope.quant.specs.recipe")
