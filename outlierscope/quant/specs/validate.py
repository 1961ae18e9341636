"""The checks of a :class:`~outlierscope.quant.specs.spec.QuantSpec` at construction: each field holds what the spec's
text can say (so ``parse(str(spec)) == spec`` for every spec that can be built), and the parts and transforms fit
together (GPTQ and AWQ on integer weight grids, smoothing's alpha, LLM.int8's thresholds, bitsandbytes alone).
``check_fields(spec)`` also normalizes (parts in target order, layers sorted, linears deduplicated): the spec's
constructor calls it on the instance it is building, the only place a frozen spec is written."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.quant.numerics.registry import integer_formats
from outlierscope.quant.specs.calibrated import AWQConfig, GPTQConfig
from outlierscope.quant.specs.parts import ALL_TARGETS, MAX_LAYERS, TensorQuant


def _check_types(spec) -> None:
    """Each field holds what the spec's text can say (so ``parse(str(spec)) == spec``): a ParamError naming the
    field otherwise (``rotate=1.5``, ``smooth=True``, ``layers=(0.5,)``, ``calib=' x '``)."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def is_num(v):
        return (is_int(v) or isinstance(v, float)) and math.isfinite(v)

    checks = {"smooth_k": (lambda v: isinstance(v, bool), "True or False"),
              **{k: (is_int, "an integer or None") for k in ("smooth_q", "hadamard", "rotate")},
              **{k: (is_num, "a finite number or None") for k in ("smooth", "outliers", "bnb_outliers")},
              "layers": (lambda v: isinstance(v, (tuple, list)) and all(is_int(i) for i in v),
                         "a tuple of integer layer indices or None"),
              "linears": (lambda v: isinstance(v, (tuple, list)) and all(isinstance(i, str) and i.strip() == i
                                                                        and i and ";" not in i for i in v),
                          "a tuple of linear name patterns or None"),
              "calib": (lambda v: isinstance(v, str) and v and v.strip() == v and ";" not in v,
                        "a calibration source without surrounding spaces or ';' (hellaswag, a file) or None"),
              "gptq": (lambda v: isinstance(v, GPTQConfig), "a GPTQConfig or None"),
              "awq": (lambda v: isinstance(v, AWQConfig), "an AWQConfig or None")}
    for key, (ok, expected) in checks.items():
        value = getattr(spec, key)
        if value is not None and not ok(value):
            raise ParamError(key, expected, value)
    bad = [p for p in spec.parts if not isinstance(p, TensorQuant)]
    if bad:
        raise ParamError("parts", "TensorQuant parts (parse_part('k=int4/per_token'))", bad[0])
    for key in ("layers", "linears"):
        if getattr(spec, key) is not None:
            object.__setattr__(spec, key, tuple(getattr(spec, key)))


def check_fields(spec) -> None:
    """Validate and normalize a just-built spec's fields (in place: parts in target order, layers sorted, linears
    deduplicated), or raise a one-line error naming what is wrong."""
    _check_types(spec)
    parts = sorted(spec.parts, key=lambda p: ALL_TARGETS.index(p.target))
    seen = [p.target for p in parts]
    dup = sorted({t for t in seen if seen.count(t) > 1})
    if dup:
        raise OutlierscopeError(f"target {dup[0]} is quantized twice; give each target one format")
    object.__setattr__(spec, "parts", tuple(parts))
    if spec.smooth_q is not None and spec.smooth_q < 1:
        raise OutlierscopeError(f"smooth_q needs a block of rows >= 1, got {spec.smooth_q}")
    for key in ("hadamard", "rotate"):
        seed = getattr(spec, key)
        if seed is not None and not 0 <= seed < 2**63:
            raise OutlierscopeError(f"{key}:SEED needs a seed in 0..2^63-1 (a torch generator's range), got {seed}")
    if spec.layers is not None:
        object.__setattr__(spec, "layers", tuple(sorted(set(spec.layers))))
        if not spec.layers or min(spec.layers) < 0:
            raise ParamError("layers", "at least one layer index >= 0 (or None: every layer)", spec.layers)
        if max(spec.layers) >= MAX_LAYERS:
            raise ParamError("layers", f"layer indices below {MAX_LAYERS} (a model's layers)", max(spec.layers))
    _check_linear(spec)
    _check_bnb(spec)
    _check_weight_algorithms(spec)


@dataclass(frozen=True)
class _WeightAlgorithm:
    """What the checks say of one weight algorithm a spec names (``gptq``, ``awq``)."""

    key: str  # the spec's field and text key
    does: str  # what it does to a w= part
    example: str  # a spec that runs it
    alone: tuple[str, ...]  # the transforms it is not built with
    why_alone: str  # said when one of them is given too
    reads: str  # what it calibrates on


