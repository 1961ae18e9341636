"""The spec and its text form: :class:`~outlierscope.quant.specs.spec.QuantSpec`, its parts
(:class:`~outlierscope.quant.specs.parts.TensorQuant`), the named recipes and the GPTQ / AWQ settings."""
