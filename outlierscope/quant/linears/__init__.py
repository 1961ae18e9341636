"""Quantized linear layers: the sites a spec chooses, the tensor operations of a linear scheme (activations,
weights, SmoothQuant, rotations, LLM.int8) and the context that applies them."""
