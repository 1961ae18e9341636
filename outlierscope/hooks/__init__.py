"""Observation points (attention internals, module inputs and outputs, presets), the attention function that exposes
and transforms them, and the ``capture`` context manager."""

from outlierscope.hooks.capture import Capture, Observation, capture
from outlierscope.hooks.points import DEFAULT_POINTS, PRESETS, all_points, resolve_points

__all__ = ["DEFAULT_POINTS", "PRESETS", "Capture", "Observation", "all_points", "capture", "resolve_points"]
