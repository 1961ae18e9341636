"""What to quantize and at which granularity: a frozen spec, separate from the tensor primitives."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.names import BACKENDS, FORMATS, GRANULARITIES, UNQUANTIZED_BITS
from outlierscope.quant.primitives import absmax, check_bits, fake_quant, qmax, quantize_absmax

# reduction dims of the logits (B, H, T, S) per granularity; the batch dim is never reduced,
# so one sequence's result never depends on what else is in the batch
GRANULARITY_DIMS = {
    "per_tensor": (1, 2, 3),  # one scale per sequence and layer, over all heads and valid (query, key)
    "per_head": (2, 3),  # per sequence, layer and head
    "per_row": (3,),  # per query token and head: a row sees only its own valid keys
}
assert tuple(GRANULARITY_DIMS) == GRANULARITIES


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    """``"0-3"``, ``"0,2,5"`` or ``"0-1,4"`` -> sorted layer indices; None/"all" -> every layer."""
    if text is None or text == "all":
        return None
    out: set[int] = set()
    try:
        for part in text.split(","):
            if "-" in part:
                a, b = (int(x) for x in part.split("-"))
                if b < a:
                    raise ValueError(f"layers must be ranges from low to high like 1-3, got {part!r} in {text!r}")
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
    except ValueError as e:
        if "low to high" in str(e):
            raise
        raise ValueError(f"layers must look like 0-3 or 0,2,5, got {text!r}") from None
    if any(i < 0 for i in out):
        raise ValueError(f"layer indices must be >= 0, got {text!r}")
    return tuple(sorted(out))


def layers_option(text: str) -> tuple[int, ...] | None:
    """:func:`parse_layers` for a setting given as text (the command line): a malformed list is a one-line error."""
    try:
        return parse_layers(text)
    except ValueError as e:
        raise OutlierscopeError(str(e)) from None


@dataclass(frozen=True)
class QuantSpec:
    """Dynamic absmax post-training quantization of attention logits.

    ``bits=16`` means unquantized (the paper's axis). ``format`` is ``int`` (bits 2..16) or an FP8
    format (``e4m3``/``e5m2``, bits 8). ``backend="bitsandbytes"`` uses ``int8_vectorwise_quant``
    (only for int, 8 bits, per_row).
    """

    bits: int = 8
    format: str = "int"
    granularity: str = "per_tensor"
    layers: tuple[int, ...] | None = None
    backend: str = "torch"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        check_bits(self.bits, self.format)
        if self.granularity not in GRANULARITY_DIMS:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "bitsandbytes" and (self.format, self.bits, self.granularity) != ("int", 8, "per_row"):
            raise ValueError(
                f"the bitsandbytes backend is int8 absmax per row: needs format int, bits 8, granularity per_row, "
                f"got {self.format}, {self.bits}, {self.granularity}"
            )
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))
            if not self.layers or min(self.layers) < 0:
                raise ValueError(f"layers must name at least one layer index >= 0 (or be None: every layer), got {self.layers}")

    @property
    def is_identity(self) -> bool:
        return self.bits == UNQUANTIZED_BITS

    @property
    def label(self) -> str:
        if self.is_identity:
            return "16 (unquantized)"
        base = f"{self.bits}-bit {self.format}" if self.format == "int" else f"fp8 {self.format}"
        return f"{base} {self.granularity}" + (f" layers {','.join(map(str, self.layers))}" if self.layers else "")

    def applies_to(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    @property
    def spans_rows(self) -> bool:
        """Whether a scale reduces over query rows (per_head, per_tensor): blocked attention needs a first pass."""
        return not self.is_identity and 2 in GRANULARITY_DIMS[self.granularity]

    def absmax(self, logits: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """The absmax this spec's scale is made of, (B, 1|H, 1|T, 1): max it over blocks of rows, then :meth:`__call__`."""
        if valid is not None:
            valid = valid.expand_as(logits)
        return absmax(logits, GRANULARITY_DIMS[self.granularity], valid)

    def __call__(self, logits: torch.Tensor, valid: torch.Tensor | None, amax: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize logits (B, H, T, S) with their valid mask; returns a new tensor.

        ``amax``: the absmax to scale with (from :meth:`absmax` over all blocks of rows); None: these logits' own."""
        if self.is_identity:
            return logits
        if valid is not None:
            valid = valid.expand_as(logits)
        if self.backend == "bitsandbytes":
            return bnb_int8_rowwise(logits, valid)
        if amax is not None:
            return fake_quant(logits, amax / qmax(self.bits, self.format), self.bits, self.format, valid)
        return quantize_absmax(logits, self.bits, GRANULARITY_DIMS[self.granularity], valid, self.format)


def bnb_int8_rowwise(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Absmax int8 per row (last dim) through ``bitsandbytes.functional.int8_vectorwise_quant``."""
    import bitsandbytes.functional as F

    w = x.float() if valid is None else x.float().masked_fill(~valid, 0.0)
    rows = w.reshape(-1, w.shape[-1])  # (B*H*T, S)
    if rows.is_cuda:  # bitsandbytes' CUDA kernel takes float16 only
        top = float(rows.abs().max()) if rows.numel() else 0.0
        if top > 65504:
            raise OutlierscopeError(f"bitsandbytes int8 on CUDA reads float16, but the logits reach {top:.4g} > 65504; "
                                    "use backend 'torch' (the default) for this model")
        rows = rows.half()
    q, row_absmax, _ = F.int8_vectorwise_quant(rows.contiguous())
    row_absmax = row_absmax.float()
    deq = (q.float() * (row_absmax[:, None] / 127.0)).view_as(w)  # (B, H, T, S)
    keep = (row_absmax > 0).view(*w.shape[:-1], 1)  # (B, H, T, 1)
    out = torch.where(keep, deq, x.float())
    if valid is not None:
        out = torch.where(valid, out, x.float())
    return out.to(x.dtype)


def build_spec(bits: int, format: str = "int", granularity: str = "per_tensor", layers=None) -> QuantSpec:
    """The spec of a run's settings: unquantized for 16 bits (format, granularity and layers do not apply), and a
    bad value a one-line :class:`OutlierscopeError` (the ``ValueError`` of :class:`QuantSpec`)."""
    if format not in FORMATS:  # a typo is an error at 16 bits too, where these settings do not apply
        raise OutlierscopeError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if granularity not in GRANULARITIES:
        raise OutlierscopeError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    if bits == UNQUANTIZED_BITS:
        return QuantSpec(bits=UNQUANTIZED_BITS)
    try:
        return QuantSpec(bits=bits, format=format, granularity=granularity,
                         layers=tuple(layers) if layers is not None else None)
    except ValueError as e:
        raise OutlierscopeError(str(e)) from None