_WEIGHT_ALGORITHMS = (
    _WeightAlgorithm("gptq", "rounds", "w=fint4/per_group:128; gptq", ("smooth", "rotate", "outliers", "bnb_outliers"),
                     "GPTQ on transformed weights is not built", "its Hessians"),
    _WeightAlgorithm("awq", "scales and clips", "w=int4/per_group:128; awq",
                     ("gptq", "smooth", "rotate", "outliers", "bnb_outliers"),
                     "AWQ with another weight or input transform is not built", "its activations"),
)


def _check_weight_algorithms(spec) -> None:
    """GPTQ and AWQ each calibrate a ``w=`` part on an integer grid, per channel or in groups, of the decoder layers'
    linears, layer after layer, on text, alone among the weight transforms."""
    for alg in _WEIGHT_ALGORITHMS:
        cfg = getattr(spec, alg.key)
        if cfg is None:
            continue
        w = spec.part("w")
        if w is None or not w.fmt.integer or w.granularity not in ("per_channel", "per_group"):
            raise OutlierscopeError(f"{alg.key} {alg.does} a w= part of {'/'.join(integer_formats())} bits per_channel "
                                    f"or per_group (e.g. {alg.example}), got {w or 'no w= part'}")
        other = [k for k in alg.alone if getattr(spec, k) is not None]
        if other:
            raise OutlierscopeError(f"{alg.key} with {other[0]}: {alg.why_alone}; drop one of the two")
        a = spec.part("a")
        if a is not None and a.granularity == "static":
            raise OutlierscopeError(f"{alg.key} with a=.../static: one calibration text would serve two passes; use a "
                                    f"dynamic activation granularity with {alg.key}")
        if "lm_head" in (spec.linears or ()):
            raise OutlierscopeError(f"{alg.key} calibrates the decoder layers' linears, layer after layer; leave "
                                    "lm_head out of linears:")
        if getattr(cfg, "order", None) == "gar" and w.granularity != "per_group":
            raise OutlierscopeError("gptq:order=gar reorders whole groups; give w=.../per_group:G or another order")
        if (spec.calib or "").endswith(".pt"):
            raise OutlierscopeError(f"calib:{spec.calib}: {alg.key} calibrates on text ({alg.reads}), not on "
                                    "act_scales")


def _check_linear(spec) -> None:
    if spec.smooth is not None and not 0.0 <= spec.smooth <= 1.0:
        raise OutlierscopeError(f"smooth:ALPHA needs an alpha in 0..1 (SmoothQuant's migration strength), got {spec.smooth}")
    if spec.outliers is not None and spec.bnb_outliers is not None:
        raise OutlierscopeError("outliers:T (the paper's decomposition) and bnb_outliers:T (bitsandbytes' rule) "
                                "are two ways of one thing; give one")
    for key in ("outliers", "bnb_outliers"):
        t = getattr(spec, key)
        if t is not None and not t > 0:
            raise OutlierscopeError(f"{key}:T needs a threshold > 0 (LLM.int8: 6.0), got {t}")
        if t is not None and spec.part("a") is None:
            raise OutlierscopeError(f"{key}:T keeps activation columns out of the a= quantization; add an a= part")
    if spec.linears is not None:
        object.__setattr__(spec, "linears", tuple(dict.fromkeys(spec.linears)))
        bad = [p for p in spec.linears if not re.fullmatch(r"[A-Za-z0-9_.*]+", p)]
        if not spec.linears or bad:
            raise OutlierscopeError(f"linears:PATTERN needs module paths or * patterns like self_attn.* or "
                                    f"mlp.down_proj, got {','.join(spec.linears) or 'nothing'}")
    a = spec.part("a")
    if a is not None and a.granularity == "static" and spec.rotate is not None:
        raise OutlierscopeError("a=.../static with rotate: the calibrated scales are of the unrotated input; use a "
                                "dynamic activation granularity with rotate")
    needs_calib = spec.smooth is not None or (a is not None and a.granularity == "static") or spec.gptq is not None \
        or spec.awq is not None
    if spec.calib is not None and not needs_calib:
        raise OutlierscopeError("calib:SOURCE is read by smooth:ALPHA, a=.../static, gptq and awq only; leave it out")
    if spec.calib is not None and (not spec.calib.strip() or ";" in spec.calib):
        raise OutlierscopeError(f"calib:SOURCE needs hellaswag, a text file or an act_scales.pt, got {spec.calib!r}")


def _check_bnb(spec) -> None:
    """bitsandbytes' weights replace every decoder linear by its own module: none of our linear emulation applies
    to them, and they do not take ``layers:``."""
    if spec.weights_mode == "none":
        return
    other = [k for k in ("smooth", "rotate", "outliers", "bnb_outliers", "linears", "calib")
             if getattr(spec, k) is not None] + (["a="] if spec.part("a") else [])
    if other:
        raise OutlierscopeError(f"{spec.part('w')} (bitsandbytes' own linears) with {other[0]}: our linear "
                                "emulation does not apply to bitsandbytes' modules; drop one of the two")
    if spec.layers is not None:
        raise OutlierscopeError(f"{spec.part('w')} applies to every decoder layer; leave out layers: (or quantize "
                                "the weights with w=int8/per_channel, which takes layers:)")
