"""The names of the quantization choices: the paper's axis, targets, granularities, backends."""

UNQUANTIZED_BITS = 16  # the paper's axis: 16 bits means unquantized
TARGETS = ("logits", "q", "k", "v", "probs")  # inside attention
LINEAR_TARGETS = ("a", "w")  # a linear layer's input (activations) and weight
ALL_TARGETS = TARGETS + LINEAR_TARGETS
GRANULARITIES = ("per_tensor", "per_head", "per_row")
BACKENDS = ("torch", "bitsandbytes")
WEIGHT_MODES = ("none", "int8", "nf4")  # linear weights through bitsandbytes
