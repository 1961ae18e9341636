"""Quantization of what low-bit attention kernels and KV caches quantize: a spec per tensor, combined, with a text form.

A :class:`TensorQuant` says how one tensor of the attention is quantized; an :class:`AttnQuant` combines them with
the exact-in-full-precision transforms the kernels apply first (K and Q smoothing, a Hadamard rotation). Text form
(``AttnQuant.parse(str(spec)) == spec``; the text is a sweep cell's identity)::

    q=int8/per_block:128; k=int8/per_block:64; smooth_k        # SageAttention (sage1)
    k=asym2/per_channel:32; v=asym2/per_group:32               # KIVI, 2 bits
    q=mxfp4; k=mxfp4; probs=mxfp4; v=mxfp4                      # MX: 32-element blocks along the reduction dim
    logits=int4/per_tensor                                      # the paper's Figure 8

Targets: ``logits`` (pre-softmax), ``q``, ``k``, ``v`` (after RoPE and QK-norm, k and v per KV head: what a KV cache
holds; ``kv`` in the text is ``k`` and ``v`` alike), ``probs`` (P, before P.V). Formats: ``int2``..``int8`` (symmetric
absmax), ``asym2``..``asym8`` (min-max with a zero point, as KIVI), ``e4m3``/``e5m2`` (FP8, absmax to the format's
max), and the block formats ``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp6_e3m2``, ``mxfp6_e2m3``, ``mxfp4``, ``mxint8``,
``nvfp4`` (their blocks run along the dimension the next matmul reduces: head_dim for q and k, keys for P, tokens
for v). Granularities of q/k/v (B, H, T, d): ``per_tensor`` (a sequence), ``per_head``, ``per_token`` (= ``per_row``:
one token's d values), ``per_channel[:N]`` (a channel over all tokens, or groups of N tokens), ``per_block:N`` (N
consecutive tokens x d, as kernels tile them), ``per_group:G`` (G consecutive channels of a token). P: ``per_row``
or ``static`` (P <= 1: the scale is 1 / the format's max, as SageAttention2's FP8 P).
Logits: ``per_tensor``, ``per_head``, ``per_row`` (the paper's absmax, :class:`~outlierscope.quant.spec.QuantSpec`).

Linear layers (``nn.Linear`` of the decoder layers; :mod:`outlierscope.quant.linear`) in the same text::

    w=fint8/per_channel; a=fint8/per_token                     # W8A8 (llm-compressor, compressed-tensors)
    w=int8/per_channel; a=int8/per_token; smooth:0.5           # SmoothQuant (its restricted grid), alpha 0.5
    w=int4/per_channel; a=int4/per_token; rotate:0             # W4A4 with a seeded Hadamard rotation (QuaRot)
    w=int8/per_channel; a=int8/per_token; outliers:6.0         # LLM.int8(): input columns with |x| >= 6 unquantized
    w8a8; kivi-4bit                                             # recipe names combine with each other and with parts

``a`` (a linear's input, (tokens, in_features)): ``per_token``, ``per_tensor`` (one scale per sequence, dynamic),
``per_group:G`` (G consecutive input channels of a token), ``static`` (one scale per linear from a calibration
pass: max |x| / the format's max); ``w`` (the weight, (out_features, in_features)): ``per_channel`` (an output
row), ``per_group:G`` (G consecutive inputs of a row), ``per_tensor``. Formats as above (RTN); MX and NVFP4 blocks
run along in_features for both (NVFP4's per-tensor scale: the weight's, and each sequence's for activations).
``fintB`` (``a=``/``w=``, and ``q``/``k``/``v``): the full-range symmetric grid of compressed-tensors and torchao
(absmax / 127.5 onto [-128, 127] at 8 bits; values divided by the scale, as compressed-tensors: torchao multiplies by
its reciprocal, which moves codes at exact ties) where ``intB`` is the restricted one (absmax / 127 onto [-127, 127]:
SmoothQuant's, bitsandbytes', vLLM's dynamic activation kernel). The named ``w8a8``, ``w4a16``, ``w4a8`` are on the
full-range grid (llm-compressor's presets); ``w8a8-restricted``, ``w8a8-sq``, ``llm-int8``, ``w4a4`` on the restricted
one (their sources'). ``smooth:ALPHA`` (SmoothQuant), ``rotate:SEED`` (a random-sign Hadamard rotation of every quantized linear's input
dimension), ``outliers:T`` (LLM.int8's decomposition as the paper
states it: input columns with some |x| >= T leave the quantized product whole), ``bnb_outliers:T`` (bitsandbytes'
rule: only the elements with |x| >= T are left out of a token's scale; their columns still run in full precision), ``linears:PATTERN[,PATTERN]`` (which linears, by module path
inside a decoder layer: ``self_attn.*``, ``mlp.down_proj``; default every ``nn.Linear`` of the decoder layers),
``calib:SOURCE`` (what ``smooth`` and ``static`` calibrate on: ``hellaswag`` (default), a .txt/.jsonl file, or a
SmoothQuant ``act_scales.pt``). ``layers:`` applies to the attention and the linear parts alike. Lists also take
``+`` for ``,`` (``q+k=int8/per_token``, ``linears:self_attn.*+mlp.down_proj``, ``layers:0+2``), a form that survives
lm-eval's ``model_args``, which split at commas; the canonical text uses commas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.formats import MX_FORMATS

TARGETS = ("logits", "q", "k", "v", "probs")
LINEAR_TARGETS = ("a", "w")  # a linear layer's input (activations) and weight
ALL_TARGETS = TARGETS + LINEAR_TARGETS
FLOAT_FORMATS = ("e4m3", "e5m2")
BLOCK_FORMATS = (*MX_FORMATS, "nvfp4")
GRANULARITIES = {  # target kind -> granularities it takes
    "logits": ("per_tensor", "per_head", "per_row"),
    "qkv": ("per_tensor", "per_head", "per_token", "per_row", "per_channel", "per_block", "per_group"),
    "probs": ("per_row", "static"),
    "a": ("per_token", "per_tensor", "per_group", "static"),
    "w": ("per_channel", "per_group", "per_tensor"),
}
SIZED = {"per_block": True, "per_group": True, "per_channel": False}  # granularity -> its size is required


def _kind(target: str) -> str:
    return target if target in ("logits", "probs", "a", "w") else "qkv"


@dataclass(frozen=True)
class TensorQuant:
    """One tensor's quantization: ``format`` (``int``/``asym`` with ``bits``, an FP8 or a block format),
    ``granularity`` and its ``size`` (tokens per block, channels per group, tokens per channel group)."""

    target: str
    format: str
    bits: int | None = None
    granularity: str | None = None
    size: int | None = None

    def __post_init__(self):
        if self.target not in ALL_TARGETS:
            raise OutlierscopeError(f"quantization target must be one of {', '.join(ALL_TARGETS)} (or kv), "
                                    f"got {self.target!r}")
        if self.format in ("int", "asym", "fint"):
            if not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
                raise OutlierscopeError(f"{self.target}: {self.format} needs bits in 2..8, got {self.bits!r}")
            if self.format == "fint" and self.target in ("logits", "probs"):
                raise OutlierscopeError(f"{self.target}: fint (the full-range grid of compressed-tensors and torchao) "
                                        "is for a=, w=, q, k and v parts; use int here")
        elif self.format in FLOAT_FORMATS or self.format in BLOCK_FORMATS:
            if self.bits is not None:
                raise OutlierscopeError(f"{self.target}: format {self.format} has no bits setting")
        else:
            raise OutlierscopeError(f"{self.target}: unknown format {self.format!r}; expected int2..int8, asym2..asym8, "
                                    "fint2..fint8 (a=, w=, q, k, v), "
                                    f"{', '.join(FLOAT_FORMATS + BLOCK_FORMATS)}")
        self._check_granularity()

    def _check_granularity(self) -> None:
        g, kind = self.granularity, _kind(self.target)
        if self.format in BLOCK_FORMATS:
            if g is not None:
                raise OutlierscopeError(f"{self.target}: {self.format} brings its own blocks; leave out the granularity")
            if self.target == "logits":
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
        """(bits, format) of a symmetric grid as :mod:`outlierscope.quant.primitives` names it: ``int`` with its bits,
        FP8 formats at 8."""
        return (self.bits, self.format) if self.format in ("int", "fint") else (8, self.format)

    @property
    def format_text(self) -> str:
        return f"{self.format}{self.bits}" if self.bits is not None else self.format

    def __str__(self) -> str:
        g = "" if self.granularity is None else f"/{self.granularity}" + (f":{self.size}" if self.size else "")
        return f"{self.target}={self.format_text}{g}"


_PART = re.compile(r"^(?P<targets>[a-z,+]+)=(?P<fmt>[a-z0-9_]+)(?:/(?P<gran>[a-z_]+)(?::(?P<size>\d+))?)?$")


def _parse_part(text: str) -> list[TensorQuant]:
    m = _PART.match(text)
    if not m:
        raise OutlierscopeError(f"cannot read {text!r}: expected TARGETS=FORMAT[/GRANULARITY[:N]], e.g. k=int4/per_group:32")
    fmt, bits = m["fmt"], None
    num = re.fullmatch(r"(int|asym|fint)(\d+)", fmt)
    if num:
        fmt, bits = num[1], int(num[2])
    targets = [t for name in re.split("[,+]", m["targets"]) for t in (("k", "v") if name == "kv" else (name,))]
    size = int(m["size"]) if m["size"] else None
    return [TensorQuant(t, fmt, bits, m["gran"], size) for t in targets]


@dataclass(frozen=True)
class AttnQuant:
    """What an attention kernel and the linear layers quantize (the text form in the module docstring).

    Attention: ``parts`` (one :class:`TensorQuant` per target, in :data:`ALL_TARGETS` order), ``smooth_k`` (subtract
    K's per-channel mean over the sequence's tokens: exact under softmax), ``smooth_q`` (subtract Q's per-channel mean
    over blocks of that many rows and add ``mean_q . k^T`` back in full precision, as SageAttention2), ``hadamard``
    (seed of a random-sign Hadamard rotation of q and k along head_dim: exact in full precision).
    Linear layers (:mod:`outlierscope.quant.linear`): the ``a`` and ``w`` parts, ``smooth`` (SmoothQuant's alpha),
    ``rotate`` (seed of a random-sign Hadamard rotation of each quantized linear's input), ``outliers`` (LLM.int8's
    threshold), ``linears`` (module-path patterns inside a decoder layer; None: every ``nn.Linear``), ``calib`` (what
    ``smooth`` and static activation scales calibrate on; None: ``hellaswag``). ``layers``: None: every layer."""

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

    def __post_init__(self):
        parts = sorted(self.parts, key=lambda p: ALL_TARGETS.index(p.target))
        seen = [p.target for p in parts]
        dup = sorted({t for t in seen if seen.count(t) > 1})
        if dup:
            raise OutlierscopeError(f"target {dup[0]} is quantized twice; give each target one format")
        if self.smooth_q is not None and self.smooth_q < 1:
            raise OutlierscopeError(f"smooth_q needs a block of rows >= 1, got {self.smooth_q}")
        for key in ("hadamard", "rotate"):
            seed = getattr(self, key)
            if seed is not None and not 0 <= seed < 2**63:
                raise OutlierscopeError(f"{key}:SEED needs a seed in 0..2^63-1 (a torch generator's range), got {seed}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted(set(self.layers))))
        object.__setattr__(self, "parts", tuple(parts))
        self._check_linear()

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
        needs_calib = self.smooth is not None or (a is not None and a.granularity == "static")
        if self.calib is not None and not needs_calib:
            raise OutlierscopeError("calib:SOURCE is read by smooth:ALPHA and a=.../static only; leave it out")
        if self.calib is not None and (not self.calib.strip() or ";" in self.calib):
            raise OutlierscopeError(f"calib:SOURCE needs hellaswag, a text file or an act_scales.pt, got {self.calib!r}")

    @property
    def outlier_threshold(self) -> float | None:
        """LLM.int8's threshold, whichever rule (``outliers`` or ``bnb_outliers``) gives it; None: no decomposition."""
        return self.outliers if self.outliers is not None else self.bnb_outliers

    def part(self, target: str) -> TensorQuant | None:
        return next((p for p in self.parts if p.target == target), None)

    def applies_to(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    @property
    def has_attention(self) -> bool:
        """Whether anything happens inside attention (a q/k/v/logits/probs part, smoothing, a rotation of q and k)."""
        return any(p.target in TARGETS for p in self.parts) or self.smooth_k or self.smooth_q is not None \
            or self.hadamard is not None

    @property
    def has_linear(self) -> bool:
        """Whether anything happens to the linear layers (an a/w part, smoothing, a rotation)."""
        return any(p.target in LINEAR_TARGETS for p in self.parts) or self.smooth is not None or self.rotate is not None

    @property
    def is_identity(self) -> bool:
        return not self.has_attention and not self.has_linear

    def __str__(self) -> str:
        items = [str(p) for p in self.parts]
        items += ["smooth_k"] * self.smooth_k + ([f"smooth_q:{self.smooth_q}"] if self.smooth_q is not None else [])
        items += [f"hadamard:{self.hadamard}"] if self.hadamard is not None else []
        items += [f"{k}:{v}" for k in ("smooth", "rotate", "outliers", "bnb_outliers", "calib")
                  if (v := getattr(self, k)) is not None]
        items += [f"linears:{','.join(self.linears)}"] if self.linears is not None else []
        items += [f"layers:{','.join(map(str, self.layers))}"] if self.layers is not None else []
        return "; ".join(items) or "none"

    @property
    def label(self) -> str:
        return self.name or str(self)

    # the attributes a sweep table and a cell record read of any spec (those of QuantSpec)
    format = "attn"  # a sweep row's format: an attention spec (its text is the row's granularity)

    @property
    def granularity(self) -> str:
        return str(self)

    @property
    def bits(self) -> int:
        """Nominal bits: the fewest any part uses (FP8 and MXINT8: 8, MXFP6: 6, MXFP4 and NVFP4: 4); 16 for none."""
        return min((_nominal_bits(p) for p in self.parts), default=16)

    @classmethod
    def parse(cls, text: str) -> AttnQuant:
        """A spec from its text, a recipe's name (:data:`RECIPES`), or recipe names and parts joined by ``;``."""
        text = text.strip()
        if not text:
            raise OutlierscopeError("empty quantization spec: give a recipe name (see `outlierscope recipes`), a spec "
                                    "like 'k=int4/per_group:32', or 'none'")
        if text in RECIPES:
            return RECIPES[text].spec
        if text == "none":
            return cls()
        items = [s.strip() for s in text.split(";")]
        if "" in items:
            raise OutlierscopeError(f"an empty part in {text!r} (a trailing or doubled ';'); remove it")
        names = [i for i in items if i in RECIPES]
        parts, kw = [], {}
        for item in (x for i in items for x in (RECIPES[i].text.split(";") if i in RECIPES else [i])):
            item = item.strip()
            key, _, arg = item.partition(":")
            if key in kw or item == "smooth_k" and "smooth_k" in kw:
                raise OutlierscopeError(f"{key} is given twice in {text!r}; give it once")
            if item == "smooth_k":
                kw["smooth_k"] = True
            elif key in _FLAGS and "=" not in key:
                kw[key] = _flag_value(key, arg, text)
            elif "=" not in item and ":" not in item:
                if "calib" in kw and any(c in item for c in "/.\\"):
                    raise OutlierscopeError(f"{item!r} in {text!r} reads as the rest of a calib: path, but ';' separates "
                                            "the parts of a spec; rename the file without ';'")
                _unknown_recipe(item, text)
            else:
                parts += _parse_part(item)
        name = "; ".join(names) if len(names) == len(items) else None
        return cls(tuple(parts), **kw, name=name)


_FLAGS = ("smooth_q", "hadamard", "layers", "smooth", "rotate", "outliers", "bnb_outliers", "linears", "calib")


def _unknown_recipe(item: str, text: str):
    import difflib

    close = [item.lower()] if item.lower() in RECIPES else difflib.get_close_matches(item, list(RECIPES), n=3, cutoff=0.5)
    raise OutlierscopeError(f"unknown quantization recipe {item!r}" + (f" in {text!r}" if item != text else "")
                            + f": expected one of {', '.join(RECIPES)} or a spec like 'q,k=int8/per_block:128; smooth_k'"
                            + (f"; did you mean {', '.join(close)}?" if close else ""))


def _nominal_bits(p: TensorQuant) -> int:
    if p.bits is not None:
        return p.bits
    return {"mxfp6_e3m2": 6, "mxfp6_e2m3": 6, "mxfp4": 4, "nvfp4": 4}.get(p.format, 8)


def _flag_value(key: str, arg: str, text: str):
    from outlierscope.quant.spec import parse_layers

    if key == "linears":
        return tuple(p.strip() for p in re.split("[,+]", arg))  # '+': lm-eval's model_args split at commas
    if key == "calib":
        return arg.strip()
    try:
        if key == "layers":
            return tuple(parse_layers(arg.replace("+", ",")))
        return float(arg) if key in ("smooth", "outliers", "bnb_outliers") else int(arg)
    except (ValueError, TypeError):
        expected = {"layers": "layers:0-3 or layers:0,2", "smooth": "smooth:0.5", "outliers": "outliers:6.0",
                    "bnb_outliers": "bnb_outliers:6.0"}
        raise OutlierscopeError(f"cannot read {key}:{arg} in {text!r}: expected "
                                + expected.get(key, f"{key}:N")) from None


@dataclass(frozen=True)
class Recipe:
    """A named kernel emulation: its spec text, the source it follows, and what the emulation does not model."""

    name: str
    text: str
    source: str
    not_modelled: str

    @property
    def spec(self) -> AttnQuant:
        import dataclasses

        return dataclasses.replace(AttnQuant.parse(self.text), name=self.name)


_SAGE = "sageattention/triton/quant_per_block.py (BLKQ=128, BLKK=64)"
RECIPES = {r.name: r for r in (
    Recipe("sage1", "q=int8/per_block:128; k=int8/per_block:64; smooth_k",
           f"SageAttention (arXiv 2410.02367) sec. 3-4; {_SAGE}",
           "INT8 rounds half to even here (the kernel: half away from zero); P.V's FP16 accumulator"),
    Recipe("sage2-int4", "q=int4/per_block:4; k=int4/per_block:16; smooth_k; smooth_q:128; probs=e4m3/static; "
           "v=e4m3/per_channel", "SageAttention2 (arXiv 2411.10958) sec. 3; sageattention/triton/quant_per_thread.py",
           "per-thread groups are strided rows (Q: every 8th row of 32, K: pairs in 64); here contiguous blocks of "
           "the same size (4 and 16 rows); FP8 accumulation of P.V and its two-level fix"),
    Recipe("fa3-fp8", "q=e4m3/per_block:128; k=e4m3/per_block:128; v=e4m3/per_block:128",
           "FlashAttention-3 (arXiv 2407.08608) sec. 3.3, block quantization", "P's FP8 conversion inside the kernel; "
           "the FP32 accumulators"),
    Recipe("fa3-fp8-hadamard", "q=e4m3/per_block:128; k=e4m3/per_block:128; v=e4m3/per_block:128; hadamard:0",
           "FlashAttention-3 sec. 3.3, block quantization with incoherent processing (random-sign Hadamard)",
           "the rotation is one seeded random-sign Hadamard matrix per run (the paper: per head)"),
    Recipe("kivi-2bit", "k=asym2/per_channel:32; v=asym2/per_group:32",
           "KIVI (arXiv 2402.02750) sec. 3: K per channel, V per token, groups of 32",
           "the full-precision window of recent tokens (residual length R); the cache's streaming group fill"),
    Recipe("kivi-4bit", "k=asym4/per_channel:32; v=asym4/per_group:32", "KIVI (arXiv 2402.02750), 4 bits",
           "the full-precision window of recent tokens (residual length R)"),
    Recipe("mxfp4-attn", "q=mxfp4; k=mxfp4; probs=mxfp4; v=mxfp4",
           "OCP Microscaling Formats (MX) v1.0 sec. 5-6: 32-element blocks, E8M0 scales, FP4 E2M1 elements",
           "the matmuls' accumulation precision"),
    Recipe("mxfp8-attn", "q=mxfp8_e4m3; k=mxfp8_e4m3; probs=mxfp8_e4m3; v=mxfp8_e4m3", "OCP MX v1.0, MXFP8 E4M3",
           "the matmuls' accumulation precision"),
    Recipe("nvfp4-attn", "q=nvfp4; k=nvfp4; probs=nvfp4; v=nvfp4",
           "NVIDIA NVFP4 (16-element blocks, E4M3 block scales, FP32 per-tensor scale; per sequence here)",
           "the matmuls' accumulation precision"),
    *(Recipe(f"logits-int{b}", f"logits=int{b}/per_tensor", "Diff Transformer (arXiv 2410.05258) Figure 8",
             "nothing: it is the paper's post-hoc quantization of the logits") for b in (8, 6, 4)),
    # linear layers: weights RTN (no GPTQ/AWQ), activations dynamic unless said
    Recipe("w8a8", "w=fint8/per_channel; a=fint8/per_token",
           "llm-compressor / compressed-tensors W8A8 (INT8 channel weights, dynamic per-token activations, the "
           "full-range grid: absmax / 127.5 onto [-128, 127]); torchao Int8DynamicActivationInt8WeightConfig's grid",
           "the int32 accumulation (here float32 sums of the dequantized values); GPTQ's weight rounding (RTN here); "
           "torchao multiplies by the scale's reciprocal where compressed-tensors and we divide (codes differ at "
           "exact ties: ~0.02% of values)"),
    Recipe("w8a8-restricted", "w=int8/per_channel; a=int8/per_token",
           "W8A8 on the restricted grid (absmax / 127 onto [-127, 127]): SmoothQuant's fake quantization, "
           "bitsandbytes' int8 vectors, vLLM's dynamic per-token INT8 activation kernel",
           "the int32 accumulation (here float32 sums of the dequantized values); GPTQ's weight rounding (RTN here); "
           "not llm-compressor's W8A8 (its grid is w8a8's)"),
    Recipe("w8a8-sq", "w=int8/per_channel; a=int8/per_token; smooth:0.5",
           "SmoothQuant (arXiv 2211.10438) sec. 4, alpha 0.5, on its own restricted INT8 grid (absmax / 127); "
           "llm-compressor's SmoothQuantModifier + W8A8 is 'w8a8; smooth:0.5' (the full-range grid)",
           "the scales are applied to the linear's input, not folded into the norm (same values); calibration text "
           "and size (calib:, 8 x 512 tokens)"),
    Recipe("w4a16", "w=fint4/per_group:128", "llm-compressor / compressed-tensors W4A16 (symmetric INT4 on the "
           "full-range grid: absmax / 7.5 onto [-8, 7], groups of 128 inputs)",
           "GPTQ/AWQ's weight rounding (RTN here); the kernel's FP16 dequantization"),
    Recipe("w4a8", "w=fint4/per_group:128; a=fint8/per_token",
           "llm-compressor / compressed-tensors W4A8 (INT4 group-128 weights, dynamic per-token INT8 activations, "
           "both on the full-range grid)", "GPTQ's weight rounding (RTN here)"),
    Recipe("w4a4", "w=int4/per_channel; a=int4/per_token", "QuaRot (arXiv 2404.00456) W4A4 without its rotation "
           "(symmetric per-channel weights, per-token activations)", "GPTQ (RTN here); QuaRot's clipping ratio"),
    Recipe("w4a4-rotated", "w=int4/per_channel; a=int4/per_token; rotate:0",
           "QuaRot (arXiv 2404.00456): a random Hadamard rotation of each linear's input (x H, W H), then W4A4",
           "QuaRot folds the rotation of the residual stream into the weights and norms and rotates online only "
           "down_proj's input; here every quantized linear's input is rotated online (the same arithmetic in full "
           "precision); GPTQ (RTN here)"),
    Recipe("fp8-dynamic", "w=e4m3/per_channel; a=e4m3/per_token",
           "llm-compressor FP8_DYNAMIC (E4M3 channel weights, dynamic per-token E4M3 activations)",
           "the FP8 GEMM's accumulation precision"),
    Recipe("mxfp4", "w=mxfp4; a=mxfp4", "OCP MX v1.0 MXFP4 weights and activations (32-element blocks along the "
           "inputs, E8M0 scales: floor(log2(amax)) - 2); torchao MXLinear", "the matmul's accumulation precision; "
           "not compressed-tensors' MXFP4, which rounds a block's max up to the next power of 2 when its mantissa is "
           ">= 1.75 before taking the exponent (~6% of values differ)"),
    Recipe("nvfp4", "w=nvfp4; a=nvfp4", "NVIDIA NVFP4 weights and activations (llm-compressor NVFP4: 16-element "
           "blocks, E4M3 block scales, FP32 per-tensor scales)", "the activations' per-tensor scale is each "
           "sequence's (llm-compressor calibrates a static one); the accumulation precision"),
    Recipe("llm-int8", "w=int8/per_channel; a=int8/per_token; bnb_outliers:6.0",
           "bitsandbytes Linear8bitLt(threshold=6.0) (int8_vectorwise_quant: only the elements with |x| >= 6 are "
           "left out of a row's absmax; their columns are computed in full precision against the int8 weights)",
           "the outlier columns are chosen per sequence (bitsandbytes: over the batch's rows), so a sequence's "
           "result does not depend on the batch; bitsandbytes' float16 copies of x and W (~0.3%)"),
    Recipe("llm-int8-paper", "w=int8/per_channel; a=int8/per_token; outliers:6.0",
           "LLM.int8() (arXiv 2208.07339) sec. 3.2: the outlier columns leave X whole (out of every row's scale)",
           "the outlier columns are chosen per sequence, so a sequence's result does not depend on the batch; "
           "not bitsandbytes' rule (llm-int8: its row scales still see an outlier column's other elements)"),
)}

LINEAR_RECIPES = tuple(n for n, r in RECIPES.items() if r.spec.has_linear)
