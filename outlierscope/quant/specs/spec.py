"""What to quantize: ``QuantSpec``, one frozen spec for everything the toolkit quantizes, with one text form and
one parser (the grammar: the guide's "Spec language" page). Its tensor parts (``TensorQuant``) name a format per
quantized tensor; its transforms (``outlierscope.quant.specs.transforms``) what happens first and where. Its text is
its identity: ``QuantSpec.parse(str(spec)) == spec``, and a cell's settings are derived from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.quant.numerics.names import BACKENDS, UNQUANTIZED_BITS
from outlierscope.quant.numerics.registry import FORMATS, Kernel, format_named, logits_formats
from outlierscope.quant.specs.calibrated import AWQConfig, GPTQConfig, WeightAlgorithm
from outlierscope.quant.specs.parts import (  # noqa: F401 (re-exported: the spec's vocabulary)
    ALL_TARGETS,
    GRANULARITIES,
    KERNEL_FORMAT,
    LINEAR_TARGETS,
    TARGETS,
    TensorQuant,
    layers_option,
    parse_layers,
    parse_part,
)
from outlierscope.quant.specs.recipes import RECIPES
from outlierscope.quant.specs.transforms import TRANSFORMS, Calib, Layers, Linears, Transform, _Threshold
from outlierscope.quant.specs.validate import check_spec_parts

BNB_PREFIX = "bnb-"  # bitsandbytes' weights formats: the prefix of a weights mode (int8, nf4)
BNB_LOGITS = "bnb-int8"  # the format of the keyword form's backend="bitsandbytes"
T = TypeVar("T", bound=Transform)


def _logits_part(bits, format, granularity, backend) -> TensorQuant | None:
    """The logits part of the paper's form (``QuantSpec.logits``); None at 16 bits."""
    fmt, gran, backend = format or "int", granularity or "per_tensor", backend or "torch"
    if fmt not in logits_formats():  # a typo is an error at 16 bits too, where these settings do not apply
        raise ParamError("format", f"one of {', '.join(logits_formats())}", fmt)
    if gran not in GRANULARITIES["logits"]:
        raise ParamError("granularity", f"one of {', '.join(GRANULARITIES['logits'])}", gran)
    if backend not in BACKENDS:
        raise ParamError("backend", f"one of {', '.join(BACKENDS)}", backend)
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= UNQUANTIZED_BITS:
        raise ParamError("bits", f"in 2..{UNQUANTIZED_BITS} ({UNQUANTIZED_BITS} = unquantized)", bits)
    if bits == UNQUANTIZED_BITS:
        return None
    if backend == "bitsandbytes":
        rows = format_named(BNB_LOGITS)  # bitsandbytes' int8 rows
        if (fmt, bits, gran) != (rows.grid, rows.nominal, "per_row"):
            raise ParamError("backend", f"'torch' unless format {rows.grid}, bits {rows.nominal}, granularity per_row "
                             f"(bitsandbytes' int8 rows), with {fmt}, {bits}, {gran}", backend)
        return TensorQuant("logits", rows.name)
    if format_named(fmt).bits is None:
        if bits != 8:
            raise ParamError("bits", f"8 (or {UNQUANTIZED_BITS} = unquantized) for format {fmt}", bits)
        return TensorQuant("logits", fmt, None, gran)
    return TensorQuant("logits", fmt, bits, gran)


class Columns(NamedTuple):
    """A spec's columns in a sweep table: the paper's logits fields for the paper's form; otherwise the fewest bits
    any part uses, ``attn`` and the spec's text."""

    bits: int
    format: str
    granularity: str


