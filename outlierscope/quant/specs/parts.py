"""One tensor's quantization (:class:`TensorQuant`: target, format, granularity), its text ``TARGETS=FORMAT[/G[:N]]``,
and layer lists: the parts a :class:`~outlierscope.quant.specs.spec.QuantSpec` is made of (the formats and granularities
are described there)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.numerics.formats import MX_FORMATS

TARGETS = ("logits", "q", "k", "v", "probs")  # inside attention
LINEAR_TARGETS = ("a", "w")  # a linear layer's input (activations) and weight
ALL_TARGETS = TARGETS + LINEAR_TARGETS
FLOAT_FORMATS = ("e4m3", "e5m2")
BLOCK_FORMATS = (*MX_FORMATS, "nvfp4")
BNB_FORMATS = ("bnb-int8", "bnb-nf4")  # bitsandbytes' own kernels: Linear8bitLt / Linear4bit, int8 rows of the logits
GRANULARITIES = {  # target kind -> granularities it takes
    "logits": ("per_tensor", "per_head", "per_row"),
    "qkv": ("per_tensor", "per_head", "per_token", "per_row", "per_channel", "per_block", "per_group"),
    "probs": ("per_row", "static"),
    "a": ("per_token", "per_tensor", "per_group", "static"),
    "w": ("per_channel", "per_group", "per_tensor"),
}
SIZED = {"per_block": True, "per_group": True, "per_channel": False}  # granularity -> its size is required
KERNEL_FORMAT = "attn"  # a sweep row's format for every spec beyond the paper's logits (its text: the granularity)


MAX_LAYERS = 1 << 16  # no index reaches it (the deepest models have a few hundred layers): ranges stay small in memory


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    """``"0-3"``, ``"0,2,5"`` or ``"0-1,4"`` -> sorted layer indices; None/"all" -> every layer. Indices are below
    :data:`MAX_LAYERS` (checked before a range is built); the model's own count is checked where it is known."""
    if text is None or text == "all":
        return None
    out: set[int] = set()
    try:
        for part in text.split(","):
            if "-" in part:
                a, b = (int(x) for x in part.split("-"))
                if b < a:
                    raise ValueError(f"layers must be ranges from low to high like 1-3, got {part!r} in {text!r}")
                if b >= MAX_LAYERS:
                    raise ValueError(f"layer indices must be below {MAX_LAYERS} (a model's layers), got {b} in {text!r}")
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
    except ValueError as e:
        if "low to high" in str(e) or "must be below" in str(e):
            raise
        raise ValueError(f"layers must look like 0-3 or 0,2,5, got {text!r}") from None
    if any(i < 0 for i in out):
        raise ValueError(f"layer indices must be >= 0, got {text!r}")
    if any(i >= MAX_LAYERS for i in out):
        raise ValueError(f"layer indices must be below {MAX_LAYERS} (a model's layers), got {text!r}")
    return tuple(sorted(out))


def layers_option(text: str) -> tuple[int, ...] | None:
    """:func:`parse_layers` for a setting given as text (the command line): a malformed list is a one-line error."""
    try:
        return parse_layers(text)
    except ValueError as e:
        raise OutlierscopeError(str(e)) from None


def _kind(target: str) -> str:
    return target if target in ("logits", "probs", "a", "w") else "qkv"


