"""Deprecated path (see :mod:`outlierscope.quant._moved`): :mod:`outlierscope.quant.weights.gptq`."""

from outlierscope.quant._moved import moved

moved(__name__, "outlierscope.quant.weights.gptq")
