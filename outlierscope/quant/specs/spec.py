"""What to quantize: one frozen spec for everything the toolkit quantizes, with one text form and one parser.

A :class:`QuantSpec` holds one :class:`TensorQuant` part per quantized tensor and the transforms applied first
(smoothing, rotations, LLM.int8's decomposition), scoped by ``layers:`` and ``linears:``. Its text is its identity
(``QuantSpec.parse(str(spec)) == spec``; a sweep cell's settings are derived from it)::

    logits=int4/per_tensor                                      # the paper's Figure 8 (QuantSpec(bits=4))
    q=int8/per_block:128; k=int8/per_block:64; smooth_k        # SageAttention (sage1)
    k=asym2/per_channel:32; v=asym2/per_group:32               # KIVI, 2 bits
    q=mxfp4; k=mxfp4; probs=mxfp4; v=mxfp4                      # MX: 32-element blocks along the reduction dim
    w=fint8/per_channel; a=fint8/per_token                     # W8A8 (llm-compressor, compressed-tensors)
    w=int8/per_channel; a=int8/per_token; smooth:0.5           # SmoothQuant (its restricted grid), alpha 0.5
    w=int4/per_channel; a=int4/per_token; rotate:0             # W4A4 with a seeded Hadamard rotation (QuaRot)
    w=bnb-nf4                                                   # bitsandbytes Linear4bit weights (NF4, block 64)
    w8a8; kivi-4bit                                             # recipe names combine with each other and with parts

The paper's keyword form is the same type: ``QuantSpec(bits=4)`` is ``logits=int4/per_tensor``, ``QuantSpec(bits=8,
format="e4m3", granularity="per_head", layers=(0, 1))`` is ``logits=e4m3/per_head; layers:0,1``, ``QuantSpec(bits=16)``
quantizes nothing (``none``), and ``backend="bitsandbytes"`` (int8 per row) is ``logits=bnb-int8``.

Attention targets: ``logits`` (pre-softmax, after scaling, before soft-capping and masking), ``q``, ``k``, ``v``
(after RoPE and QK-norm, k and v per KV head: what a KV cache holds; ``kv`` in the text is ``k`` and ``v`` alike),
``probs`` (P, before P.V). Formats: ``int2``..``int8`` (symmetric absmax; the logits take up to ``int15``),
``asym2``..``asym8`` (min-max with a zero point, as KIVI), ``e4m3``/``e5m2`` (FP8, absmax to the format's max), and
the block formats ``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp6_e3m2``, ``mxfp6_e2m3``, ``mxfp4``, ``mxint8``, ``nvfp4``
(their blocks run along the dimension the next matmul reduces: head_dim for q and k, keys for P, tokens for v).
Granularities of q/k/v (B, H, T, d): ``per_tensor`` (a sequence), ``per_head``, ``per_token`` (= ``per_row``: one
token's d values), ``per_channel[:N]`` (a channel over all tokens, or groups of N tokens), ``per_block:N`` (N
consecutive tokens x d, as kernels tile them), ``per_group:G`` (G consecutive channels of a token). P: ``per_row``
or ``static`` (P <= 1: the scale is 1 / the format's max, as SageAttention2's FP8 P). Logits: ``per_tensor`` (one
scale per sequence and layer), ``per_head``, ``per_row`` (the paper's absmax). ``smooth_k``, ``smooth_q:N``,
``hadamard:SEED``: SageAttention's smoothing and a random-sign Hadamard rotation of q and k (exact in full precision).

Linear layers (``nn.Linear`` of the decoder layers; :mod:`outlierscope.quant.linears.schemes`): ``a`` (a linear's input,
(tokens, in_features)): ``per_token``, ``per_tensor`` (one scale per sequence, dynamic), ``per_group:G``, ``static``
(one scale per linear from a calibration pass); ``w`` (the weight, (out_features, in_features)): ``per_channel``,
``per_group:G``, ``per_tensor``. Formats as above (RTN); MX and NVFP4 blocks run along in_features (NVFP4's
per-tensor scale: the weight's, and each sequence's for activations). ``zintB`` (``w=`` only): the integer-zero-point grid of GPTQ
and AWQ checkpoints (GPT-QModel's ``sym=False``, compressed-tensors' asymmetric int). ``fintB``: the full-range
symmetric grid of compressed-tensors and torchao (absmax / 127.5 onto [-128, 127] at 8 bits, values divided by the scale) where
``intB`` is the restricted one (absmax / 127 onto [-127, 127]: SmoothQuant's, bitsandbytes', vLLM's dynamic
activation kernel). ``smooth:ALPHA`` (SmoothQuant), ``rotate:SEED`` (a random-sign Hadamard rotation of every
quantized linear's input), ``outliers:T`` (LLM.int8's decomposition as the paper states it), ``bnb_outliers:T``
(bitsandbytes' rule: only the elements with |x| >= T are left out of a token's scale), ``linears:PATTERN[,PATTERN]``
(module paths inside a decoder layer: ``self_attn.*``, ``mlp.down_proj``), ``calib:SOURCE`` (what ``smooth`` and
``static`` calibrate on: ``hellaswag`` (default), a .txt/.jsonl file, or a SmoothQuant ``act_scales.pt``).
``gptq[:KEY=VALUE,...]`` rounds the ``w=`` part with GPTQ and ``awq[:KEY=VALUE,...]`` scales and clips it with AWQ,
both calibrated layer after layer on ``calib:`` text (default: LAMBADA's last passages; :mod:`~outlierscope.quant.weights.gptq`,
:mod:`~outlierscope.quant.weights.awq`). ``w=bnb-int8`` / ``w=bnb-nf4``: bitsandbytes' own ``Linear8bitLt`` / ``Linear4bit`` replace every decoder linear
(the ``--weights int8|nf4`` of sweeps); they stand alone among the linear parts and apply to every layer.
``layers:`` applies to the attention and the linear parts alike. Lists also take ``+`` for ``,``
(``q+k=int8/per_token``, ``linears:self_attn.*+mlp.down_proj``, ``layers:0+2``), a form that survives lm-eval's
``model_args``, which split at commas; the canonical text uses commas.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.quant.numerics.names import BACKENDS, FORMATS, UNQUANTIZED_BITS
from outlierscope.quant.specs.calibrated import AWQ_GRIDS, GPTQ_GRIDS, AWQConfig, GPTQConfig
from outlierscope.quant.specs.parts import (  # noqa: F401 (re-exported: the spec's vocabulary)
    ALL_TARGETS,
    BLOCK_FORMATS,
    BNB_FORMATS,
    FLOAT_FORMATS,
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


def _logits_part(bits, format, granularity, backend) -> TensorQuant | None:
    """The logits part of the paper's keyword form (``QuantSpec(bits=4, granularity="per_head")``); None at 16 bits."""
    fmt, gran, backend = format or "int", granularity or "per_tensor", backend or "torch"
    if fmt not in FORMATS:  # a typo is an error at 16 bits too, where these settings do not apply
        raise ParamError("format", f"one of {', '.join(FORMATS)}", fmt)
    if gran not in GRANULARITIES["logits"]:
        raise ParamError("granularity", f"one of {', '.join(GRANULARITIES['logits'])}", gran)
    if backend not in BACKENDS:
        raise ParamError("backend", f"one of {', '.join(BACKENDS)}", backend)
    if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= UNQUANTIZED_BITS:
        raise ParamError("bits", f"in 2..{UNQUANTIZED_BITS} ({UNQUANTIZED_BITS} = unquantized)", bits)
    if bits == UNQUANTIZED_BITS:
        return None
    if backend == "bitsandbytes":
        if (fmt, bits, gran) != ("int", 8, "per_row"):
            raise ParamError("backend", "'torch' unless format int, bits 8, granularity per_row (bitsandbytes' int8 "
                             f"rows), with {fmt}, {bits}, {gran}", backend)
        return TensorQuant("logits", "bnb-int8")
    if fmt in FLOAT_FORMATS:
        if bits != 8:
            raise ParamError("bits", f"8 (or {UNQUANTIZED_BITS} = unquantized) for format {fmt}", bits)
        return TensorQuant("logits", fmt, None, gran)
    return TensorQuant("logits", fmt, bits, gran)


