"""One tensor's quantization (``TensorQuant``: target, format, granularity), its text ``TARGETS=FORMAT[/G[:N]]``,
and layer lists: the parts a ``QuantSpec`` is made of (the formats and granularities
are described there)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.numerics.names import ALL_TARGETS, LINEAR_TARGETS, TARGETS  # noqa: F401 (the parts' vocabulary)
from outlierscope.quant.numerics.registry import Format, format_named, read_format

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
    """Layer indices from text: ``"0-3"``, ``"0,2,5"`` or ``"0-1,4"``; None or ``"all"``: every layer.

    Indices are below ``MAX_LAYERS`` (checked before a range is built); the model's own count is checked where it is
    known.

    Args:
        text: the text.

    Returns:
        The sorted indices; None for every layer.

    Raises:
        ValueError: a malformed list, naming the fix."""
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
    """``parse_layers`` for a setting given on the command line: a malformed list is a one-line error.

    Args:
        text: the text."""
    try:
        return parse_layers(text)
    except ValueError as e:
        raise OutlierscopeError(str(e)) from None


def _kind(target: str) -> str:
    return target if target in ("logits", "probs", "a", "w") else "qkv"


@dataclass(frozen=True)
class TensorQuant:
    """One tensor's quantization, as one part of a spec's text (``k=int4/per_token``).

    Attributes:
        target: the tensor (``logits``, ``q``, ``k``, ``v``, ``probs``; a linear's input ``a`` and weight ``w``).
        format: a registered format (``outlierscope.quant.numerics.registry``).
        bits: its width, where the format takes one.
        granularity: what shares a scale (``per_tensor``, ``per_token``, ``per_group``, ...).
        size: the granularity's size (tokens per block, channels per group, tokens per channel group)."""

    target: str
    format: str
    bits: int | None = None
    granularity: str | None = None
    size: int | None = None

    def __post_init__(self):
        if self.target not in ALL_TARGETS:
            raise OutlierscopeError(f"quantization target must be one of {', '.join(ALL_TARGETS)} (or kv), "
                                    f"got {self.target!r}")
        try:
            fmt = format_named(self.format)
        except OutlierscopeError as e:
            raise OutlierscopeError(f"{self.target}: {e}") from None
        fmt.check(self.target, self.bits, self.granularity)
        if fmt.granular:
            self._check_granularity()

    @property
    def fmt(self) -> Format:
        """The registered format."""
        return format_named(self.format)

    def _check_granularity(self) -> None:
        g, kind = self.granularity, _kind(self.target)
        if g not in GRANULARITIES[kind]:
            raise OutlierscopeError(f"{self.target}: granularity must be one of {', '.join(GRANULARITIES[kind])}, got {g!r}")
        if self.target == "w" and g == "per_channel" and self.size is not None:
            raise OutlierscopeError("w: per_channel is one scale per output row; it takes no size")
        if SIZED.get(g) and (not isinstance(self.size, int) or self.size < 1):
            raise OutlierscopeError(f"{self.target}: {g} needs a size >= 1 ({g}:N), got {self.size!r}")
        if g not in SIZED and self.size is not None or g == "per_channel" and self.size is not None and self.size < 1:
            raise OutlierscopeError(f"{self.target}: {g} takes no size, got {self.size!r}")

    @property
    def format_text(self) -> str:
        return self.fmt.text(self.bits)

    @property
    def nominal_bits(self) -> int:
        """Bits per element (the format's own width, or its fixed one: FP8 8, MXFP6 6, MXFP4, NVFP4, NF4 4)."""
        return self.fmt.nominal_bits(self.bits)

    def __str__(self) -> str:
        g = "" if self.granularity is None else f"/{self.granularity}" + (f":{self.size}" if self.size else "")
        return f"{self.target}={self.format_text}{g}"


_PART = re.compile(r"^(?P<targets>[a-z,+]+)=(?P<fmt>[a-z0-9_-]+)(?:/(?P<gran>[a-z_]+)(?::(?P<size>\d+))?)?$")


def parse_part(text: str) -> list[TensorQuant]:
    """The parts of one ``TARGETS=FORMAT[/GRANULARITY[:N]]`` item (``kv`` is ``k`` and ``v``).

    Args:
        text: the item."""
    m = _PART.match(text)
    if not m:
        raise OutlierscopeError(f"cannot read {text!r}: expected TARGETS=FORMAT[/GRANULARITY[:N]], e.g. k=int4/per_group:32")
    targets = [t for name in re.split("[,+]", m["targets"]) for t in (("k", "v") if name == "kv" else (name,))]
    try:
        fmt, bits = read_format(m["fmt"])
    except OutlierscopeError as e:
        raise OutlierscopeError(f"{targets[0]}: {e}") from None
    size = int(m["size"]) if m["size"] else None
    return [TensorQuant(t, fmt.name, bits, m["gran"], size) for t in targets]
