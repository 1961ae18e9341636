"""Deprecated path (see :mod:`outlierscope.quant._moved`): :mod:`outlierscope.quant.attention.logits`."""

from outlierscope.quant._moved import moved

moved(__name__, "outlierscope.quant.attention.logits")
