"""The spec and its text form: ``QuantSpec``, its parts
(``TensorQuant``), the named recipes and the GPTQ / AWQ settings."""
