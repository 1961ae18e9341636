"""Named observation points of a decoder-only model: one table of point kinds (``POINT_KINDS``), each
``layers.{i}.<kind>``, plus every submodule's input and output (``layers.{i}.<module path>.input``) and
``lm_head.input``. Patterns use ``*``; an unknown name fails with the closest valid ones; ``PRESETS`` name sets of
points. The model's structure is found, never assumed from a class name (``decoder_layers``,
``attention_layers``, ``trunk``): in a hybrid model only its attention layers have the ``attn.*`` points."""

from __future__ import annotations

import difflib
import fnmatch
import sys
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from outlierscope.errors import OutlierscopeError


@dataclass(frozen=True)
class PointKind:
    """One kind of observation point, ``layers.{i}.<name>``.

    Attributes:
        name: the kind's name (``attn.logits``).
        observes: what it observes, in words (its shape and valid entries).
        shape: ``map`` (batch, heads, queries, keys) or ``tokens`` (batch, tokens, channels).
        tap: where it is observed: ``logits`` (the attention function's logits stage), ``attention`` (a tap inside the
            attention function) or ``module`` (a module hook: ``hook``).
        table5: one of the paper's Table 5 kinds (the default points).
        attention: whether only attention layers have it.
        has: whether a layer has it, given its attention module and whether the model is a Diff model (None: every
            layer it applies to).
        hook: for a module tap, (module, ``input`` or ``output``) of a decoder layer."""

    name: str
    observes: str
    shape: str = "tokens"
    tap: str = "attention"
    table5: bool = False
    attention: bool = True
    has: Callable[[nn.Module | None, bool], bool] | None = None
    hook: Callable[[nn.Module], tuple[nn.Module, str]] | None = None


def _out_projection_input(block: nn.Module) -> tuple[nn.Module, str]:
    return output_projection(attention_module(block))[1], "input"


POINT_KINDS = (
    PointKind("attn.logits", "pre-softmax attention logits (q @ k^T) * scaling (batch, heads, queries, keys), valid "
              "entries causal, not padding, inside a sliding window; a Diff model's two maps are heads [0, H/2) and "
              "[H/2, H)", "map", "logits", table5=True),
    PointKind("attn.q", "queries as the attention function gets them (after RoPE and any QK-norm), (batch, tokens, "
              "heads * head_dim): channel c is head c // head_dim; valid: non-padding query rows"),
    PointKind("attn.k", "keys as the attention function gets them, before their heads are repeated (what a KV cache "
              "holds), (batch, tokens, kv_heads * head_dim); valid: keys some real query may attend to"),
    PointKind("attn.v", "values as attn.k"),
    PointKind("attn.probs", "attention probabilities after softmax, (batch, heads, queries, keys), valid entries as "
              "the logits'", "map"),
    PointKind("attn.probs_diff", "a Diff model's differential map p1 - lambda p2 per differential head, (batch, "
              "heads / 2, queries, keys)", "map", has=lambda attn, diff: diff),
    PointKind("attn.out", "the attention's output per head before the output projection (a Diff model's: after the "
              "differential combination and its group norm), (batch, tokens, heads * head_dim)", tap="module",
              has=lambda attn, diff: output_projection(attn) is not None, hook=_out_projection_input),
    PointKind("hidden", "the decoder layer's output after both residual additions, (batch, tokens, channels), "
              "valid tokens only", tap="module", table5=True, attention=False,
              hook=lambda block: (block, "output")),
)
"""Every kind of observation point ``layers.{i}.<kind>``, one ``PointKind`` each."""
KIND = {k.name: k for k in POINT_KINDS}


def register_point_kind(kind: PointKind) -> PointKind:
    """Add a module-tapped point kind (``tap="module"`` with its ``hook``) to the table; returns it.

    Args:
        kind: the new kind (a kind tapped inside the attention function also needs its tap there)."""
    global POINT_KINDS
    if kind.name in KIND or kind.tap != "module" or kind.hook is None:
        raise ValueError(f"point kind {kind.name!r}: expected a new name, tap='module' and a hook")
    POINT_KINDS = (*POINT_KINDS, kind)
    KIND[kind.name] = kind
    return kind


def unregister_point_kind(name: str) -> None:
    """Remove a kind ``register_point_kind`` added.

    Args:
        name: its name."""
    global POINT_KINDS
    POINT_KINDS = tuple(k for k in POINT_KINDS if k.name != name)
    KIND.pop(name)