@dataclass(frozen=True, init=False)
class QuantSpec:
    """Everything a model is quantized with; its text round-trips (``parse(str(spec)) == spec``).

    Build one from text with ``QuantSpec.of("k=int4/per_token; w=int4/per_group:128")``, or the paper's form with
    ``QuantSpec.logits(bits=4)``. The constructor takes tensor parts and transforms alike in ``parts``.

    Attributes:
        parts: one ``TensorQuant`` per quantized tensor, in target order.
        transforms: the typed transforms (smoothing, rotations, LLM.int8's decomposition, GPTQ, AWQ, the calibration
            source, the linears and layers it applies to), in the canonical text's order.
        name: the recipe it came from (not part of its identity)."""

    parts: tuple[TensorQuant, ...] = ()
    transforms: tuple[Transform, ...] = ()
    name: str | None = field(default=None, compare=False)

    def __init__(self, parts=(), transforms=(), name: str | None = None):
        given = (*parts, *transforms)
        bad = [p for p in given if not isinstance(p, (TensorQuant, Transform))]
        if bad:
            raise ParamError("parts", "TensorQuant parts and Transform parts (parse_part('k=int4/per_token'), "
                             "Smooth(0.5))", bad[0])
        keys = [t.key for t in given if isinstance(t, Transform)]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise OutlierscopeError(f"{twice[0]} is given twice; give it once")
        tensor = sorted((p for p in given if isinstance(p, TensorQuant)), key=lambda p: ALL_TARGETS.index(p.target))
        object.__setattr__(self, "parts", tuple(tensor))
        object.__setattr__(self, "transforms", tuple(sorted((t for t in given if isinstance(t, Transform)),
                                                            key=lambda t: t.rank)))
        object.__setattr__(self, "name", name)
        check_spec_parts(self)

    @classmethod
    def logits(cls, bits: int, format: str = "int", granularity: str = "per_tensor", backend: str = "torch",
               layers: tuple[int, ...] | None = None) -> QuantSpec:
        """The paper's form: the attention logits quantized with dynamic absmax (16 bits: unquantized).

        Args:
            bits: 2..16 (16 = unquantized; FP8 formats: 8).
            format: ``int``, ``e4m3`` or ``e5m2``.
            granularity: ``per_tensor``, ``per_head`` or ``per_row``.
            backend: ``torch``, or ``bitsandbytes`` (its int8 rows: bits 8, per_row).
            layers: the layers quantized (None: every layer)."""
        part = _logits_part(bits, format, granularity, backend)
        if part is None:
            return cls()
        return cls((part, *([Layers(tuple(layers))] if layers is not None else [])))

    def part(self, target: str) -> TensorQuant | None:
        """The tensor part of a target.

        Args:
            target: ``logits``, ``q``, ``k``, ``v``, ``probs``, ``a`` or ``w``.

        Returns:
            The ``TensorQuant``, or None."""
        return next((p for p in self.parts if p.target == target), None)

    def get(self, kind: type[T]) -> T | None:
        """The transform of a type.

        Args:
            kind: a ``Transform`` subclass (``Smooth``, ``Gptq``, ...).

        Returns:
            The transform, or None."""
        return next((t for t in self.transforms if isinstance(t, kind)), None)

    def with_part(self, part: TensorQuant | Transform) -> QuantSpec:
        """This spec with a part in place of its part of the same target or transform type, or added.

        Args:
            part: a ``TensorQuant`` or a ``Transform``."""
        same = (lambda p: isinstance(p, TensorQuant) and p.target == part.target) if isinstance(part, TensorQuant) \
            else (lambda t: type(t) is type(part))
        return QuantSpec((*(p for p in (*self.parts, *self.transforms) if not same(p)), part), name=self.name)

    def with_layers(self, layers) -> QuantSpec:
        """This spec on some decoder layers only.

        Args:
            layers: layer indices; None: every layer."""
        return self.without(Layers) if layers is None else self.with_part(Layers(tuple(layers)))

    def without(self, kind: type[Transform]) -> QuantSpec:
        """This spec without its transform of a type.

        Args:
            kind: a ``Transform`` subclass."""
        return QuantSpec((*self.parts, *(t for t in self.transforms if not isinstance(t, kind))), name=self.name)

    @property
    def layers(self) -> tuple[int, ...] | None:
        """The layers it applies to (None: every layer)."""
        t = self.get(Layers)
        return None if t is None else t.indices

    @property
    def linears(self) -> tuple[str, ...] | None:
        """The linear-name patterns it quantizes (None: every ``nn.Linear`` of a decoder layer)."""
        t = self.get(Linears)
        return None if t is None else t.patterns

    @property
    def calib(self) -> str | None:
        """What it calibrates on (None: the calibration's default)."""
        t = self.get(Calib)
        return None if t is None else t.source

    @property
    def calibrated_weights(self) -> WeightAlgorithm | None:
        """Its weight algorithm (GPTQ or AWQ), or None."""
        return self.get(WeightAlgorithm)

    @property
    def gptq(self) -> GPTQConfig | None:
        return self.get(GPTQConfig)

    @property
    def awq(self) -> AWQConfig | None:
        return self.get(AWQConfig)

    def applies_to(self, layer: int) -> bool:
        """Whether the spec quantizes a decoder layer.

        Args:
            layer: the layer's index."""
        return self.layers is None or layer in self.layers

    @property
    def outlier_threshold(self) -> float | None:
        """LLM.int8's threshold, whichever rule (``outliers`` or ``bnb_outliers``) gives it; None: no decomposition."""
        t = self.get(_Threshold)
        return None if t is None else t.threshold

    @property
    def weights_mode(self) -> str:
        """bitsandbytes' weights: ``int8`` (``w=bnb-int8``), ``nf4`` (``w=bnb-nf4``) or ``none``."""
        w = self.part("w")
        return w.format.removeprefix(BNB_PREFIX) if w is not None and isinstance(w.fmt, Kernel) else "none"

    def with_weights(self, mode: str) -> QuantSpec:
        """This spec with bitsandbytes weights.

        Args:
            mode: ``int8`` or ``nf4``; ``none``: the spec unchanged."""
        if mode == "none":
            return self
        fmt = FORMATS.get(BNB_PREFIX + str(mode))
        if not isinstance(fmt, Kernel) or "w" not in fmt.targets:
            raise ParamError("mode", "one of none, int8, nf4 (bitsandbytes' weights)", mode)
        return dataclasses.replace(self, parts=(*self.parts, TensorQuant("w", fmt.name)))

    def without_weights(self) -> QuantSpec:
        """This spec without its bitsandbytes weights part (what runs through our emulation)."""
        keep = tuple(p for p in self.parts if not isinstance(p.fmt, Kernel) or p.target != "w")
        return self if keep == self.parts else dataclasses.replace(self, parts=keep)

    @property
    def has_attention(self) -> bool:
        """Whether anything happens inside attention (a q/k/v/logits/probs part, or a transform there)."""
        return any(p.target in TARGETS for p in self.parts) or any(t.attention for t in self.transforms)

    @property
    def has_linear(self) -> bool:
        """Whether our emulation does anything to the linear layers (an a/w part, or a transform of them);
        bitsandbytes' weights are ``weights_mode``."""
        return any(p.target in LINEAR_TARGETS for p in self.without_weights().parts) or \
            any(t.linears for t in self.transforms)

    @property
    def is_identity(self) -> bool:
        return not self.has_attention and not self.has_linear and self.weights_mode == "none"

    @property
    def is_logits_only(self) -> bool:
        """The paper's form: a logits part or nothing (``logits``), with no other part or transform than
        ``layers:``."""
        return all(p.target == "logits" for p in self.parts) and all(isinstance(t, Layers) for t in self.transforms)

    @property
    def bits(self) -> int:
        """The fewest bits per element any part uses (16: none)."""
        return min((p.nominal_bits for p in self.parts), default=UNQUANTIZED_BITS)

    @property
    def columns(self) -> Columns:
        """Its columns in a sweep table (``Columns``)."""
        if not self.is_logits_only:
            return Columns(self.bits, KERNEL_FORMAT, str(self))
        if not self.parts:
            return Columns(UNQUANTIZED_BITS, "int", "per_tensor")
        return Columns(self.bits, self.parts[0].format, self.parts[0].granularity or "per_row")

    @property
    def description(self) -> str:
        """What it does, in words for the paper's form (``4-bit int per_tensor``), else its text."""
        if not self.is_logits_only:
            return str(self)
        if not self.parts:
            return f"{UNQUANTIZED_BITS} (unquantized)"
        p = self.parts[0]
        layers = f" layers {','.join(map(str, self.layers))}" if self.layers else ""
        return f"{p.fmt.words(p.bits)} {self.columns.granularity}{layers}"

    @property
    def label(self) -> str:
        """Tables and the console: the recipe's name, else ``description``."""
        return self.name or self.description

    def __str__(self) -> str:
        return "; ".join([*map(str, self.parts), *map(str, self.transforms)]) or "none"

    @classmethod
    def of(cls, spec: QuantSpec | str | None) -> QuantSpec:
        """A spec from what a caller may pass.

        Args:
            spec: a ``QuantSpec`` (returned as it is), its text or a recipe name; None: unquantized."""
        return cls() if spec is None else cls.parse(spec) if isinstance(spec, str) else spec

    @classmethod
    def parse(cls, text: str) -> QuantSpec:
        """A spec from its text, a recipe's name (``RECIPES``), or recipe names
        and parts joined by ``;``.

        Args:
            text: the spec's text."""
        text = text.strip()
        if not text:
            raise OutlierscopeError("empty quantization spec: give a recipe name (see `outlierscope recipes`), a spec "
                                    "like 'k=int4/per_group:32', or 'none'")
        if text in RECIPES:
            return dataclasses.replace(cls.parse(RECIPES[text].text), name=text)
        if text == "none":
            return cls()
        items = [s.strip() for s in text.split(";")]
        if "" in items:
            raise OutlierscopeError(f"an empty part in {text!r} (a trailing or doubled ';'); remove it")
        names = [i for i in items if i in RECIPES]
        parts, keys = [], set()
        for item in (x.strip() for i in items for x in (RECIPES[i].text.split(";") if i in RECIPES else [i])):
            parts += _read_item(item, text, keys)
        return cls(tuple(parts), name="; ".join(names) if len(names) == len(items) else None)


