"""Deprecated path (see :mod:`outlierscope.quant._moved`): :mod:`outlierscope.quant.specs.spec`."""

from outlierscope.quant._moved import moved

moved(__name__, "outlierscope.quant.specs.spec")