KINDS = tuple(k.name for k in POINT_KINDS if k.table5)  # Table 5's two kinds (the defaults)
ATTN_TAPS = tuple(k.name for k in POINT_KINDS if k.tap == "attention")  # observed inside the attention function
ATTN_KINDS = tuple(k.name for k in POINT_KINDS if k.attention)
MAP_KINDS = tuple(k.name for k in POINT_KINDS if k.shape == "map")  # (B, H, T, S) maps; every other kind is (B, T, C)
DEFAULT_POINTS = tuple(f"layers.*.{k}" for k in KINDS)
LM_HEAD = "lm_head.input"


@dataclass(frozen=True)
class PointPreset:
    """A named set of points.

    Attributes:
        name: the preset's name (``--preset``).
        patterns: point names or patterns.
        linear_inputs: also the input of every ``nn.Linear`` of the decoder layers and the LM head (what SmoothQuant
            calibrates).
        help: one line for ``--help`` and the docs."""

    name: str
    patterns: tuple[str, ...]
    linear_inputs: bool = False
    help: str = ""


PRESETS = {p.name: p for p in (
    PointPreset("table5", DEFAULT_POINTS, help="the paper's Table 5: attention logits and hidden states"),
    PointPreset("kv", ("layers.*.attn.q", "layers.*.attn.k", "layers.*.attn.v"),
                help="queries, keys, values per channel and per token (what KV-cache quantizers see)"),
    PointPreset("sinks", ("layers.*.attn.probs",), help="attention probabilities: sink mass per layer and head"),
    PointPreset("smoothquant", (), linear_inputs=True,
                help="the input of every nn.Linear (decoder layers and LM head); exports act_scales.pt"),
)}
"""Named sets of points (``outlierscope profile --preset NAME``), each a ``PointPreset``."""


@dataclass(frozen=True)
class Point:
    """One observation point of a model.

    Attributes:
        name: its name (``layers.3.attn.logits``).
        layer: its decoder layer.
        kind: a ``POINT_KINDS`` name, ``<module path>.input|output`` or ``lm_head.input``.
        module: a module point's module, by its full name in the model (``model.layers.3.mlp.down_proj``).
        linear: whether a module point's module is an ``nn.Linear``."""

    name: str
    layer: int
    kind: str
    module: str | None = None
    linear: bool = False

    @property
    def is_map(self) -> bool:
        return self.kind in MAP_KINDS


def point_name(layer: int, kind: str) -> str:
    """The name of a layer's point: ``layers.{layer}.{kind}``.

    Args:
        layer: the decoder layer.
        kind: the point kind (``attn.logits``, ``hidden``, ...)."""
    return f"layers.{layer}.{kind}"


_ATTN_NAMES = ("attn", "self_attn", "attention", "self_attention")


def attention_module(block: nn.Module) -> nn.Module | None:
    """A block's attention module, by transformers' naming or the ``scaling`` attribute of interface attention.

    Args:
        block: a decoder layer.

    Returns:
        The module; None for a state-space, convolution or linear-attention block."""
    for name, m in block.named_modules():
        if name and (name.rsplit(".", 1)[-1] in _ATTN_NAMES or hasattr(m, "scaling")):
            return m
    return None


def _routes_through_interface(module: nn.Module) -> bool:
    """Whether the attention module's modeling file dispatches through transformers' ``AttentionInterface``."""
    return hasattr(sys.modules.get(type(module).__module__), "ALL_ATTENTION_FUNCTIONS")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers, found from its structure.

    The shallowest ``ModuleList`` of ``num_hidden_layers`` blocks of which at least one holds an attention module
    (``model.layers``, ``transformer.h``, ``model.decoder.layers``, ``gpt_neox.layers``, ...; in a hybrid model the
    other blocks are state-space or convolution layers).

    Args:
        model: the model.

    Raises:
        OutlierscopeError: a model whose attention does not go through transformers' ``AttentionInterface`` (Bloom,
            MPT; Falcon before transformers 5.25), naming that reason."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    n = getattr(cfg, "num_hidden_layers", None)
    found = [(name.count("."), name, mod) for name, mod in model.named_modules()
             if isinstance(mod, nn.ModuleList) and len(mod) and (n is None or len(mod) == n)
             and any(attention_module(b) is not None for b in mod)]
    if not found:
        raise OutlierscopeError(f"{type(model).__name__}: cannot find its decoder layers; expected a ModuleList of "
                                f"{n} blocks of which at least one holds an attention module")
    layers = min(found, key=lambda f: (f[0], f[1]))[2]
    attn = next(attention_module(b) for b in layers if attention_module(b) is not None)
    if not _routes_through_interface(attn):
        raise OutlierscopeError(f"{type(model).__name__}: its attention ({type(attn).__name__}) does not go through "
                                "transformers' AttentionInterface, so its logits cannot be observed or quantized; "
                                "models that do include Llama, Qwen, Mistral, Gemma, GPT-2, GPT-NeoX")
    return layers


