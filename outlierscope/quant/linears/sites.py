"""The linear layers a spec quantizes (``LinearSite``: each ``nn.Linear`` of the decoder layers that
``linears:`` and ``layers:`` choose, the LM head when named), which of them read the same input, and what a spec's
calibration holds (``Calibration``); the recording hooks of a calibration pass."""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.points import decoder_layers
from outlierscope.models.float64 import float64_model
from outlierscope.quant.numerics.registry import Block
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.specs.transforms import Smooth

HEAD = "lm_head"  # the pattern that names the LM head (the model's output embeddings)


CALIB_SEQ_LEN, CALIB_TOKENS = 512, 4096  # the calibration pass: 8 packed sequences of 512 tokens (fewer if shorter)


@dataclass(frozen=True)
class LinearSite:
    """One quantized linear.

    Attributes:
        layer: its decoder layer (the LM head: one past the last).
        path: its path inside the layer (``self_attn.q_proj``; the LM head: ``lm_head``).
        name: its full name in the model.
        module: the ``nn.Linear``."""

    layer: int
    path: str
    name: str
    module: nn.Linear = field(compare=False, repr=False)

    @property
    def is_head(self) -> bool:
        return self.path == HEAD


def layer_linears(model: nn.Module) -> list[list[tuple[str, nn.Linear]]]:
    """Per decoder layer, its ``nn.Linear`` modules as (path inside the layer, module).

    Args:
        model: the model."""
    return [[(p, m) for p, m in layer.named_modules() if isinstance(m, nn.Linear)] for layer in decoder_layers(model)]


def linear_sites(model: nn.Module, spec: QuantSpec) -> list[LinearSite]:
    """The linears a spec quantizes: those of its layers whose path matches a ``linears`` pattern, and the LM head.

    Args:
        model: the model.
        spec: the spec (``linears`` None: every linear of its layers; a pattern ``lm_head``: the LM head too).

    Raises:
        OutlierscopeError: a pattern that matches nothing, with the closest paths."""
    names = {id(m): n for n, m in model.named_modules()}
    per_layer = layer_linears(model)
    paths = sorted({p for layer in per_layer for p, _ in layer})
    for pat in spec.linears or ():
        if pat != HEAD and not any(fnmatch.fnmatchcase(p, pat) for p in paths):
            close = difflib.get_close_matches(pat, [*paths, HEAD], n=3, cutoff=0.4)
            raise OutlierscopeError(f"linears:{pat} matches no nn.Linear of the decoder layers (they are "
                                    f"{', '.join(paths)}; the LM head: lm_head)"
                                    + (f"; did you mean {', '.join(close)}?" if close else ""))
    sites = [LinearSite(i, p, names[id(m)], m) for i, layer in enumerate(per_layer) if spec.applies_to(i)
             for p, m in layer if spec.linears is None or any(fnmatch.fnmatchcase(p, pat) for pat in spec.linears)]
    if HEAD in (spec.linears or ()):
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise OutlierscopeError(f"linears:lm_head: {type(model).__name__}'s output embeddings are "
                                    f"{type(head).__name__}, not an nn.Linear")
        if not token_local(spec):
            raise OutlierscopeError("linears:lm_head reads the scored positions' final hidden states, not whole "
                                    "sequences: give it a token-local activation (per_token, per_group, static, MX) and "
                                    "no outliers:")
        sites.append(LinearSite(len(per_layer), HEAD, names[id(head)], head))
    return sites


@dataclass(frozen=True)
class Calibration:
    """What a calibration pass saw.

    Attributes:
        act_max: linear (full name) -> its input's per-channel max |x| (float32, CPU).
        groups: the groups of linears that read the same input tensor.
        source: where the calibration text came from.
        rounded: GPTQ: linear name -> its ``RoundedWeight``; AWQ: its ``AWQWeight``."""

    act_max: dict[str, torch.Tensor]
    groups: tuple[tuple[str, ...], ...]
    source: str
    rounded: dict = field(default_factory=dict)


def needs_calibration(spec: QuantSpec) -> bool:
    """Whether a spec needs a calibration pass: SmoothQuant, static activation scales, GPTQ or AWQ.

    Args:
        spec: the spec."""
    a = spec.part("a")
    return spec.get(Smooth) is not None or (a is not None and a.granularity == "static") \
        or spec.calibrated_weights is not None


@contextlib.contextmanager
def _recording(sites: list[LinearSite], act_max: dict | None, seen: dict | None) -> Iterator[None]:
    """Pre-hooks that record, per site, the input tensor it read (``seen``: name -> the tensor, held so that no later
    tensor takes its memory and its identity) and, with ``act_max``, the running per-channel max |x|."""
    handles = []

    def hook(site):
        def pre(mod, args):
            x = args[0]
            if seen is not None:
                seen[site.name] = x
            if act_max is not None:
                m = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float().cpu()  # (C,)
                act_max[site.name] = m if site.name not in act_max else torch.maximum(act_max[site.name], m)

        return pre

    try:
        for s in sites:
            handles.append(s.module.register_forward_pre_hook(hook(s)))
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def input_groups(model: nn.Module, sites: list[LinearSite]) -> tuple[tuple[str, ...], ...]:
    """The groups of linears that read the same input tensor (q/k/v, gate/up), found by one forward of two tokens.

    Args:
        model: the model.
        sites: the quantized linears."""
    seen: dict = {}
    with _recording(sites, None, seen), float64_model(model):
        model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device))
    by_input: dict = {}
    for s in sites:
        by_input.setdefault((s.layer, id(seen.get(s.name))), []).append(s.name)
    return tuple(tuple(g) for g in by_input.values())


def _max_positions(model: nn.Module) -> int | None:
    """The model's longest sequence (its config's ``max_position_embeddings``), or None when it does not say."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def token_local(spec: QuantSpec) -> bool:
    """Whether every linear's output at a token depends on that token alone (no per-sequence statistic).

    Then a context's choices may share its prefix (``layout_for``).

    Args:
        spec: the spec."""
    a = spec.part("a")
    return spec.outlier_threshold is None and (a is None or a.granularity in ("per_token", "per_group", "static")
                                               or isinstance(a.fmt, Block) and not a.fmt.global_scale)
