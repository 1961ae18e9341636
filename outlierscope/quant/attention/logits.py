"""The paper's dynamic absmax quantization of attention logits, as a tensor operator: the ``logits=`` part of a
``QuantSpec`` with its layers (``logits_quant``), applied to (B, H, T, S) logits
with their valid mask. Pure tensor work lives in ``outlierscope.quant.numerics.primitives``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.numerics.fused import fusable
from outlierscope.quant.numerics.primitives import absmax, fake_quant, qmax, quantize_absmax
from outlierscope.quant.numerics.registry import Kernel

# reduction dims of the logits (B, H, T, S) per granularity; the batch dim is never reduced,
# so one sequence's result never depends on what else is in the batch
GRANULARITY_DIMS = {
    "per_tensor": (1, 2, 3),  # one scale per sequence and layer, over all heads and valid (query, key)
    "per_head": (2, 3),  # per sequence, layer and head
    "per_row": (3,),  # per query token and head: a row sees only its own valid keys
}


@dataclass(frozen=True)
class LogitsQuant:
    """Absmax quantization of the attention logits (the paper's), with one scale per granule.

    Attributes:
        bits: the width.
        format: ``int``, or an FP8 format (``e4m3``, ``e5m2``) at 8 bits.
        granularity: ``per_tensor``, ``per_head`` or ``per_row``.
        layers: the decoder layers quantized; None: all.
        bnb: bitsandbytes' ``int8_vectorwise_quant`` (int8 per row) instead."""

    bits: int
    format: str
    granularity: str
    layers: tuple[int, ...] | None = None
    bnb: bool = False

    def applies_to(self, layer: int) -> bool:
        """Whether a decoder layer's logits are quantized.

        Args:
            layer: the layer's index."""
        return self.layers is None or layer in self.layers

    @property
    def spans_rows(self) -> bool:
        """Whether a scale reduces over query rows (per_head, per_tensor): blocked attention needs a first pass."""
        return 2 in GRANULARITY_DIMS[self.granularity]

    def absmax(self, logits: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """The absmax this scale is made of, ``(B, 1|H, 1|T, 1)``: max it over blocks of rows, then call.

        Args:
            logits: ``(B, H, t, S)``.
            valid: bool, broadcastable to the logits; None: all."""
        if valid is not None:
            valid = valid.expand_as(logits)
        return absmax(logits, GRANULARITY_DIMS[self.granularity], valid)

    def __call__(self, logits: torch.Tensor, valid: torch.Tensor | None, amax: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize logits (B, H, T, S) with their valid mask; returns a new tensor.

        ``amax``: the absmax to scale with (from ``absmax`` over all blocks of rows); None: these logits' own."""
        return quantize_logits(logits, valid, self, amax)


def _bnb(logits, valid, lq: LogitsQuant, amax=None) -> bool:
    return lq.bnb  # bitsandbytes' own kernel: nothing to compile


@fusable(eager_if=_bnb, dynamic=True)
def quantize_logits(logits: torch.Tensor, valid: torch.Tensor | None, lq: LogitsQuant,
                    amax: torch.Tensor | None = None) -> torch.Tensor:
    """``LogitsQuant.__call__``: compiled inside ``fused_kernels`` (the same bytes); bitsandbytes' rows always eager.

    Args:
        logits: ``(B, H, t, S)``.
        valid: bool, broadcastable to the logits; None: all.
        lq: the operator.
        amax: the absmax to scale with (over all blocks of rows); None: these logits' own."""
    if valid is not None:
        valid = valid.expand_as(logits)
    if lq.bnb:
        return bnb_int8_rowwise(logits, valid)
    if amax is not None:
        return fake_quant(logits, amax / qmax(lq.bits, lq.format), lq.bits, lq.format, valid)
    return quantize_absmax(logits, lq.bits, GRANULARITY_DIMS[lq.granularity], valid, lq.format)


def logits_quant(spec) -> LogitsQuant | None:
    """The operator of a spec's ``logits=`` part, in its layers; None without one.

    Args:
        spec: the ``QuantSpec``."""
    p = spec.part("logits")
    if p is None:
        return None
    return LogitsQuant(p.nominal_bits, p.fmt.grid, p.granularity or "per_row", spec.layers, bnb=isinstance(p.fmt, Kernel))


def bnb_int8_rowwise(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Absmax int8 per row (last dim) through ``bitsandbytes.functional.int8_vectorwise_quant``.

    Args:
        x: the tensor.
        valid: bool, broadcastable to ``x`` (invalid entries enter no scale); None: all.

    Raises:
        OutlierscopeError: on CUDA, values beyond float16's range (bitsandbytes' kernel reads float16)."""
    import bitsandbytes.functional as F

    w = x.float() if valid is None else x.float().masked_fill(~valid, 0.0)
    rows = w.reshape(-1, w.shape[-1])  # (B*H*T, S)
    if rows.is_cuda:  # bitsandbytes' CUDA kernel takes float16 only
        top = float(rows.abs().max()) if rows.numel() else 0.0
        if top > 65504:
            raise OutlierscopeError(f"bitsandbytes int8 on CUDA reads float16, but the logits reach {top:.4g} > 65504; "
                                    "use logits=int8/per_row (our own int8) for this model")
        rows = rows.half()
    q, row_absmax, _ = F.int8_vectorwise_quant(rows.contiguous())
    row_absmax = row_absmax.float()
    deq = (q.float() * (row_absmax[:, None] / 127.0)).view_as(w)  # (B, H, T, S)
    keep = (row_absmax > 0).view(*w.shape[:-1], 1)  # (B, H, T, 1)
    out = torch.where(keep, deq, x.float())
    if valid is not None:
        out = torch.where(valid, out, x.float())
    return out.to(x.dtype)
