"""Named observation points of a decoder-only model.

``layers.{i}.attn.logits``: pre-softmax attention logits ``(q @ k^T) * scaling``, shape
(batch, heads, queries, keys), with the boolean mask of valid entries (causal, not padding,
inside a sliding window). For a Diff model the two maps are heads ``[0, H/2)`` (map 1)
and ``[H/2, H)`` (map 2); differential head ``j`` pairs heads ``j`` and ``j + H/2``.

``layers.{i}.hidden``: the decoder layer's output (after both residual additions), shape
(batch, tokens, channels), valid (non-padding) tokens only.

Patterns may use ``*`` for the layer index: ``layers.*.attn.logits``.

Hybrid models (Jamba, LFM2, Qwen3-Next) interleave attention layers with state-space or convolution
layers: every layer has a ``hidden`` point, only attention layers an ``attn.logits`` point, and layer
indices are the model's own. The model structure is found, never assumed from a class name:
:func:`decoder_layers`, :func:`attention_layers`, :func:`trunk`.
"""

from __future__ import annotations

import difflib
import fnmatch
import sys
from dataclasses import dataclass

from torch import nn

from outlierscope.errors import OutlierscopeError

KINDS = ("attn.logits", "hidden")
DEFAULT_POINTS = ("layers.*.attn.logits", "layers.*.hidden")


@dataclass(frozen=True)
class Point:
    name: str
    layer: int
    kind: str  # one of KINDS


def point_name(layer: int, kind: str) -> str:
    return f"layers.{layer}.{kind}"


_ATTN_NAMES = ("attn", "self_attn", "attention", "self_attention")


def _attention_module(block: nn.Module) -> nn.Module | None:
    """The block's attention module (by transformers' naming, or the ``scaling`` attribute that attention modules
    going through the interface carry); None for a state-space, convolution or linear-attention block."""
    for name, m in block.named_modules():
        if name and (name.rsplit(".", 1)[-1] in _ATTN_NAMES or hasattr(m, "scaling")):
            return m
    return None


def _routes_through_interface(module: nn.Module) -> bool:
    """Whether the attention module's modeling file dispatches through transformers' ``AttentionInterface``."""
    return hasattr(sys.modules.get(type(module).__module__), "ALL_ATTENTION_FUNCTIONS")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers, found from its structure: the shallowest ``ModuleList`` of
    ``num_hidden_layers`` blocks of which at least one holds an attention module (``model.layers``,
    ``transformer.h``, ``model.decoder.layers``, ``gpt_neox.layers``, ...; in a hybrid model the other blocks
    are state-space or convolution layers). A model whose attention does not go through transformers'
    ``AttentionInterface`` (Falcon, Bloom, MPT) is refused, naming that reason."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    n = getattr(cfg, "num_hidden_layers", None)
    found = [(name.count("."), name, mod) for name, mod in model.named_modules()
             if isinstance(mod, nn.ModuleList) and len(mod) and (n is None or len(mod) == n)
             and any(_attention_module(b) is not None for b in mod)]
    if not found:
        raise OutlierscopeError(f"{type(model).__name__}: cannot find its decoder layers; expected a ModuleList of "
                                f"{n} blocks of which at least one holds an attention module")
    layers = min(found, key=lambda f: (f[0], f[1]))[2]
    attn = next(_attention_module(b) for b in layers if _attention_module(b) is not None)
    if not _routes_through_interface(attn):
        raise OutlierscopeError(f"{type(model).__name__}: its attention ({type(attn).__name__}) does not go through "
                                "transformers' AttentionInterface, so its logits cannot be observed or quantized; "
                                "models that do include Llama, Qwen, Mistral, Gemma, GPT-2, GPT-NeoX")
    return layers


def attention_layers(model: nn.Module) -> list[int]:
    """Indices (the model's own) of the decoder layers that hold an attention module: all of them except in
    hybrid models."""
    return [i for i, b in enumerate(decoder_layers(model)) if _attention_module(b) is not None]


def trunk(model: nn.Module) -> nn.Module:
    """The module that maps token ids to the last hidden states (before the LM head), found structurally:
    ``model.base_model`` where it is a proper submodule, else the direct child that holds the decoder layers
    (Llama4ForCausalLM names its trunk ``model`` but its ``base_model_prefix`` otherwise)."""
    base = getattr(model, "base_model", model)
    if base is not model:
        return base
    layers = decoder_layers(model)
    for child in model.children():
        if any(m is layers for m in child.modules()):
            return child
    raise OutlierscopeError(f"{type(model).__name__}: cannot find the module that holds its decoder layers and "
                            "returns hidden states; expected a causal LM with a trunk and an LM head")


def all_points(model: nn.Module) -> list[Point]:
    n, attn = len(decoder_layers(model)), set(attention_layers(model))
    return [Point(point_name(i, k), i, k) for i in range(n) for k in KINDS if k != "attn.logits" or i in attn]


def resolve_points(model: nn.Module, patterns) -> list[Point]:
    """Expand point names/patterns; unknown names fail with the closest valid names."""
    if isinstance(patterns, str):
        patterns = [patterns]
    valid = all_points(model)
    names = [p.name for p in valid]
    chosen: dict[str, Point] = {}
    for pat in patterns:
        hits = [p for p in valid if fnmatch.fnmatchcase(p.name, pat)]
        if not hits:
            generic = sorted({n.replace(n.split(".")[1], "*", 1) for n in names})
            close = difflib.get_close_matches(pat, names + generic, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            n = len(decoder_layers(model))
            raise OutlierscopeError(
                f"unknown observation point {pat!r} for {type(model).__name__} with {n} layers: "
                f"expected layers.{{0..{n - 1}}}.{{{','.join(KINDS)}}}{hint}"
            )
        for p in hits:
            chosen[p.name] = p
    return [p for p in valid if p.name in chosen]
