"""``capture``: stream named activations of a model into reducers, without keeping tensors.

    with capture(model, ["layers.*.attn.logits", "layers.*.hidden"], reducers=[stats]) as cap:
        model(input_ids=ids, attention_mask=mask)

A reducer is any callable ``reducer(obs: Observation)``; it must not keep ``obs.x``.
Every hook handle is removed and the attention implementation restored in ``finally``,
also when the forward raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from outlierscope.hooks.attention import LogitContext, Stage, attention_stages
from outlierscope.hooks.points import DEFAULT_POINTS, Point, decoder_layers, point_name, resolve_points


@dataclass
class Observation:
    """One tensor passing an observation point.

    ``x``: logits (B, H, T, S) or hidden states (B, T, C); ``valid``: bool, broadcastable to ``x``
    for logits ((B, 1|H, T, S)) and (B, T) for hidden states. ``seq_offset`` is the global index of
    the batch's first sequence (counted over forwards inside the capture). For logits, ``query_offset`` is
    the key position of ``x``'s first query row (S - T for a whole call; blocked attention passes blocks).
    """

    point: Point
    x: torch.Tensor
    valid: torch.Tensor
    seq_offset: int
    n_heads: int | None = None
    is_diff: bool = False
    query_offset: int | None = None


@dataclass
class Capture:
    """Handle returned by :func:`capture`."""

    points: list[Point]
    sequences: int = 0
    _padding: torch.Tensor | None = field(default=None, repr=False)


def _as_list(reducers) -> list:
    if reducers is None:
        return []
    if callable(reducers):
        return [reducers]
    return list(reducers)


@contextlib.contextmanager
def capture(model: nn.Module, points: Sequence[str] | str = DEFAULT_POINTS, reducers=None,
            block_rows: int | None = None) -> Iterator[Capture]:
    """Observe ``points`` of ``model`` during forwards inside the block; see module docstring.

    ``block_rows``: query rows per attention block (logits are then observed block by block).

    Any model whose attention goes through transformers' ``AttentionInterface`` can be observed, an encoder
    (BERT) too: its valid entries are what its own mask allows (bidirectional). Scoring is another matter:
    :func:`~outlierscope.eval.evaluate` refuses a model that is not causal."""
    resolved = resolve_points(model, points)
    reducers = _as_list(reducers)
    cap = Capture(points=resolved)
    logit_layers = {p.layer: p for p in resolved if p.kind == "attn.logits"}
    hidden_layers = {p.layer: p for p in resolved if p.kind == "hidden"}
    handles = []

    def emit(obs: Observation) -> None:
        for r in reducers:
            r(obs)

    def pre_forward(mod, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if mask is None and ids is not None:
            mask = torch.ones(ids.shape[:2], dtype=torch.bool, device=ids.device)
        cap._padding = mask.bool() if mask is not None and mask.dim() == 2 else None

    def post_forward(mod, args, kwargs, output):
        if cap._padding is not None:
            cap.sequences += cap._padding.shape[0]
        cap._padding = None

    def hidden_hook(layer: int):
        def hook(mod, args, output):
            h = output[0] if isinstance(output, tuple) else output  # (B, T, C)
            valid = cap._padding if cap._padding is not None else torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
            emit(Observation(hidden_layers[layer], h.detach(), valid[:, -h.shape[1] :], cap.sequences))

        return hook

    def observe(ctx: LogitContext, logits: torch.Tensor) -> torch.Tensor:
        p = logit_layers.get(ctx.layer)
        if p is not None:
            emit(Observation(p, logits.detach(), ctx.valid, cap.sequences, ctx.n_heads, ctx.is_diff, ctx.query_offset))
        return logits

    # observes: the attention function must not reuse memory that reducers may hold
    logit_stage = Stage(apply=observe, observes=True, name="capture")

    try:
        handles.append(model.register_forward_pre_hook(pre_forward, with_kwargs=True))
        handles.append(model.register_forward_hook(post_forward, with_kwargs=True))
        layers = decoder_layers(model)
        for i in hidden_layers:
            handles.append(layers[i].register_forward_hook(hidden_hook(i)))
        with attention_stages(model, logit_stage, block_rows=block_rows) if logit_layers else contextlib.nullcontext():
            yield cap
    finally:
        for h in handles:
            h.remove()


__all__ = ["capture", "Capture", "Observation", "point_name"]
