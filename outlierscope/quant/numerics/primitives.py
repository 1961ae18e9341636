"""Pure tensor primitives of absmax quantization (torchao style: no state, never mutate the input).

* ``absmax(x, dims, valid)``: max |x| over ``dims`` among valid entries (keepdim).
* ``absmax_scale(x, bits, dims, valid)``: max |x| over ``dims`` among valid entries / qmax, where
  qmax = 2^(bits-1) - 1 for integers and the largest finite value for FP8 formats. Computed in
  float32 at least (float64 for float64 input), kept with ``keepdim=True``.
* ``fake_quant(x, scale, bits)``: symmetric round-to-nearest onto [-qmax, qmax] * scale, ties to
  even (``torch.round``), dequantized back to ``x``'s dtype. FP8: the cast to ``float8_e4m3fn`` /
  ``float8_e5m2`` (round to nearest even) after dividing by the scale.
* ``fmt="fint"``: the full-range symmetric integer grid of compressed-tensors and torchao (``MappingType.SYMMETRIC``):
  scale = absmax / ((2^bits - 1) / 2) (int8: / 127.5), values clamped to [-2^(bits-1), 2^(bits-1) - 1]; ``int``
  is the restricted range (absmax / 127 onto [-127, 127]: SmoothQuant's, bitsandbytes', vLLM's dynamic kernels).

A zero scale (all zeros, or no valid entry) returns the input unchanged: never NaN or inf.
A non-finite scale (an inf in the input) also returns the input unchanged.
Invalid (masked) entries do not enter the scale and come back unchanged.
"""

from __future__ import annotations

import torch

from outlierscope.quant.numerics.names import UNQUANTIZED_BITS

INT_BITS = tuple(range(2, 16))  # integer absmax formats; 16 means "unquantized"
FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
GRIDS = ("int", *FP8_FORMATS, "fint")  # the grids of absmax quantization ("fint": the full-range integer grid)


def check_bits(bits: int, fmt: str = "int") -> None:
    """Refuse a grid or width absmax quantization does not take.

    Args:
        bits: the width: 2..16 for ``int`` and ``fint``, 8 for an FP8 format (16: unquantized).
        fmt: the grid (``GRIDS``).

    Raises:
        ValueError: naming what was expected and what was received."""
    if fmt not in GRIDS:
        raise ValueError(f"format must be one of {', '.join(GRIDS)}, got {fmt!r}")
    if fmt in ("int", "fint") and (not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= UNQUANTIZED_BITS):
        raise ValueError(f"bits must be in 2..16 (16 = unquantized), got {bits!r}")
    if fmt in FP8_FORMATS and bits not in (8, UNQUANTIZED_BITS):
        raise ValueError(f"bits for format {fmt} must be 8 (or 16 = unquantized), got {bits!r}")


def qmax(bits: int, fmt: str = "int") -> float:
    """What absmax maps to on the grid: its largest magnitude (``fint``: the middle of its asymmetric range).

    Args:
        bits: the width.
        fmt: the grid (``GRIDS``)."""
    check_bits(bits, fmt)
    if fmt == "int":
        return float(2 ** (bits - 1) - 1)
    if fmt == "fint":
        return (2**bits - 1) / 2
    return float(torch.finfo(FP8_FORMATS[fmt]).max)


def every(mask: torch.Tensor) -> bool:
    """Whether every entry of a mask holds, to skip a mask that changes nothing (the common case).

    False while ``torch.compile`` traces (``fused_kernels``): the masked form gives the same bytes and the graph does
    not break on reading a tensor's value.

    Args:
        mask: a bool tensor."""
    return not torch.compiler.is_compiling() and bool(mask.all())


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def absmax(x: torch.Tensor, dims, valid: torch.Tensor | None = None) -> torch.Tensor:
    """max |x| over ``dims`` (keepdim) among valid entries, in float32 at least; zero where nothing is valid.

    Max is exact, so the absmax of a tensor equals the max of its blocks' absmax (blocked attention).

    Args:
        x: the tensor.
        dims: the dimensions reduced.
        valid: bool, broadcastable to ``x``: the entries that count; None: all."""
    a = x.to(_work_dtype(x)).abs()  # a new tensor: the in-place fill below never touches x
    if valid is not None:
        a.masked_fill_(~valid, 0.0)
    return a.amax(dim=dims, keepdim=True)


def absmax_scale(x: torch.Tensor, bits: int, dims, valid: torch.Tensor | None = None, fmt: str = "int") -> torch.Tensor:
    """The absmax scale of ``x`` over ``dims`` (keepdim) among valid entries; zero where nothing is valid.

    Args:
        x: the tensor.
        bits: the format's width.
        dims: the dimensions that share a scale.
        valid: bool, broadcastable to ``x``: the entries that count; None: all.
        fmt: the grid (``int``, ``fint`` or an FP8 format).

    Returns:
        ``max|x| / qmax(bits, fmt)``, in float32 at least."""
    return absmax(x, dims, valid) / qmax(bits, fmt)


def fake_quant(x: torch.Tensor, scale: torch.Tensor, bits: int, fmt: str = "int",
               valid: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize ``x`` with ``scale``; a new tensor in ``x``'s dtype, ``x`` untouched.

    Args:
        x: the tensor.
        scale: the scale, broadcastable to ``x``; where it is not a normal float, ``x`` comes back unchanged.
        bits: the format's width (16: unquantized, a copy).
        fmt: the grid: ``int`` (symmetric, round half to even), ``fint`` (the full two's-complement range) or an FP8
            format.
        valid: bool, broadcastable to ``x``: the entries to quantize (the others come back unchanged); None: all.

    Returns:
        The dequantized tensor."""
    check_bits(bits, fmt)
    if bits == UNQUANTIZED_BITS:
        return x.clone()
    w = x.to(_work_dtype(x))
    # a scale that is not a normal float (zero, subnormal: |x| ~ 1e-38, inf, NaN): the input comes back unchanged
    ok = (scale >= torch.finfo(scale.dtype).tiny) & torch.isfinite(scale)
    safe = torch.where(ok, scale, torch.ones_like(scale))
    m = qmax(bits, fmt)
    # One new tensor, then in-place passes on it (the logits tensors are large: fewer passes, fewer allocations).
    if fmt == "int":
        q = torch.div(w, safe).round_().clamp_(-m, m)  # round half to even
    elif fmt == "fint":
        q = torch.div(w, safe).round_().clamp_(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    else:
        q = torch.div(w, safe).clamp_(-m, m).to(FP8_FORMATS[fmt]).to(w.dtype)
    out = q.mul_(safe)
    if not every(ok):
        torch.where(ok, out, w, out=out)
    if valid is not None:
        torch.where(valid, out, w, out=out)
    return out.to(x.dtype)


def quantize_absmax(x: torch.Tensor, bits: int, dims, valid: torch.Tensor | None = None, fmt: str = "int") -> torch.Tensor:
    """Dynamic absmax quantization over ``dims``: ``fake_quant(x, absmax_scale(x, ...))``.

    Args:
        x: the tensor (never changed).
        bits: the width (16: a copy, unquantized).
        dims: the dimensions that share a scale.
        valid: bool, broadcastable to ``x``: the entries that count and are quantized; None: all.
        fmt: the grid (``GRIDS``)."""
    if bits == UNQUANTIZED_BITS:
        check_bits(bits, fmt)
        return x.clone()
    return fake_quant(x, absmax_scale(x, bits, dims, valid, fmt), bits, fmt, valid)
