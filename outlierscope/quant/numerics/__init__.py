"""Numbers: the formats a tensor is rounded to and the pure primitives that round it (absmax scales, fake
quantization, minifloats, MX and NVFP4 blocks, zero points). No state; nothing here mutates its input."""
