"""Quantized attention: the q/k/v/P operations of the recipes (as low-bit kernels do them) and the paper's
logits operator."""