def _read_item(item: str, text: str, keys: set) -> list:
    """The parts of one ``;``-separated item of ``text``: its tensor parts (``TARGETS=FORMAT``) or its transform
    (``keys``: the transform keys read so far)."""
    key, colon, arg = item.partition(":")
    kind = TRANSFORMS.get(key) if "=" not in key else None
    if kind is not None and (colon or kind.bare):
        if key in keys:
            raise OutlierscopeError(f"{key} is given twice in {text!r}; give it once")
        keys.add(key)
        return [kind.parse(arg if colon else None, text)]
    if "=" not in item and ":" not in item:
        if "calib" in keys and any(c in item for c in "/.\\"):
            raise OutlierscopeError(f"{item!r} in {text!r} reads as the rest of a calib: path, but ';' separates "
                                    "the parts of a spec; rename the file without ';'")
        _unknown_recipe(item, text)
    return parse_part(item)


def _unknown_recipe(item: str, text: str):
    import difflib

    close = [item.lower()] if item.lower() in RECIPES else difflib.get_close_matches(item, list(RECIPES), n=3, cutoff=0.5)
    raise OutlierscopeError(f"unknown quantization recipe {item!r}" + (f" in {text!r}" if item != text else "")
                            + f": expected one of {', '.join(RECIPES)} or a spec like 'q,k=int8/per_block:128; smooth_k'"
                            + (f"; did you mean {', '.join(close)}?" if close else ""))


def build_spec(bits: int, format: str = "int", granularity: str = "per_tensor", layers=None) -> QuantSpec:
    """The paper's settings (a sweep's ``--bits``, ``--format``, ``--granularity``, ``--layers``) as a spec.

    ``QuantSpec.logits``; 16 bits is unquantized, where format, granularity and layers do not apply (a typo in them is
    still an error).

    Args:
        bits: the width.
        format: the logits' format.
        granularity: the logits' granularity.
        layers: the layers quantized; None: all."""
    return QuantSpec.logits(bits, format, granularity, layers=None if bits == UNQUANTIZED_BITS else layers)


LINEAR_RECIPES = tuple(n for n in RECIPES if QuantSpec.parse(n).has_linear)  # the recipes of linear layers