@dataclass(frozen=True)
class TensorQuant:
    """One tensor's quantization: ``format`` (``int``/``asym``/``fint`` with ``bits``, an FP8, a block or a
    bitsandbytes format), ``granularity`` and its ``size`` (tokens per block, channels per group, tokens per channel
    group)."""

    target: str
    format: str
    bits: int | None = None
    granularity: str | None = None
    size: int | None = None

    def __post_init__(self):
        if self.target not in ALL_TARGETS:
            raise OutlierscopeError(f"quantization target must be one of {', '.join(ALL_TARGETS)} (or kv), "
                                    f"got {self.target!r}")
        if self.format == "zint" and self.target != "w":
            raise OutlierscopeError(f"{self.target}: zint (GPTQ's integer zero point) is a weight grid; use it in w=")
        if self.format in ("int", "asym", "fint", "zint"):
            top = 15 if self.target == "logits" else 8  # the paper's axis runs to 16 (= unquantized)
            if not isinstance(self.bits, int) or isinstance(self.bits, bool) or not 2 <= self.bits <= top:
                raise OutlierscopeError(f"{self.target}: {self.format} needs bits in 2..{top}, got {self.bits!r}")
            if self.format == "fint" and self.target in ("logits", "probs"):
                raise OutlierscopeError(f"{self.target}: fint (the full-range grid of compressed-tensors and torchao) "
                                        "is for a=, w=, q, k and v parts; use int here")
        elif self.format in FLOAT_FORMATS + BLOCK_FORMATS + BNB_FORMATS:
            if self.bits is not None:
                raise OutlierscopeError(f"{self.target}: format {self.format} has no bits setting")
        else:
            raise OutlierscopeError(f"{self.target}: unknown format {self.format!r}; expected int2..int8, asym2..asym8, "
                                    "zint2..zint8 (w=), "
                                    "fint2..fint8 (a=, w=, q, k, v), "
                                    f"{', '.join(FLOAT_FORMATS + BLOCK_FORMATS + BNB_FORMATS)}")
        self._check_granularity()

    def _check_granularity(self) -> None:
        g, kind = self.granularity, _kind(self.target)
        if self.format in BLOCK_FORMATS + BNB_FORMATS:
            if g is not None:
                raise OutlierscopeError(f"{self.target}: {self.format} brings its own blocks; leave out the granularity")
            allowed = {"bnb-int8": ("w", "logits"), "bnb-nf4": ("w",)}.get(self.format, ALL_TARGETS)
            if self.target not in allowed:
                raise OutlierscopeError(f"{self.target}: {self.format} (bitsandbytes) applies to "
                                        f"{' and '.join(t + '=' for t in allowed)} only")
            if self.target == "logits" and self.format in BLOCK_FORMATS:
                raise OutlierscopeError("logits: block formats apply to the matmul inputs (q, k, probs, v), not to logits")
            return
        if self.target == "logits" and self.format == "asym":
            raise OutlierscopeError("logits: symmetric formats only (int or FP8), as the paper's absmax")
        if g not in GRANULARITIES[kind]:
            raise OutlierscopeError(f"{self.target}: granularity must be one of {', '.join(GRANULARITIES[kind])}, got {g!r}")
        if g == "static" and self.format not in FLOAT_FORMATS + ("int", "fint"):
            raise OutlierscopeError(f"{self.target}: static scales need a symmetric format (int or FP8)")
        if self.target == "w" and g == "per_channel" and self.size is not None:
            raise OutlierscopeError("w: per_channel is one scale per output row; it takes no size")
        if SIZED.get(g) and (not isinstance(self.size, int) or self.size < 1):
            raise OutlierscopeError(f"{self.target}: {g} needs a size >= 1 ({g}:N), got {self.size!r}")
        if g not in SIZED and self.size is not None or g == "per_channel" and self.size is not None and self.size < 1:
            raise OutlierscopeError(f"{self.target}: {g} takes no size, got {self.size!r}")

    @property
    def grid(self) -> tuple[int, str]:
        """(bits, format) of a symmetric grid as :mod:`outlierscope.quant.numerics.primitives` names it: ``int`` with its bits,
        FP8 formats (and bitsandbytes' int8 rows) at 8."""
        if self.format in ("int", "fint"):
            return self.bits, self.format
        return 8, "int" if self.format == "bnb-int8" else self.format

    @property
    def format_text(self) -> str:
        return f"{self.format}{self.bits}" if self.bits is not None else self.format

    @property
    def nominal_bits(self) -> int:
        """Bits per element: int/asym/fint/zint their own, FP8, MXINT8 and bitsandbytes int8 8, MXFP6 6, MXFP4, NVFP4, NF4 4."""
        if self.bits is not None:
            return self.bits
        return {"mxfp6_e3m2": 6, "mxfp6_e2m3": 6, "mxfp4": 4, "ct-mxfp4": 4, "nvfp4": 4, "bnb-nf4": 4}.get(self.format, 8)

    def __str__(self) -> str:
        g = "" if self.granularity is None else f"/{self.granularity}" + (f":{self.size}" if self.size else "")
        return f"{self.target}={self.format_text}{g}"


_PART = re.compile(r"^(?P<targets>[a-z,+]+)=(?P<fmt>[a-z0-9_-]+)(?:/(?P<gran>[a-z_]+)(?::(?P<size>\d+))?)?$")


def parse_part(text: str) -> list[TensorQuant]:
    m = _PART.match(text)
    if not m:
        raise OutlierscopeError(f"cannot read {text!r}: expected TARGETS=FORMAT[/GRANULARITY[:N]], e.g. k=int4/per_group:32")
    fmt, bits = m["fmt"], None
    num = re.fullmatch(r"(int|asym|fint|zint)(\d+)", fmt)
    if num:
        fmt, bits = num[1], int(num[2])
    targets = [t for name in re.split("[,+]", m["targets"]) for t in (("k", "v") if name == "kv" else (name,))]
    size = int(m["size"]) if m["size"] else None
    return [TensorQuant(t, fmt, bits, m["gran"], size) for t in targets]
