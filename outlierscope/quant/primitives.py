"""Deprecated path (see :mod:`outlierscope.quant._moved`): :mod:`outlierscope.quant.numerics.primitives`."""

from outlierscope.quant._moved import moved

moved(__name__, "outlierscope.quant.numerics.primitives")
