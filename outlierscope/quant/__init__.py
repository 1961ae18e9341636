"""Absmax post-training quantization of attention logits (and bitsandbytes weights)."""

from outlierscope.quant.apply import quantize_attention, quantize_weights
from outlierscope.quant.primitives import absmax_scale, fake_quant, quantize_absmax
from outlierscope.quant.spec import QuantSpec

__all__ = ["QuantSpec", "absmax_scale", "fake_quant", "quantize_absmax", "quantize_attention", "quantize_weights"]
