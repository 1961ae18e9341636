"""Weights calibrated layer after layer: GPTQ and AWQ (their arithmetic and their passes over a model), the
shared sequential machinery, and the calibration of a linear spec (SmoothQuant's scales included)."""
