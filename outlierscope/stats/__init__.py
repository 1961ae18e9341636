"""Streaming statistics that merge exactly: top-k, histograms, moments, outlier statistics, paired tests."""
