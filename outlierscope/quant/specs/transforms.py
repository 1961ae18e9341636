"""The transforms a spec names beside its tensor parts, each one typed part (``Transform``) that carries its text
key, its parser, its validation and its cross-checks with the rest of the spec; registered by key
(``register_transform``). A transform found by type may act inside attention (``Transform.qk``) and on each
quantized linear (``Transform.linear_input``, ``Transform.linear_weight``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.quant.specs.parts import MAX_LAYERS, parse_layers


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


@dataclass(frozen=True)
class Transform:
    """A spec's transform, one typed part whose text is ``key`` or ``key:ARG``; subclasses set the class attributes.

    Attributes:
        key: its text key.
        bare: whether the key alone is its text.
        rank: its place in a spec's canonical text.
        attention: whether it changes attention by itself.
        linears: whether it changes linear layers by itself.
        identity: keys the identity of a cell computed with it gains.
        qk_rank: its place among the q/k transforms of the attention stage (the rotation first, then smoothing)."""

    key: ClassVar[str] = ""
    bare: ClassVar[bool] = False
    rank: ClassVar[int] = 100
    attention: ClassVar[bool] = False
    linears: ClassVar[bool] = False
    identity: ClassVar[dict] = {}
    qk_rank: ClassVar[int] = 100

    def arg(self) -> str | None:
        """The text after ``key:`` (None: the key alone)."""
        return None

    def __str__(self) -> str:
        arg = self.arg()
        return self.key if arg is None else f"{self.key}:{arg}"

    @classmethod
    def parse(cls, arg: str | None, text: str) -> Transform:
        """The transform of ``key:arg`` (``arg`` None: the key alone).

        Args:
            arg: the text after ``key:``.
            text: the whole spec's text, for errors."""
        raise NotImplementedError

    def check(self, spec) -> None:
        """One-line errors where this transform does not fit the rest of a spec.

        Args:
            spec: the ``QuantSpec`` it is part of."""

    def qk(self, q, k, q_valid, k_valid):
        """q and k transformed before they are quantized, exactly (``q k^T`` unchanged); the default returns them.

        Args:
            q: the queries ``(B, H, T, d)``.
            k: the keys ``(B, KV, S, d)``.
            q_valid: bool ``(B, T)``: the real query tokens.
            k_valid: bool ``(B, S)``: the real key tokens."""
        return q, k

    def linear_input(self, x):
        """A quantized linear's input before it is quantized (with ``linear_weight``: the output unchanged).

        Args:
            x: the input ``(..., I)``."""
        return x

    def linear_weight(self, w):
        """A quantized linear's weight before it is quantized.

        Args:
            w: the weight ``(O, I)``."""
        return w


TRANSFORMS: dict[str, type[Transform]] = {}


def register_transform(cls: type[Transform]) -> type[Transform]:
    """Add a transform type to the registry by its key.

    Args:
        cls: a ``Transform`` subclass with its own, new ``key``.

    Returns:
        ``cls``, so that it can be used as a class decorator.

    Raises:
        ValueError: an empty key, or one registered already."""
    if not cls.key or cls.key in TRANSFORMS:
        raise ValueError(f"transform key {cls.key!r} is empty or registered already")
    TRANSFORMS[cls.key] = cls
    return cls


def summary(kind: type[Transform]) -> str:
    """The first line of a transform type's docstring.

    Args:
        kind: a registered transform type."""
    return (kind.__doc__ or kind.key).strip().splitlines()[0]


def _number(key: str, arg: str, text: str, kind=float, example: str = ""):
    try:
        return kind(arg)
    except (ValueError, TypeError):
        raise OutlierscopeError(f"cannot read {key}:{arg} in {text!r}: expected {example or key + ':N'}") from None


@register_transform
@dataclass(frozen=True)
class SmoothK(Transform):
    """K minus its per-channel mean over the sequence's tokens (exact under softmax: SageAttention's)."""

    key, bare, rank, attention, qk_rank = "smooth_k", True, 10, True, 10

    @classmethod
    def parse(cls, arg, text):
        if arg is not None:
            raise OutlierscopeError(f"smooth_k takes no argument, got smooth_k:{arg} in {text!r}")
        return cls()

    def qk(self, q, k, q_valid, k_valid):
        from outlierscope.quant.numerics.exact import smooth_k

        return q, smooth_k(k, k_valid)


