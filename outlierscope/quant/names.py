"""Deprecated path (see :mod:`outlierscope.quant._moved`): :mod:`outlierscope.quant.numerics.names`."""

from outlierscope.quant._moved import moved

moved(__name__, "outlierscope.quant.numerics.names")
