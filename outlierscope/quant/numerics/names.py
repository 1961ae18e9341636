"""The names of the quantization choices, without importing torch (the CLI builds its choices from them)."""

UNQUANTIZED_BITS = 16  # the paper's axis: 16 bits means unquantized
FORMATS = ("int", "e4m3", "e5m2")  # integer absmax, or an FP8 format
GRANULARITIES = ("per_tensor", "per_head", "per_row")
BACKENDS = ("torch", "bitsandbytes")
WEIGHT_MODES = ("none", "int8", "nf4")  # linear weights through bitsandbytes
