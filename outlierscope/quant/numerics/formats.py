"""Element and block formats beyond integer absmax (pure tensor primitives: no state, never mutate the input).

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from outlierscope.quant.numerics.primitives import FP8_FORMATS, every


@dataclass(frozen=True)
class Minifloat:
    """A small floating-point element format (OCP's FP8, FP6, FP4), by its exponent and mantissa bits.

    Attributes:
        ebits: exponent bits.
        mbits: mantissa bits.
        max_normal: its largest finite value."""
    ebits: int
    mbits: int
    max_normal: float

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number (1 - bias)."""
        return 2 - 2 ** (self.ebits - 1)

    @property
    def emax(self) -> int:
        """Exponent of the largest normal number (MX's emax_elem)."""
        return math.floor(math.log2(self.max_normal))  # plain Python: no tensor, nothing for a compiled graph to break on


MINIFLOATS = {
    "e4m3": Minifloat(4, 3, 448.0),
    "e5m2": Minifloat(5, 2, 57344.0),
    "e3m2": Minifloat(3, 2, 28.0),
    "e2m3": Minifloat(2, 3, 7.5),
    "e2m1": Minifloat(2, 1, 6.0),
}
# MX format -> (element format, block size); "int8": mxint8's fixed-point elements
MX_FORMATS = {"mxfp8_e4m3": ("e4m3", 32), "mxfp8_e5m2": ("e5m2", 32), "mxfp6_e3m2": ("e3m2", 32),
              "mxfp6_e2m3": ("e2m3", 32), "mxfp4": ("e2m1", 32), "mxint8": ("int8", 32),
              "ct-mxfp4": ("e2m1", 32), "ct-mxfp8_e4m3": ("e4m3", 32)}
CT_MX_ROUND_UP = 0.875  # compressed-tensors' MX: a block max whose frexp mantissa (in [0.5, 1)) reaches 7/8 rounds up
NVFP4_BLOCK = 16
E4M3_MAX, E2M1_MAX = 448.0, 6.0


def _work(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def round_minifloat(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` rounded to the nearest value of a minifloat format (ties to even), saturating at +-max_normal.

    The same values three ways, the cheapest that applies: FP8 of float32 input by torch's cast after clamping; E2M1
    with its three spacings from two comparisons; else the spacing ``2^(max(floor(log2 |x|), emin) - mbits)`` from
    ``frexp``.

    Args:
        x: the tensor.
        fmt: a ``MINIFLOATS`` name."""
    f = MINIFLOATS[fmt]
    w = _work(x)
    if fmt in FP8_FORMATS and w.dtype == torch.float32:
        return w.clamp(-f.max_normal, f.max_normal).to(FP8_FORMATS[fmt]).to(torch.float32).to(x.dtype)
    if fmt == "e2m1":
        a = w.abs()
        quantum = (a >= 2).to(w.dtype).add_((a >= 4).to(w.dtype), alpha=2).add_(1).mul_(0.5)  # 0.5, 1 or 2: a's binade
        return torch.round(a / quantum).mul_(quantum).clamp_max_(f.max_normal).copysign_(w).to(x.dtype)
    a = w.abs()
    _, exp = torch.frexp(a)  # a = m 2^exp with m in [0.5, 1): the binade's exponent is exp - 1
    e = (exp - 1).clamp_min(f.emin).to(w.dtype)  # below the normal range: the subnormal spacing
    quantum = torch.exp2(e - f.mbits)
    q = torch.round(a / quantum).mul_(quantum).clamp_max_(f.max_normal)  # round half to even
    return q.copysign_(w).to(x.dtype)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"the last dim ({x.shape[-1]}) must be a multiple of the block size {block}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)  # (..., n_blocks, block)


def mx_quant(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantize-dequantize ``x`` in an MX format, in blocks along the last dim; a new tensor.

    Args:
        x: the tensor.
        fmt: an ``MX_FORMATS`` name (``ct-`` variants: compressed-tensors' scale rounding)."""
    elem, block = MX_FORMATS[fmt]
    w = _blocks(_work(x), block)  # (..., n, 32)
    amax = w.abs().amax(-1, keepdim=True)  # (..., n, 1)
    emax = 0 if elem == "int8" else MINIFLOATS[elem].emax
    mant, exp = torch.frexp(amax)  # amax = mant 2^exp, mant in [0.5, 1)
    if fmt.startswith("ct-"):  # compressed-tensors rounds the max to a power of 2 first (up from mantissa 1.75)
        exp = exp + (mant >= CT_MX_ROUND_UP).to(exp.dtype)
    shared = (exp - 1 - emax).clamp_(-127, 127).to(w.dtype)  # floor(log2(amax)) - emax_elem, E8M0's range
    scale = torch.exp2(shared)
    v = w / scale
    if elem == "int8":
        q = torch.round(v * 64).clamp_(-127, 127) / 64
    else:
        q = round_minifloat(v, elem)
    nonzero = amax > 0
    # an all-zero block stays zero (its scale is 2^-127-ish, not 0: kept as it was); none such: nothing to mask
    if every(nonzero):
        return q.mul_(scale).reshape(x.shape).to(x.dtype)
    out = torch.where(nonzero, q * scale, w)
    return out.reshape(x.shape).to(x.dtype)


def nvfp4_scales(x: torch.Tensor, tensor_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's scales of ``x`` (blocks of 16 along the last dim), in compressed-tensors' float32 order.

    The global scale ``gs = 448 * 6 / tensor_amax`` (1 where the amax is 0) and each block's E4M3 scale
    ``e4m3(gs * (amax_block / 6))``, converted as NVIDIA's hardware does (round to nearest, satfinite, E4M3
    subnormals down to 2^-9 kept; 0 where it rounds to zero).

    Args:
        x: the tensor.
        tensor_amax: the per-tensor absmax, broadcastable to ``x`` without its last dim.

    Returns:
        ``(gs (..., 1, 1), block scales (..., n, 1))``, float32."""
    w = _blocks(x.float(), NVFP4_BLOCK)  # (..., n, 16): NVFP4's scales are float32 arithmetic
    amax = tensor_amax.float()[..., None, None]  # (..., 1, 1)
    gs = (E4M3_MAX * E2M1_MAX) / amax
    gs = torch.where((amax > 0) & torch.isfinite(gs), gs, torch.ones_like(gs))
    block_scale = gs * (w.abs().amax(-1, keepdim=True) / E2M1_MAX)  # (..., n, 1)
    return gs, block_scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()


def nvfp4_quant(x: torch.Tensor, tensor_amax: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize ``x`` in NVFP4 as compressed-tensors' fake quantization; a new tensor.

    Each block's effective scale is ``s / gs``; its elements ``e2m1(x / (s / gs))`` come back as ``q * (s / gs)``. A
    block whose scale rounds to zero comes back zero.

    Args:
        x: the tensor (blocks of 16 along its last dim).
        tensor_amax: the per-tensor absmax, broadcastable to ``x`` without its last dim (one per sequence, say)."""
    w = _blocks(x.float(), NVFP4_BLOCK)  # (..., n, 16)
    gs, s = nvfp4_scales(x, tensor_amax)
    eff = s / gs  # (..., n, 1)
    ok = eff > 0
    if every(ok):  # the common case: no block scale rounded to zero, nothing to mask
        return round_minifloat(w / eff, "e2m1").mul_(eff).reshape(x.shape).to(x.dtype)
    q = round_minifloat(w / torch.where(ok, eff, torch.ones_like(eff)), "e2m1")
    return torch.where(ok, q * eff, torch.zeros_like(q)).reshape(x.shape).to(x.dtype)


def asym_quant(x: torch.Tensor, bits: int, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Asymmetric integer quantization onto ``2^bits`` levels between ``lo`` and ``hi``; a new tensor.

    Scale ``(hi - lo) / (2^bits - 1)``, ``q = round((x - lo) / scale)``, back as ``q * scale + lo``; where the scale is
    zero ``x`` comes back unchanged.

    Args:
        x: the tensor.
        bits: the width.
        lo: the range's low end, broadcastable to ``x``.
        hi: its high end."""
    w = _work(x)
    levels = 2**bits - 1
    scale = (hi - lo).to(w.dtype) / levels
    ok = scale > 0
    safe = torch.where(ok, scale, torch.ones_like(scale))
    q = torch.round((w - lo) / safe).clamp_(0, levels)
    return torch.where(ok, q * safe + lo, w).to(x.dtype)


def asym_minmax(x: torch.Tensor, valid: torch.Tensor | None, dims: tuple, bits: int) -> torch.Tensor:
    """``asym_quant`` between each granule's min and max among valid entries.

    Args:
        x: the tensor.
        valid: bool, broadcastable to ``x``; None: all. Invalid entries, and granules with none valid, come back
            unchanged.
        dims: the dims each granule reduces.
        bits: the width."""
    if valid is None:
        valid = torch.ones_like(x, dtype=torch.bool)
    big = torch.finfo(x.dtype).max
    lo = x.masked_fill(~valid, big).amin(dims, keepdim=True)
    hi = x.masked_fill(~valid, -big).amax(dims, keepdim=True)
    empty = lo > hi  # no valid entry: unchanged
    lo, hi = torch.where(empty, 0, lo), torch.where(empty, 0, hi)
    return torch.where(valid, asym_quant(x, bits, lo, hi), x)


def pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """``x`` zero-padded along a dim to a multiple of a size (itself when it is one).

    Args:
        x: the tensor.
        dim: the dim.
        multiple: the size."""
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim)


def zero_point_params(x: torch.Tensor, bits: int, dims) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``zint`` grid, as GPT-QModel's ``Quantizer.find_params`` with ``sym=False`` computes it.

    The range ``[min(min x, 0), max(max x, 0)]`` (all zero: ``[-1, 1]``) onto ``0 .. 2^bits - 1``: scale
    ``(hi - lo) / (2^bits - 1)``, integer zero point ``round(-lo / scale)``; float32 at least (float64 for float64).
    compressed-tensors' asymmetric int is the same grid.

    Args:
        x: the tensor.
        bits: the width.
        dims: the dims each granule reduces (keepdim).

    Returns:
        ``(scale, zero point)``."""
    w = _work(x)
    lo = w.amin(dims, keepdim=True).clamp(max=0)
    hi = w.amax(dims, keepdim=True).clamp(min=0)
    both = (lo == 0) & (hi == 0)
    lo, hi = torch.where(both, -torch.ones_like(lo), lo), torch.where(both, torch.ones_like(hi), hi)
    scale = (hi - lo) / (2**bits - 1)
    return scale, torch.round(-lo / scale)


def zero_point_quant(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """``scale * (clamp(round(x / scale) + zero, 0, 2^bits - 1) - zero)`` (GPT-QModel's ``quantize``), in x's dtype.

    Args:
        x: the tensor.
        scale: ``zero_point_params``' scale.
        zero: its zero point.
        bits: the width."""
    q = torch.clamp(torch.round(_work(x) / scale) + zero, 0, 2**bits - 1)
    return (scale * (q - zero)).to(x.dtype)