@register_transform
@dataclass(frozen=True)
class SmoothQ(Transform):
    """Q minus its per-channel mean over blocks of rows, the mean's product with k added back (SageAttention2's).

    Attributes:
        rows: query rows per block (the attention stage adds ``mean_q . k^T`` back in full precision)."""

    rows: int
    key, rank, attention = "smooth_q", 11, True

    def __post_init__(self):
        if not _is_int(self.rows):
            raise ParamError("smooth_q", "an integer", self.rows)
        if self.rows < 1:
            raise OutlierscopeError(f"smooth_q needs a block of rows >= 1, got {self.rows}")

    def arg(self):
        return str(self.rows)

    @classmethod
    def parse(cls, arg, text):
        return cls(_number("smooth_q", arg, text, int))


class _Seeded(Transform):
    """A random-sign Hadamard rotation drawn from ``seed``."""

    def __post_init__(self):
        if not _is_int(self.seed):
            raise ParamError(self.key, "an integer", self.seed)
        if not 0 <= self.seed < 2**63:
            raise OutlierscopeError(f"{self.key}:SEED needs a seed in 0..2^63-1 (a torch generator's range), got "
                                    f"{self.seed}")

    def arg(self):
        return str(self.seed)

    @classmethod
    def parse(cls, arg, text):
        return cls(_number(cls.key, arg, text, int))


@register_transform
@dataclass(frozen=True)
class Hadamard(_Seeded):
    """A random-sign Hadamard rotation of q and k along head_dim (exact: the rotation is orthonormal).

    Attributes:
        seed: draws the signs."""

    seed: int
    key, rank, attention, qk_rank = "hadamard", 12, True, 0
    identity = {"rotation": "input-signs"}

    def qk(self, q, k, q_valid, k_valid):
        from outlierscope.quant.numerics.exact import hadamard

        rot = hadamard(q.shape[-1], self.seed, q.dtype, q.device)  # (d, d)
        return q @ rot, k @ rot


@register_transform
@dataclass(frozen=True)
class Smooth(Transform):
    """SmoothQuant's migration of each linear's input scale into its weight.

    Attributes:
        alpha: the migration strength, 0..1."""

    alpha: float
    key, rank, linears = "smooth", 30, True

    def __post_init__(self):
        if not _is_number(self.alpha):
            raise ParamError("smooth", "a finite number", self.alpha)
        if not 0.0 <= self.alpha <= 1.0:
            raise OutlierscopeError(f"smooth:ALPHA needs an alpha in 0..1 (SmoothQuant's migration strength), got "
                                    f"{self.alpha}")

    def arg(self):
        return str(self.alpha)

    @classmethod
    def parse(cls, arg, text):
        return cls(_number("smooth", arg, text, float, "smooth:0.5"))


@register_transform
@dataclass(frozen=True)
class Rotate(_Seeded):
    """A random-sign Hadamard rotation of each quantized linear's input (and weight): QuaRot's.

    Attributes:
        seed: draws the signs."""

    seed: int
    key, rank, linears = "rotate", 31, True
    identity = {"rotation": "input-signs", "rotate": "two-factors"}

    def check(self, spec):
        a = spec.part("a")
        if a is not None and a.granularity == "static":
            raise OutlierscopeError("a=.../static with rotate: the calibrated scales are of the unrotated input; use a "
                                    "dynamic activation granularity with rotate")


class _Threshold(Transform):
    """LLM.int8's decomposition: activation columns with some |x| >= ``threshold`` kept in full precision."""

    def __post_init__(self):
        if not _is_number(self.threshold):
            raise ParamError(self.key, "a finite number", self.threshold)
        if not self.threshold > 0:
            raise OutlierscopeError(f"{self.key}:T needs a threshold > 0 (LLM.int8: 6.0), got {self.threshold}")

    def arg(self):
        return str(self.threshold)

    @classmethod
    def parse(cls, arg, text):
        return cls(_number(cls.key, arg, text, float, f"{cls.key}:6.0"))

    def check(self, spec):
        if len([t for t in spec.transforms if isinstance(t, _Threshold)]) > 1:
            raise OutlierscopeError("outliers:T (the paper's decomposition) and bnb_outliers:T (bitsandbytes' rule) "
                                    "are two ways of one thing; give one")
        if spec.part("a") is None:
            raise OutlierscopeError(f"{self.key}:T keeps activation columns out of the a= quantization; add an a= part")


