"""Named observation points of a decoder-only model.

``layers.{i}.attn.logits``: pre-softmax attention logits ``(q @ k^T) * scaling``, shape
(batch, heads, queries, keys), with the boolean mask of valid entries (causal, not padding,
inside a sliding window). For a Diff model the two maps are heads ``[0, H/2)`` (map 1)
and ``[H/2, H)`` (map 2); differential head ``j`` pairs heads ``j`` and ``j + H/2``.

``layers.{i}.hidden``: the decoder layer's output (after both residual additions), shape
(batch, tokens, channels), valid (non-padding) tokens only.

Patterns may use ``*`` for the layer index: ``layers.*.attn.logits``.
"""

from __future__ import annotations

import difflib
import fnmatch
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


def _has_attention(block: nn.Module) -> bool:
    return any(hasattr(m, "scaling") or name.rsplit(".", 1)[-1] in ("attn", "self_attn", "attention")
               for name, m in block.named_modules())


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder layers, found from its structure: the shallowest ``ModuleList`` of
    ``num_hidden_layers`` blocks that each hold an attention module (``model.layers``, ``transformer.h``,
    ``model.decoder.layers``, ``gpt_neox.layers``, ...)."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    n = getattr(cfg, "num_hidden_layers", None)
    found = [(name.count("."), name, mod) for name, mod in model.named_modules()
             if isinstance(mod, nn.ModuleList) and len(mod) and (n is None or len(mod) == n) and _has_attention(mod[0])]
    if not found:
        raise OutlierscopeError(f"{type(model).__name__}: cannot find its decoder layers; expected a ModuleList of "
                                f"{n} blocks that each hold an attention module")
    return min(found, key=lambda f: (f[0], f[1]))[2]


def all_points(model: nn.Module) -> list[Point]:
    n = len(decoder_layers(model))
    return [Point(point_name(i, k), i, k) for i in range(n) for k in KINDS]


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
            raise OutlierscopeError(
                f"unknown observation point {pat!r} for {type(model).__name__} with {len(names) // len(KINDS)} layers: "
                f"expected layers.{{0..{len(names) // len(KINDS) - 1}}}.{{{','.join(KINDS)}}}{hint}"
            )
        for p in hits:
            chosen[p.name] = p
    return [p for p in valid if p.name in chosen]