_FLAGS = ("smooth_q", "hadamard", "layers", "smooth", "rotate", "outliers", "bnb_outliers", "linears", "calib", "gptq",
          "awq")
_TRANSFORMS = ("smooth_k", "smooth_q", "hadamard", "smooth", "rotate", "outliers", "bnb_outliers", "linears", "calib",
               "gptq", "awq")


@dataclass(frozen=True, init=False)
class QuantSpec:
    """Everything a model is quantized with (the text form in the module docstring).

    ``parts``: one :class:`TensorQuant` per target, in :data:`ALL_TARGETS` order. Attention: ``smooth_k`` (subtract
    K's per-channel mean over the sequence's tokens: exact under softmax), ``smooth_q`` (subtract Q's per-channel mean
    over blocks of that many rows and add ``mean_q . k^T`` back in full precision, as SageAttention2), ``hadamard``
    (seed of a random-sign Hadamard rotation of q and k along head_dim). Linear layers: ``smooth`` (SmoothQuant's
    alpha), ``rotate`` (seed of a random-sign Hadamard rotation of each quantized linear's input), ``outliers`` /
    ``bnb_outliers`` (LLM.int8's threshold, the paper's or bitsandbytes' rule), ``linears`` (module-path patterns
    inside a decoder layer; None: every ``nn.Linear``), ``calib`` (what ``smooth`` and static activation scales
    calibrate on; None: ``hellaswag``). ``layers``: None: every layer. ``name``: the recipe it came from (not part of
    its identity).

    The paper's keyword form builds the logits part: ``QuantSpec(bits=4)``, ``QuantSpec(bits=8, format="e4m3",
    granularity="per_row", layers=(0, 1))``, ``QuantSpec(bits=16)`` (unquantized)."""

    parts: tuple[TensorQuant, ...] = ()
    smooth_k: bool = False
    smooth_q: int | None = None
    hadamard: int | None = None
    layers: tuple[int, ...] | None = None
    name: str | None = field(default=None, compare=False)  # the recipe it came from, if any
    smooth: float | None = None
    rotate: int | None = None
    outliers: float | None = None
    linears: tuple[str, ...] | None = None
    bnb_outliers: float | None = None
    calib: str | None = None
    gptq: GPTQConfig | None = None
    awq: AWQConfig | None = None

    def __init__(self, parts=(), *, bits: int | None = None, format: str | None = None,
                 granularity: str | None = None, backend: str | None = None, **fields):
        known = {f.name: f.default for f in dataclasses.fields(QuantSpec)}
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise TypeError(f"QuantSpec() got an unexpected keyword argument {unknown[0]!r}")
        if bits is None and (format, granularity, backend) != (None, None, None):
            raise ParamError("bits", "a bit width with format, granularity or backend (they describe the logits part: "
                             "QuantSpec(bits=8, format='e4m3'))", None)
        logits = _logits_part(bits, format, granularity, backend) if bits is not None else None
        for key, default in known.items():
            object.__setattr__(self, key, fields.get(key, default))
        object.__setattr__(self, "parts", tuple(parts) + ((logits,) if logits else ()))
        self._check()

    def _check_types(self) -> None:
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
            value = getattr(self, key)
            if value is not None and not ok(value):
                raise ParamError(key, expected, value)
        bad = [p for p in self.parts if not isinstance(p, TensorQuant)]
        if bad:
            raise ParamError("parts", "TensorQuant parts (parse_part('k=int4/per_token'))", bad[0])
        for key in ("layers", "linears"):
            if getattr(self, key) is not None:
                object.__setattr__(self, key, tuple(getattr(self, key)))

    def _check(self) -> None:
        self._check_types()
        parts = sorted(self.parts, key=lambda p: ALL_TARGETS.index(p.target))
        seen = [p.target for p in parts]
        dup = sorted({t for t in seen if seen.count(t) > 1})
        if dup:
            raise OutlierscopeError(f"target {dup[0]} is quantized twice; give each target one format")
        object.__setattr__(self, "parts", tuple(parts))
        if self.smooth_q is not None and self.smooth_q < 1:
            raise OutlierscopeError(f"smooth_q needs a block of rows >= 1, got {self.smooth_q}")
        for key in ("hadamard", "rotate"):
            seed = getattr(self, key)
            if seed is not None and not 0 <= seed < 2**63:
                raise OutlierscopeError(f"{key}:SEED needs a seed in 0..2^63-1 (a torch generator's range), got {seed}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))
            if not self.layers or min(self.layers) < 0:
                raise ParamError("layers", "at least one layer index >= 0 (or None: every layer)", self.layers)
        self._check_linear()
        self._check_bnb()
        self._check_gptq()
        self._check_awq()

    def _check_gptq(self) -> None:
        """GPTQ rounds a ``w=`` part on an integer grid (fint, int, zint), per channel or in groups, of the decoder layers'
        linears, alone among the weight transforms (not built with smoothing, rotations or LLM.int8)."""
        if self.gptq is None:
            return
        w = self.part("w")
        if w is None or w.format not in GPTQ_GRIDS or w.granularity not in ("per_channel", "per_group"):
            raise OutlierscopeError(f"gptq rounds a w= part of {'/'.join(GPTQ_GRIDS)} bits per_channel or per_group "
                                    f"(e.g. w=fint4/per_group:128; gptq), got {w or 'no w= part'}")
        other = [k for k in ("smooth", "rotate", "outliers", "bnb_outliers") if getattr(self, k) is not None]
        if other:
            raise OutlierscopeError(f"gptq with {other[0]}: GPTQ on transformed weights is not built; drop one of the "
                                    "two")
        a = self.part("a")
        if a is not None and a.granularity == "static":
            raise OutlierscopeError("gptq with a=.../static: one calibration text would serve two passes; use a "
                                    "dynamic activation granularity with gptq")
        if "lm_head" in (self.linears or ()):
            raise OutlierscopeError("gptq quantizes the decoder layers' linears, layer after layer; leave lm_head out "
                                    "of linears:")
        if self.gptq.order == "gar" and w.granularity != "per_group":
            raise OutlierscopeError("gptq:order=gar reorders whole groups; give w=.../per_group:G or another order")
        if (self.calib or "").endswith(".pt"):
            raise OutlierscopeError(f"calib:{self.calib}: gptq calibrates on text (its Hessians), not on act_scales")

    def _check_awq(self) -> None:
        """AWQ scales and clips a ``w=`` part on an integer grid (int, fint, zint), per channel or in groups, of the
        decoder layers' linears, alone among the weight transforms."""
        if self.awq is None:
            return
        w = self.part("w")
        if w is None or w.format not in AWQ_GRIDS or w.granularity not in ("per_channel", "per_group"):
            raise OutlierscopeError(f"awq scales and clips a w= part of {'/'.join(AWQ_GRIDS)} bits per_channel or "
                                    f"per_group (e.g. w=int4/per_group:128; awq), got {w or 'no w= part'}")
        other = [k for k in ("gptq", "smooth", "rotate", "outliers", "bnb_outliers") if getattr(self, k) is not None]
        if other:
            raise OutlierscopeError(f"awq with {other[0]}: AWQ with another weight or input transform is not built; "
                                    "drop one of the two")
        a = self.part("a")
        if a is not None and a.granularity == "static":
            raise OutlierscopeError("awq with a=.../static: one calibration text would serve two passes; use a "
                                    "dynamic activation granularity with awq")
        if "lm_head" in (self.linears or ()):
            raise OutlierscopeError("awq scales the decoder layers' linears, layer after layer; leave lm_head out of "
                                    "linears:")
        if (self.calib or "").endswith(".pt"):
            raise OutlierscopeError(f"calib:{self.calib}: awq calibrates on text (its activations), not on act_scales")

    def _check_linear(self) -> None:
        if self.smooth is not None and not 0.0 <= self.smooth <= 1.0:
            raise OutlierscopeError(f"smooth:ALPHA needs an alpha in 0..1 (SmoothQuant's migration strength), got {self.smooth}")
        if self.outliers is not None and self.bnb_outliers is not None:
            raise OutlierscopeError("outliers:T (the paper's decomposition) and bnb_outliers:T (bitsandbytes' rule) "
                                    "are two ways of one thing; give one")
        for key in ("outliers", "bnb_outliers"):
            t = getattr(self, key)
            if t is not None and not t > 0:
                raise OutlierscopeError(f"{key}:T needs a threshold > 0 (LLM.int8: 6.0), got {t}")
            if t is not None and self.part("a") is None:
                raise OutlierscopeError(f"{key}:T keeps activation columns out of the a= quantization; add an a= part")
        if self.linears is not None:
            object.__setattr__(self, "linears", tuple(dict.fromkeys(self.linears)))
            bad = [p for p in self.linears if not re.fullmatch(r"[A-Za-z0-9_.*]+", p)]
            if not self.linears or bad:
                raise OutlierscopeError(f"linears:PATTERN needs module paths or * patterns like self_attn.* or "
                                        f"mlp.down_proj, got {','.join(self.linears) or 'nothing'}")
        a = self.part("a")
        if a is not None and a.granularity == "static" and self.rotate is not None:
            raise OutlierscopeError("a=.../static with rotate: the calibrated scales are of the unrotated input; use a "
                                    "dynamic activation granularity with rotate")
        needs_calib = self.smooth is not None or (a is not None and a.granularity == "static") or self.gptq is not None \
            or self.awq is not None
        if self.calib is not None and not needs_calib:
            raise OutlierscopeError("calib:SOURCE is read by smooth:ALPHA, a=.../static, gptq and awq only; leave it out")
        if self.calib is not None and (not self.calib.strip() or ";" in self.calib):
            raise OutlierscopeError(f"calib:SOURCE needs hellaswag, a text file or an act_scales.pt, got {self.calib!r}")

    def _check_bnb(self) -> None:
        """bitsandbytes' weights replace every decoder linear by its own module: none of our linear emulation applies
        to them, and they do not take ``layers:``."""
        if self.weights_mode == "none":
            return
        other = [k for k in ("smooth", "rotate", "outliers", "bnb_outliers", "linears", "calib")
                 if getattr(self, k) is not None] + (["a="] if self.part("a") else [])
        if other:
            raise OutlierscopeError(f"{self.part('w')} (bitsandbytes' own linears) with {other[0]}: our linear "
                                    "emulation does not apply to bitsandbytes' modules; drop one of the two")
        if self.layers is not None:
            raise OutlierscopeError(f"{self.part('w')} applies to every decoder layer; leave out layers: (or quantize "
                                    "the weights with w=int8/per_channel, which takes layers:)")

    def part(self, target: str) -> TensorQuant | None:
        return next((p for p in self.parts if p.target == target), None)

    def applies_to(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    @property
    def outlier_threshold(self) -> float | None:
        """LLM.int8's threshold, whichever rule (``outliers`` or ``bnb_outliers``) gives it; None: no decomposition."""
        return self.outliers if self.outliers is not None else self.bnb_outliers

    @property
    def weights_mode(self) -> str:
        """bitsandbytes' weights: ``int8`` (``w=bnb-int8``), ``nf4`` (``w=bnb-nf4``) or ``none``."""
        w = self.part("w")
        return w.format.removeprefix("bnb-") if w is not None and w.format in BNB_FORMATS else "none"

    def with_weights(self, mode: str) -> QuantSpec:
        """This spec with bitsandbytes' ``mode`` weights (``int8``, ``nf4``; ``none``: unchanged)."""
        if mode == "none":
            return self
        if f"bnb-{mode}" not in BNB_FORMATS:
            raise ParamError("mode", "one of none, int8, nf4 (bitsandbytes' weights)", mode)
        return dataclasses.replace(self, parts=(*self.parts, TensorQuant("w", f"bnb-{mode}")))

    def without_weights(self) -> QuantSpec:
        """This spec without its bitsandbytes weights part (what runs through our emulation)."""
        keep = tuple(p for p in self.parts if p.format not in BNB_FORMATS or p.target != "w")
        return self if keep == self.parts else dataclasses.replace(self, parts=keep)

    @property
    def has_attention(self) -> bool:
        """Whether anything happens inside attention (a q/k/v/logits/probs part, smoothing, a rotation of q and k)."""
        return any(p.target in TARGETS for p in self.parts) or self.smooth_k or self.smooth_q is not None \
            or self.hadamard is not None

    @property
    def has_linear(self) -> bool:
        """Whether our emulation does anything to the linear layers (an a/w part, smoothing, a rotation); bitsandbytes'
        weights are :attr:`weights_mode`."""
        return any(p.target in LINEAR_TARGETS for p in self.without_weights().parts) or self.smooth is not None \
            or self.rotate is not None

    @property
    def is_identity(self) -> bool:
        return not self.has_attention and not self.has_linear and self.weights_mode == "none"

    @property
    def is_logits_only(self) -> bool:
        """The paper's form: a logits part or nothing (``QuantSpec(bits=B, ...)``), with no other part or transform."""
        return all(p.target == "logits" for p in self.parts) and \
            not any(getattr(self, k) not in (None, False) for k in _TRANSFORMS)

    # a sweep table's columns (bits, format, granularity): the paper's logits fields for the paper's form; otherwise
    # the fewest bits any part uses, KERNEL_FORMAT and the spec's text
    @property
    def bits(self) -> int:
        if self.is_logits_only:
            return self.parts[0].grid[0] if self.parts else UNQUANTIZED_BITS
        return min((p.nominal_bits for p in self.parts), default=UNQUANTIZED_BITS)

    @property
    def format(self) -> str:
        if self.is_logits_only:
            return self.parts[0].format if self.parts else "int"
        return KERNEL_FORMAT

    @property
    def granularity(self) -> str:
        if self.is_logits_only:
            return (self.parts[0].granularity or "per_row") if self.parts else "per_tensor"
        return str(self)

    @property
    def description(self) -> str:
        """What it does, in words for the paper's form (``4-bit int per_tensor``), else its text."""
        if not self.is_logits_only:
            return str(self)
        if not self.parts:
            return f"{UNQUANTIZED_BITS} (unquantized)"
        p = self.parts[0]
        base = f"{p.bits}-bit int" if p.format == "int" else "fp8 " + p.format if p.format in FLOAT_FORMATS else \
            "8-bit bnb-int8"
        return f"{base} {self.granularity}" + (f" layers {','.join(map(str, self.layers))}" if self.layers else "")

    @property
    def label(self) -> str:
        """Tables and the console: the recipe's name, else :attr:`description`."""
        return self.name or self.description

    def __str__(self) -> str:
        items = [str(p) for p in self.parts]
        items += ["smooth_k"] * self.smooth_k + ([f"smooth_q:{self.smooth_q}"] if self.smooth_q is not None else [])
        items += [f"hadamard:{self.hadamard}"] if self.hadamard is not None else []
        items += [str(c) for c in (self.gptq, self.awq) if c is not None]
        items += [f"{k}:{v}" for k in ("smooth", "rotate", "outliers", "bnb_outliers", "calib")
                  if (v := getattr(self, k)) is not None]
        items += [f"linears:{','.join(self.linears)}"] if self.linears is not None else []
        items += [f"layers:{','.join(map(str, self.layers))}"] if self.layers is not None else []
        return "; ".join(items) or "none"

    @classmethod
    def of(cls, spec: QuantSpec | str | None) -> QuantSpec:
        """``spec`` itself, or parsed from its text or a recipe name; None: unquantized."""
        return cls() if spec is None else cls.parse(spec) if isinstance(spec, str) else spec

    @classmethod
    def parse(cls, text: str) -> QuantSpec:
        """A spec from its text, a recipe's name (:data:`~outlierscope.quant.specs.recipes.RECIPES`), or recipe names and
        parts joined by ``;``."""
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
        parts, kw = [], {}
        for item in (x.strip() for i in items for x in (RECIPES[i].text.split(";") if i in RECIPES else [i])):
            _read_item(item, text, parts, kw)
        return cls(tuple(parts), **kw, name="; ".join(names) if len(names) == len(items) else None)


def _read_item(item: str, text: str, parts: list, kw: dict) -> None:
    """One ``;``-separated item of ``text`` into ``parts`` (a ``TARGETS=FORMAT`` part) or ``kw`` (a transform)."""
    key, _, arg = item.partition(":")
    if key in kw or item == "smooth_k" and "smooth_k" in kw:
        raise OutlierscopeError(f"{key} is given twice in {text!r}; give it once")
    if item == "smooth_k":
        kw["smooth_k"] = True
    elif item in ("gptq", "awq"):
        kw[item] = GPTQConfig() if item == "gptq" else AWQConfig()
    elif key in _FLAGS and "=" not in key:
        kw[key] = _flag_value(key, arg, text)
    elif "=" not in item and ":" not in item:
        if "calib" in kw and any(c in item for c in "/.\\"):
            raise OutlierscopeError(f"{item!r} in {text!r} reads as the rest of a calib: path, but ';' separates "
                                    "the parts of a spec; rename the file without ';'")
        _unknown_recipe(item, text)
    else:
        parts += parse_part(item)


def _unknown_recipe(item: str, text: str):
    import difflib

    close = [item.lower()] if item.lower() in RECIPES else difflib.get_close_matches(item, list(RECIPES), n=3, cutoff=0.5)
    raise OutlierscopeError(f"unknown quantization recipe {item!r}" + (f" in {text!r}" if item != text else "")
                            + f": expected one of {', '.join(RECIPES)} or a spec like 'q,k=int8/per_block:128; smooth_k'"
                            + (f"; did you mean {', '.join(close)}?" if close else ""))


def _flag_value(key: str, arg: str, text: str):
    if key == "linears":
        return tuple(p.strip() for p in re.split("[,+]", arg))  # '+': lm-eval's model_args split at commas
    if key == "calib":
        return arg.strip()
    if key in ("gptq", "awq"):
        return GPTQConfig.parse(arg) if key == "gptq" else AWQConfig.parse(arg)
    try:
        if key == "layers":
            return tuple(parse_layers(arg.replace("+", ",")))
        return float(arg) if key in ("smooth", "outliers", "bnb_outliers") else int(arg)
    except (ValueError, TypeError):
        expected = {"layers": "layers:0-3 or layers:0,2", "smooth": "smooth:0.5", "outliers": "outliers:6.0",
                    "bnb_outliers": "bnb_outliers:6.0"}
        raise OutlierscopeError(f"cannot read {key}:{arg} in {text!r}: expected "
                                + expected.get(key, f"{key}:N")) from None


def build_spec(bits: int, format: str = "int", granularity: str = "per_tensor", layers=None) -> QuantSpec:
    """The paper's settings (a sweep's ``--bits``, ``--format``, ``--granularity``, ``--layers``) as a spec:
    unquantized for 16 bits (format, granularity and layers do not apply; a typo in them is still an error)."""
    if bits == UNQUANTIZED_BITS:
        _logits_part(bits, format, granularity, None)
        return QuantSpec()
    return QuantSpec(bits=bits, format=format, granularity=granularity,
                     layers=tuple(layers) if layers is not None else None)


LINEAR_RECIPES = tuple(n for n in RECIPES if QuantSpec.parse(n).has_linear)  # the recipes of linear layers