@register_transform
@dataclass(frozen=True)
class Outliers(_Threshold):
    """LLM.int8's decomposition, the paper's rule: the outlier columns leave the quantization and its scales.

    Attributes:
        threshold: the magnitude that makes a column an outlier (6.0)."""

    threshold: float
    key, rank = "outliers", 32


@register_transform
@dataclass(frozen=True)
class BnbOutliers(_Threshold):
    """LLM.int8's decomposition, bitsandbytes' rule: only the outlier elements leave the row scales.

    Attributes:
        threshold: the magnitude that makes a column an outlier (6.0)."""

    threshold: float
    key, rank = "bnb_outliers", 33


@register_transform
@dataclass(frozen=True)
class Calib(Transform):
    """What smoothing, static activation scales, GPTQ and AWQ calibrate on.

    Attributes:
        source: ``hellaswag``, a text file or an ``act_scales.pt``."""

    source: str
    key, rank = "calib", 40

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source or self.source.strip() != self.source \
                or ";" in self.source:
            raise ParamError("calib", "a calibration source without surrounding spaces or ';' (hellaswag, a file)",
                             self.source)

    def arg(self):
        return self.source

    @classmethod
    def parse(cls, arg, text):
        if not arg.strip():
            raise OutlierscopeError(f"calib:SOURCE needs hellaswag, a text file or an act_scales.pt, got {arg!r}")
        return cls(arg.strip())

    def check(self, spec):
        a = spec.part("a")
        if not (spec.get(Smooth) or (a is not None and a.granularity == "static") or spec.calibrated_weights):
            raise OutlierscopeError("calib:SOURCE is read by smooth:ALPHA, a=.../static, gptq and awq only; leave it out")


@register_transform
@dataclass(frozen=True)
class Linears(Transform):
    """The linears of a decoder layer that are quantized (module-path patterns; default: every ``nn.Linear``).

    Attributes:
        patterns: paths or ``*`` patterns (``self_attn.*``, ``mlp.down_proj``, ``lm_head``)."""

    patterns: tuple[str, ...]
    key, rank = "linears", 50

    def __post_init__(self):
        if not isinstance(self.patterns, (tuple, list)) or not all(
                isinstance(p, str) and p.strip() == p and p and ";" not in p for p in self.patterns):
            raise ParamError("linears", "a tuple of linear name patterns", self.patterns)
        object.__setattr__(self, "patterns", tuple(dict.fromkeys(self.patterns)))
        bad = [p for p in self.patterns if not re.fullmatch(r"[A-Za-z0-9_.*]+", p)]
        if not self.patterns or bad:
            raise OutlierscopeError(f"linears:PATTERN needs module paths or * patterns like self_attn.* or "
                                    f"mlp.down_proj, got {','.join(self.patterns) or 'nothing'}")

    def arg(self):
        return ",".join(self.patterns)

    @classmethod
    def parse(cls, arg, text):
        return cls(tuple(p.strip() for p in re.split("[,+]", arg)))  # '+': lm-eval's model_args split at commas


@register_transform
@dataclass(frozen=True)
class Layers(Transform):
    """The decoder layers a spec applies to (default: every layer).

    Attributes:
        indices: layer indices (sorted, each once, below ``MAX_LAYERS``)."""

    indices: tuple[int, ...]
    key, rank = "layers", 60

    def __post_init__(self):
        if not isinstance(self.indices, (tuple, list)) or not all(_is_int(i) for i in self.indices):
            raise ParamError("layers", "a tuple of integer layer indices", self.indices)
        object.__setattr__(self, "indices", tuple(sorted(set(self.indices))))
        if not self.indices or min(self.indices) < 0:
            raise ParamError("layers", "at least one layer index >= 0 (or None: every layer)", self.indices)
        if max(self.indices) >= MAX_LAYERS:
            raise ParamError("layers", f"layer indices below {MAX_LAYERS} (a model's layers)", max(self.indices))

    def arg(self):
        return ",".join(map(str, self.indices))

    @classmethod
    def parse(cls, arg, text):
        try:
            return cls(tuple(parse_layers(arg.replace("+", ","))))
        except ValueError as e:  # its reason (a range from high to low, an index past MAX_LAYERS) names the fix
            raise OutlierscopeError(f"cannot read layers:{arg} in {text!r}: {e}") from None