def attention_layers(model: nn.Module) -> list[int]:
    """The indices (the model's own) of the decoder layers that hold attention: all of them except in hybrid models.

    Args:
        model: the model."""
    return [i for i, b in enumerate(decoder_layers(model)) if attention_module(b) is not None]


def trunk(model: nn.Module) -> nn.Module:
    """The module that maps token ids to the last hidden states (before the LM head), found structurally.

    ``model.base_model`` where it is a proper submodule, else the direct child that holds the decoder layers.

    Args:
        model: the model."""
    base = getattr(model, "base_model", model)
    if base is not model:
        return base
    layers = decoder_layers(model)
    for child in model.children():
        if any(m is layers for m in child.modules()):
            return child
    raise OutlierscopeError(f"{type(model).__name__}: cannot find the module that holds its decoder layers and "
                            "returns hidden states; expected a causal LM with a trunk and an LM head")


_OUT_PROJ = ("o_proj", "out_proj", "c_proj", "dense", "wo")


def output_projection(attn: nn.Module) -> tuple[str, nn.Module] | None:
    """The attention module's output projection: its direct child named o_proj, out_proj, c_proj, dense or wo.

    Args:
        attn: the attention module.

    Returns:
        ``(name, module)``, or None."""
    for name, m in attn.named_children():
        if name in _OUT_PROJ:
            return name, m
    return None


def is_diff(model: nn.Module) -> bool:
    """Whether the model is a DiffLlama (its maps come in pairs).

    Args:
        model: the model."""
    return getattr(getattr(model, "config", None), "model_type", None) == "diffllama"


def _prefix(model: nn.Module, target: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is target)


def lm_head(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The LM head.

    Args:
        model: the model.

    Returns:
        ``(full name, module)``, or None for a model without one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    return (_prefix(model, head), head) if isinstance(head, nn.Module) else None


def _layer_points(i: int, block: nn.Module, prefix: str, attention: bool, diff: bool) -> list[Point]:
    attn = attention_module(block) if attention else None
    out = [Point(point_name(i, k.name), i, k.name) for k in POINT_KINDS
           if (attention or not k.attention) and (k.has is None or k.has(attn, diff))]
    for path, m in block.named_modules():
        if path:
            for io in ("input", "output"):
                kind = f"{path}.{io}"
                out.append(Point(point_name(i, kind), i, kind, f"{prefix}.{i}.{path}", isinstance(m, nn.Linear)))
    return out


def all_points(model: nn.Module) -> list[Point]:
    """Every observation point of a model, layer by layer, then ``lm_head.input``.

    Args:
        model: the model."""
    layers = decoder_layers(model)
    attn, prefix, diff = set(attention_layers(model)), _prefix(model, layers), is_diff(model)
    points = [p for i, b in enumerate(layers) for p in _layer_points(i, b, prefix, i in attn, diff)]
    head = lm_head(model)
    if head is not None:
        points.append(Point(LM_HEAD, len(layers), LM_HEAD, head[0], isinstance(head[1], nn.Linear)))
    return points


def _unknown(model: nn.Module, pat: str, names: list[str]) -> OutlierscopeError:
    generic = sorted({n.replace(n.split(".")[1], "*", 1) for n in names if n.startswith("layers.")})
    close = difflib.get_close_matches(pat, names + generic, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    n = len(decoder_layers(model))
    return OutlierscopeError(
        f"unknown observation point {pat!r} for {type(model).__name__} with {n} layers: expected "
        f"layers.{{0..{n - 1}}}.{{{','.join(KINDS)},attn.q,attn.k,...,<module>.input}} or {LM_HEAD}{hint}")


def resolve_points(model: nn.Module, patterns=(), preset: str | None = None) -> list[Point]:
    """The points that names and patterns (and a preset) select, in the model's order.

    Args:
        model: the model.
        patterns: point names or ``fnmatch`` patterns (``layers.*.attn.logits``).
        preset: a ``PRESETS`` name whose points are added.

    Raises:
        OutlierscopeError: an unknown name or preset, with the closest valid names."""
    if isinstance(patterns, str):
        patterns = [patterns]
    valid = all_points(model)
    names = [p.name for p in valid]
    chosen: set[str] = set()
    if preset is not None:
        if preset not in PRESETS:
            raise OutlierscopeError(f"unknown point preset {preset!r}: expected one of {', '.join(PRESETS)}")
        patterns = [*PRESETS[preset].patterns, *patterns]
        if PRESETS[preset].linear_inputs:
            chosen |= {p.name for p in valid if p.linear and p.kind.endswith(".input")}
    for pat in patterns:
        hits = [p.name for p in valid if fnmatch.fnmatchcase(p.name, pat)]
        if not hits:
            raise _unknown(model, pat, names)
        chosen.update(hits)
    return [p for p in valid if p.name in chosen]
