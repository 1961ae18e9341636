"""Experiments built on the layers below: profile, sweep and reproduce, with result objects that save themselves."""
