"""Observation points, the logit-exposing attention function and the ``capture`` context manager."""

from outlierscope.hooks.capture import Capture, Observation, capture
from outlierscope.hooks.points import DEFAULT_POINTS, resolve_points

__all__ = ["DEFAULT_POINTS", "Capture", "Observation", "capture", "resolve_points"]
