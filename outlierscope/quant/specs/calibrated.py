"""The settings of the weight algorithms a spec names: ``gptq[:KEY=VALUE,...]`` (:class:`GPTQConfig`) and
``awq[:KEY=VALUE,...]`` (:class:`AWQConfig`), with their text form; the algorithms themselves are
:mod:`outlierscope.quant.weights.gptq` and :mod:`outlierscope.quant.weights.awq`."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.specs.config_fields import check_field_types, check_repeat

ORDERS = ("none", "desc", "gar")
SEQUENTIAL = ("subset", "layer")  # GPT-QModel's true_sequential; llm-compressor's sequential pipeline


@dataclass(frozen=True)
class GPTQConfig:
    """How GPTQ runs (a spec's ``gptq`` or ``gptq:KEY=VALUE,...``; the defaults are the paper's): ``damp`` (a fraction
    of the Hessian's mean diagonal added to it), ``order`` (:func:`~outlierscope.quant.weights.gptq.column_order`), ``block`` (columns per lazy batch),
    ``static`` (group scales from the weights before any update, as llm-compressor), ``sequential`` (within a
    decoder layer: ``subset``, each group of linears reading one input calibrated on inputs through the layer's
    already-rounded linears, GPT-QModel's ``true_sequential``; ``layer``, every linear's Hessian from one pass
    through the layer as it was, llm-compressor's sequential pipeline), and the calibration: ``samples`` sequences
    of ``seqlen`` tokens. GPT-QModel 7.6's defaults: ``damp=0.05,order=gar``; llm-compressor 0.14's (actorder
    static): ``order=desc,static,sequential=layer``."""

    damp: float = 0.01
    order: str = "none"
    block: int = 128
    static: bool = False
    sequential: str = "subset"
    samples: int = 128
    seqlen: int = 512

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

    def __str__(self) -> str:
        """``gptq`` and the settings that differ from the defaults, in field order (the spec's canonical text)."""
        items = [("static" if f.name == "static" else f"{f.name}={getattr(self, f.name)}")
                 for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
        return "gptq" + (":" + ",".join(items) if items else "")

    @classmethod
    def parse(cls, arg: str) -> GPTQConfig:
        """The text after ``gptq:`` (empty: the defaults); ``+`` separates as ``,`` does."""
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




@dataclass(frozen=True)
class AWQConfig:
    """How AWQ runs (a spec's ``awq`` or ``awq:KEY=VALUE,...``; the defaults are AutoAWQ's): ``grid`` (ratios tried),
    ``duo`` (1: scales from activations and weights; 0: from activations only), ``clip`` (1: search each group's
    clipping bound), ``shrink`` (the largest fraction the bound may shrink by), ``clip_tokens`` (calibration tokens
    the clipping search reads), and the calibration: ``samples`` sequences of ``seqlen`` tokens (AutoAWQ: 128 x 512)."""

    grid: int = 20
    duo: int = 1
    clip: int = 1
    shrink: float = 0.5
    clip_tokens: int = 512
    samples: int = 128
    seqlen: int = 512

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

    def __str__(self) -> str:
        """``awq`` and the settings that differ from the defaults, in field order (the spec's canonical text)."""
        items = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        return "awq" + (":" + ",".join(items) if items else "")

    @classmethod
    def parse(cls, arg: str) -> AWQConfig:
        """The text after ``awq:`` (empty: the defaults); ``+`` separates as ``,`` does."""
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
