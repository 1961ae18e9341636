"""Deprecated path (see :mod:`outlierscope.quant._moved`): :mod:`outlierscope.quant.weights.awq`."""

from outlierscope.quant._moved import moved

moved(__name__, "outlierscope.quant.weights.awq")
