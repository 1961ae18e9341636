"""Deprecated path (see :mod:`outlierscope.quant._moved`): the linear layers are
:mod:`outlierscope.quant.linears.sites` (which linears), :mod:`outlierscope.quant.linears.schemes` (the context that
quantizes them) and :mod:`outlierscope.quant.weights.calibration` (their calibration and checks). The public names
resolve from here for one release."""

import warnings

from outlierscope.quant._moved import REMOVED_IN, _importer_level
from outlierscope.quant.linears.schemes import HOLD_FRACTION, HeldWeights, holds_fit, quantize_linears, smoothing  # noqa: F401
from outlierscope.quant.linears.sites import (  # noqa: F401
    HEAD,
    Calibration,
    LinearSite,
    input_groups,
    layer_linears,
    linear_sites,
    needs_calibration,
    token_local,
)
from outlierscope.quant.weights.calibration import (  # noqa: F401
    calibrate,
    calibrate_layers_alone,
    calibration_for,
    calibration_record,
    calibration_records,
    check_calibration,
    check_linear_shapes,
)

warnings.warn("outlierscope.quant.linear moved to outlierscope.quant.linears.sites / .schemes and "
              f"outlierscope.quant.weights.calibration; the old path goes in {REMOVED_IN}", DeprecationWarning,
              stacklevel=_importer_level(__name__))
