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
import re
from dataclasses import dataclass, field

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.quant.numerics.names import BACKENDS, UNQUANTIZED_BITS
from outlierscope.quant.numerics.registry import FORMATS, Kernel, format_named, logits_formats
from outlierscope.quant.specs.calibrated import AWQConfig, GPTQConfig
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
from outlierscope.quant.specs.validate import check_fields


def _logits_part(bits, format, granularity, backend) -> TensorQuant | None:
    """The logits part of the paper's keyword form (``QuantSpec(bits=4, granularity="per_head")``); None at 16 bits."""
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


BNB_PREFIX = "bnb-"  # bitsandbytes' weights formats: the prefix of a weights mode (int8, nf4)
BNB_LOGITS = "bnb-int8"  # the format of the keyword form's backend="bitsandbytes"

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
        check_fields(self)


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
        return w.format.removeprefix(BNB_PREFIX) if w is not None and isinstance(w.fmt, Kernel) else "none"

    def with_weights(self, mode: str) -> QuantSpec:
        """This spec with bitsandbytes' ``mode`` weights (``int8``, ``nf4``; ``none``: unchanged)."""
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
            return self.parts[0].nominal_bits if self.parts else UNQUANTIZED_BITS
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
        return f"{p.fmt.words(p.bits)} {self.granularity}" + (f" layers {','.join(map(str, self.layers))}" if self.layers else "")

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
    if key == "layers":
        try:
            return tuple(parse_layers(arg.replace("+", ",")))
        except ValueError as e:  # its reason (a range from high to low, an index past MAX_LAYERS) names the fix
            raise OutlierscopeError(f"cannot read layers:{arg} in {text!r}: {e}") from None
    try:
        return float(arg) if key in ("smooth", "outliers", "bnb_outliers") else int(arg)
    except (ValueError, TypeError):
        expected = {"smooth": "smooth:0.5", "outliers": "outliers:6.0",
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
