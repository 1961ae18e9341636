"""Deprecated path (see :mod:`outlierscope.quant._moved`): :mod:`outlierscope.quant.weights.sequential`."""

from outlierscope.quant._moved import moved

moved(__name__, "outlierscope.quant.weights.sequential")
