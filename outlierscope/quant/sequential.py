"""The machinery of layer-by-layer calibration shared by GPTQ and AWQ (:mod:`~outlierscope.quant.gptq_model`,
:mod:`~outlierscope.quant.awq_model`): the calibration sequences, decoder layer 0's inputs (the forward stopped there),
one layer run on every sequence, the next layer's inputs, the groups of linears reading one input tensor, and a
rounded weight held in place by a parametrization while the pass goes on.
"""

from __future__ import annotations

import torch
from torch import nn

from outlierscope.data.text import LAMBADA_TAIL
from outlierscope.hooks.points import decoder_layers

DEFAULT_CALIB = LAMBADA_TAIL  # LAMBADA's test passages from the last one back (outlierscope.data.text)


class Fixed(nn.Module):
    """The parametrization ``W -> a given tensor``: a rounded weight in place while the pass goes on."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = w

    def forward(self, _):
        return self.w


class _Stop(Exception):
    """Raised by the pre-hook that records layer 0's inputs: nothing above it runs."""


def calibration_sequences(tokenizer, source: str | None, cfg, ctx: int | None) -> torch.Tensor:
    """``cfg.samples`` sequences of ``cfg.seqlen`` tokens (at most the model's ``ctx``) of ``source`` (default
    :data:`DEFAULT_CALIB`), packed with EOS between documents: (N, T) int64."""
    from outlierscope.data.text import pack_sequences, text_documents

    seqlen = min(cfg.seqlen, ctx) if ctx else cfg.seqlen
    return pack_sequences(tokenizer, text_documents(source or DEFAULT_CALIB), seqlen, cfg.samples * seqlen)


def layer_inputs(model: nn.Module, seqs: torch.Tensor) -> list[tuple[tuple, dict]]:
    """Every sequence's (args, kwargs) of decoder layer 0, the forward stopped there."""
    layer0, got = decoder_layers(model)[0], []

    def pre(mod, args, kwargs):
        got.append((args, kwargs))
        raise _Stop

    handle = layer0.register_forward_pre_hook(pre, with_kwargs=True)
    dev = next(model.parameters()).device
    try:
        for row in seqs:
            try:
                model(input_ids=row[None].to(dev), attention_mask=torch.ones_like(row[None]).to(dev), use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return got


def run_layer(layer: nn.Module, inputs: list[tuple[tuple, dict]]) -> list[torch.Tensor]:
    """The layer's hidden-state output for each input."""
    outs = []
    for args, kwargs in inputs:
        out = layer(*args, **kwargs)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


def next_inputs(layer: nn.Module, inputs: list[tuple[tuple, dict]]) -> list[tuple[tuple, dict]]:
    """The next layer's inputs: this layer's outputs in the hidden states' place (positional or ``hidden_states``),
    the rest (positions, mask) as they were."""
    out = []
    for h, (args, kwargs) in zip(run_layer(layer, inputs), inputs):
        out.append(((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h}))
    return out


def input_subsets(layer: nn.Module, linears: dict[str, nn.Linear], first: tuple[tuple, dict]) -> list[list[str]]:
    """The layer's linears (path -> module) in the order its forward calls them, those reading one input tensor
    together (q/k/v, gate/up), found by one forward of ``first``."""
    calls: list[tuple[str, int]] = []
    seen: list[torch.Tensor] = []  # the inputs, held so that no later tensor takes their memory and identity
    handles = [m.register_forward_pre_hook(lambda mod, args, p=p: calls.append((p, id(args[0]))) or seen.append(args[0]))
               for p, m in linears.items()]
    try:
        run_layer(layer, [first])
    finally:
        for h in handles:
            h.remove()
    out: list[list[str]] = []
    placed: set[str] = set()
    for i, (p, x) in enumerate(calls):
        if p in placed:  # a linear called again in the same forward: its first call placed it
            continue
        placed.add(p)
        if out and x == calls[i - 1][1]:
            out[-1].append(p)
        else:
            out.append([p])
    return out
