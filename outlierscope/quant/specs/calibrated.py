"""The settings of the weight algorithms a spec names: ``gptq[:KEY=VALUE,...]`` (``GPTQConfig``) and
``awq[:KEY=VALUE,...]`` (``AWQConfig``), with their text form; the algorithms themselves are
``outlierscope.quant.weights.gptq`` and ``outlierscope.quant.weights.awq``."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import ClassVar

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.numerics.registry import integer_formats
from outlierscope.quant.specs.config_fields import check_field_types, check_repeat
from outlierscope.quant.specs.transforms import Transform, register_transform


class WeightAlgorithm(Transform):
    """A weight algorithm that calibrates a ``w=`` part on an integer grid, per channel or in groups, of the decoder
    layers' linears, layer after layer, on text, alone among the weight transforms.

    Class attributes: ``does`` (what it does to the part), ``example`` (a spec that runs it), ``alone`` (the
    transforms it is not built with), ``why_alone`` (said when one is given too), ``reads`` (what it calibrates on)."""

    bare = True
    does: ClassVar[str] = ""
    example: ClassVar[str] = ""
    alone: ClassVar[tuple[str, ...]] = ()
    why_alone: ClassVar[str] = ""
    reads: ClassVar[str] = ""

    def arg(self):
        """The settings that differ from the defaults, in field order (None: every default)."""
        items = [self._item(f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
        return ",".join(items) if items else None

    def _item(self, name: str) -> str:
        return f"{name}={getattr(self, name)}"

    def check(self, spec) -> None:
        w = spec.part("w")
        if w is None or not w.fmt.integer or w.granularity not in ("per_channel", "per_group"):
            raise OutlierscopeError(f"{self.key} {self.does} a w= part of {'/'.join(integer_formats())} bits "
                                    f"per_channel or per_group (e.g. {self.example}), got {w or 'no w= part'}")
        other = [t.key for t in spec.transforms if t.key in self.alone]
        if other:
            raise OutlierscopeError(f"{self.key} with {other[0]}: {self.why_alone}; drop one of the two")
        a = spec.part("a")
        if a is not None and a.granularity == "static":
            raise OutlierscopeError(f"{self.key} with a=.../static: one calibration text would serve two passes; use "
                                    f"a dynamic activation granularity with {self.key}")
        if "lm_head" in (spec.linears or ()):
            raise OutlierscopeError(f"{self.key} calibrates the decoder layers' linears, layer after layer; leave "
                                    "lm_head out of linears:")
        if (spec.calib or "").endswith(".pt"):
            raise OutlierscopeError(f"calib:{spec.calib}: {self.key} calibrates on text ({self.reads}), not on "
                                    "act_scales")

ORDERS = ("none", "desc", "gar")
SEQUENTIAL = ("subset", "layer")  # GPT-QModel's true_sequential; llm-compressor's sequential pipeline


@register_transform
@dataclass(frozen=True)
class GPTQConfig(WeightAlgorithm):
    """GPTQ (Frantar et al., 2022) rounding of the ``w=`` part, layer after layer: a spec's ``gptq[:KEY=VALUE,...]``.

    The defaults are the paper's; GPT-QModel 7.6's are ``damp=0.05,order=gar``, llm-compressor 0.14's (actorder
    static) ``order=desc,static,sequential=layer``.

    Attributes:
        damp: a fraction of the Hessian's mean diagonal added to it.
        order: the column order (``column_order``: none, desc, gar).
        block: columns per lazy batch.
        static: group scales from the weights before any update (llm-compressor's).
        sequential: ``subset`` (each group of linears that reads one input, calibrated after the rounded ones before
            it: GPT-QModel's true_sequential) or ``layer`` (one pass per layer: llm-compressor's sequential pipeline).
        samples: calibration sequences.
        seqlen: tokens per calibration sequence."""

    damp: float = 0.01
    order: str = "none"
    block: int = 128
    static: bool = False
    sequential: str = "subset"
    samples: int = 128
    seqlen: int = 512

    key, rank = "gptq", 20
    identity = {"gptq": "contiguous-damping-mean"}
    does, example, reads = "rounds", "w=fint4/per_group:128; gptq", "its Hessians"
    alone = ("smooth", "rotate", "outliers", "bnb_outliers")
    why_alone = "GPTQ on transformed weights is not built"

    def __post_init__(self):
        check_field_types(self, "gptq")
        if not 0 < self.damp < 1:  # GPT-QModel's range too: 0 leaves a singular Hessian singular
            raise OutlierscopeError(f"gptq:damp=X needs 0 < X < 1 (a fraction of the mean Hessian diagonal), got {self.damp}")
        if self.order not in ORDERS:
            raise OutlierscopeError(f"gptq:order= must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.sequential not in SEQUENTIAL:
            raise OutlierscopeError(f"gptq:sequential= must be one of {', '.join(SEQUENTIAL)}, got {self.sequential!r}")
        for key in ("block", "samples", "seqlen"):
            if getattr(self, key) < 1:
                raise OutlierscopeError(f"gptq:{key}=N needs N >= 1, got {getattr(self, key)}")

    def _item(self, name: str) -> str:
        return "static" if name == "static" else super()._item(name)

    def check(self, spec) -> None:
        super().check(spec)
        if self.order == "gar" and spec.part("w").granularity != "per_group":
            raise OutlierscopeError("gptq:order=gar reorders whole groups; give w=.../per_group:G or another order")

    @classmethod
    def parse(cls, arg: str | None, text: str = "") -> GPTQConfig:
        """The text after ``gptq:`` (None or empty: the defaults); ``+`` separates as ``,`` does."""
        arg = arg or ""
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        kw: dict = {}
        for item in (s.strip() for s in re.split("[,+]", arg) if s.strip()):
            key, eq, value = item.partition("=")
            if key not in kinds or (key == "static") == bool(eq):
                raise OutlierscopeError(f"cannot read gptq:{arg}: expected KEY=VALUE items among damp, order, block, "
                                        "sequential, samples, seqlen and the word static, e.g. gptq:damp=0.05,order=gar")
            check_repeat("gptq", arg, key, kw)
            try:
                kw[key] = True if key == "static" else float(value) if key == "damp" \
                    else value if key in ("order", "sequential") else int(value)
            except ValueError:
                raise OutlierscopeError(f"cannot read gptq:{item}: expected a number") from None
        return cls(**kw)


@register_transform
@dataclass(frozen=True)
class AWQConfig(WeightAlgorithm):
    """AWQ (Lin et al., 2023) scaling and clipping of the ``w=`` part, layer after layer: a spec's ``awq[:KEY=VALUE]``.

    The defaults are AutoAWQ's (128 x 512 tokens).

    Attributes:
        grid: the scale ratios tried.
        duo: 1, scales from activations and weights; 0, from activations only.
        clip: 1, search each group's clipping bound.
        shrink: the largest fraction a bound may shrink by.
        clip_tokens: calibration tokens the clipping search reads.
        samples: calibration sequences.
        seqlen: tokens per calibration sequence."""

    grid: int = 20
    duo: int = 1
    clip: int = 1
    shrink: float = 0.5
    clip_tokens: int = 512
    samples: int = 128
    seqlen: int = 512

    key, rank = "awq", 21
    does, example, reads = "scales and clips", "w=int4/per_group:128; awq", "its activations"
    alone = ("gptq", "smooth", "rotate", "outliers", "bnb_outliers")
    why_alone = "AWQ with another weight or input transform is not built"

    def __post_init__(self):
        check_field_types(self, "awq")
        for key in ("grid", "clip_tokens", "samples", "seqlen"):
            if getattr(self, key) < 1:
                raise OutlierscopeError(f"awq:{key}=N needs N >= 1, got {getattr(self, key)}")
        for key in ("duo", "clip"):
            if getattr(self, key) not in (0, 1):
                raise OutlierscopeError(f"awq:{key}= takes 0 or 1, got {getattr(self, key)}")
        if not 0 <= self.shrink < 1:
            raise OutlierscopeError(f"awq:shrink=X needs 0 <= X < 1 (the largest fraction a clipping bound shrinks "
                                    f"by), got {self.shrink}")

    @classmethod
    def parse(cls, arg: str | None, text: str = "") -> AWQConfig:
        """The text after ``awq:`` (None or empty: the defaults); ``+`` separates as ``,`` does."""
        arg = arg or ""
        kinds = {f.name for f in dataclasses.fields(cls)}
        kw: dict = {}
        for item in (s.strip() for s in re.split("[,+]", arg) if s.strip()):
            key, eq, value = item.partition("=")
            if key not in kinds or not eq:
                raise OutlierscopeError(f"cannot read awq:{arg}: expected KEY=VALUE items among "
                                        f"{', '.join(sorted(kinds))}, e.g. awq:grid=20,clip=0")
            check_repeat("awq", arg, key, kw)
            try:
                kw[key] = float(value) if key == "shrink" else int(value)
            except ValueError:
                raise OutlierscopeError(f"cannot read awq:{item}: expected a number") from None
        return cls(**kw)
