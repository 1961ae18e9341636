"""``capture``: stream named activations of a model into reducers, without keeping tensors.

    with capture(model, ["layers.*.attn.logits", "layers.*.hidden"], reducers=[stats]) as cap:
        model(input_ids=ids, attention_mask=mask)

A reducer is any callable ``reducer(obs: Observation)``; to keep data past its call it keeps copies, not ``obs.x``
itself (the next batch would overwrite a view). A logits map is still handed over in memory of its own, masked only
after the call, unless every reducer declares ``keeps_observations = False`` (the library's
``OutlierStats`` does): the map is then masked in place, one copy per layer less.
Every hook handle is removed and the attention implementation restored in ``finally``,
also when the forward raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.attention import LogitContext, Stage, Tap, attention_stages
from outlierscope.hooks.points import ATTN_TAPS, DEFAULT_POINTS, KIND, Point, decoder_layers, point_name, resolve_points
from outlierscope.models.float64 import float64_model


@dataclass
class Observation:
    """One tensor passing an observation point.

    Attributes:
        point: the point it passed.
        x: a map (logits, probabilities) ``(B, H, T, S)``, or a token tensor (hidden states, q/k/v, module inputs and
            outputs) ``(B, T, C)``.
        valid: bool, ``(B, 1|H, T, S)`` for maps and ``(B, T)`` for token tensors: the entries that count.
        seq_offset: the global index of the batch's first sequence, counted over forwards inside the capture.
        n_heads: a map's heads, or the heads of q/k/v's channels.
        is_diff: a DiffLlama map, whose heads [0, H/2) and [H/2, H) are the two maps of one logits tensor.
        query_offset: for maps, the key position of ``x``'s first query row (S - T for a whole call; blocks differ).
        ids: the token ids ``(B, T)`` of a token tensor's tokens when the forward got ``input_ids``; else None."""

    point: Point
    x: torch.Tensor
    valid: torch.Tensor
    seq_offset: int
    n_heads: int | None = None
    is_diff: bool = False
    query_offset: int | None = None
    ids: torch.Tensor | None = None


@dataclass
class Capture:
    """The handle ``capture`` yields.

    Attributes:
        points: the resolved points.
        sequences: the sequences seen so far."""

    points: list[Point]
    sequences: int = 0
    _padding: torch.Tensor | None = field(default=None, repr=False)
    _ids: torch.Tensor | None = field(default=None, repr=False)

    def ids_for(self, valid: torch.Tensor) -> torch.Tensor | None:
        """The token ids of a token tensor's tokens: the forward's last T ids (a cached forward sees its new ones).

        Args:
            valid: the tensor's validity ``(B, T)``.

        Returns:
            ``(B, T)``, or None when they do not line up (keys over a cache)."""
        ids = self._ids
        if ids is None or ids.shape[0] != valid.shape[0] or ids.shape[1] < valid.shape[1]:
            return None
        return ids[:, -valid.shape[1] :]  # (B, T)


def _as_list(reducers) -> list:
    if reducers is None:
        return []
    if callable(reducers):
        return [reducers]
    return list(reducers)


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    """A module's input: its first positional tensor, else ``hidden_states``, else its first tensor keyword."""
    for a in (*args, kwargs.get("hidden_states"), *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def _output_tensor(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return getattr(output, "last_hidden_state", None)


def _module_targets(model: nn.Module, points: list[Point]) -> list[tuple[nn.Module, str, Point]]:
    """(module, "input"|"output", point) for every point observed by a module hook: module inputs and outputs,
    ``lm_head.input`` and the point kinds whose entry names a hook (``POINT_KINDS``)."""
    modules = dict(model.named_modules())
    layers = decoder_layers(model)
    out = []
    for p in points:
        if p.module is not None:
            out.append((modules[p.module], "input" if p.kind.endswith(".input") else "output", p))
        elif p.kind in KIND and KIND[p.kind].hook is not None:
            out.append((*KIND[p.kind].hook(layers[p.layer]), p))
    return out


def _token_layout(p: Point, x: torch.Tensor, pad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A module's tensor as (B, T, C) with its valid tokens (B, T): batch first, the tokens in dim 1 or the first
    later dim of the batch's length (per-head tensors (B, H, T, d)), everything after them channels; a (B, t, C)
    tensor of fewer tokens than the mask (a forward with a cache) holds the last t. Routed-token (N, C) tensors of
    mixture-of-experts blocks are (1, N, C), observed when the batch has no padding."""
    if pad is None:
        pad = torch.ones(x.shape[:2] if x.dim() >= 3 else (1, 1), dtype=torch.bool, device=x.device)
    B, T = pad.shape
    if x.dim() >= 3 and x.shape[0] == B:
        t_dim = next((d for d in range(1, x.dim() - 1) if x.shape[d] == T), None)
        if t_dim is not None:
            return x.movedim(t_dim, 1).reshape(B, T, -1), pad  # (B, T, C)
        if x.dim() == 3 and x.shape[1] < T:
            return x, pad[:, -x.shape[1] :]  # (B, t, C): the last t tokens
    if bool(pad.all()):
        x = x.reshape(1, -1, x.shape[-1])  # (1, N, C): routed tokens, all real
        return x, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    raise OutlierscopeError(f"{p.name}: its tensor {tuple(x.shape)} does not have the batch's (batch, tokens) layout, "
                            "so padding cannot be told apart; profile without padding or choose another point")


class _Emitter:
    """Turns hooked tensors into observations for the reducers."""

    def __init__(self, cap: Capture, reducers: list, by_layer_kind: dict[tuple[int, str], Point]):
        self.cap, self.reducers, self.points = cap, reducers, by_layer_kind

    def emit(self, obs: Observation) -> None:
        for r in self.reducers:
            r(obs)

    def tokens(self, p: Point, x: torch.Tensor | None) -> None:
        """A module's tensor, observed as (B, T, C) (``_token_layout``)."""
        if x is None:
            raise OutlierscopeError(f"{p.name}: the module got or returned no tensor; choose another point")
        x, valid = _token_layout(p, x, self.cap._padding)
        self.emit(Observation(p, x.detach(), valid.to(x.device), self.cap.sequences, ids=self.cap.ids_for(valid)))

    def hook(self, p: Point, side: str):
        if side == "input":
            return lambda mod, args, kwargs: self.tokens(p, _first_tensor(args, kwargs))
        return lambda mod, args, kwargs, output: self.tokens(p, _output_tensor(output))

    def tap(self, t: Tap) -> None:
        p = self.points.get((t.layer, t.kind))
        if p is None:
            return
        if p.is_map:
            self.emit(Observation(p, t.x.detach(), t.valid, self.cap.sequences, t.n_heads, t.is_diff, t.query_offset))
        else:
            self.emit(Observation(p, t.x.detach(), t.valid, self.cap.sequences, t.n_heads, ids=self.cap.ids_for(t.valid)))

    def logits(self, ctx: LogitContext, logits: torch.Tensor) -> torch.Tensor:
        p = self.points.get((ctx.layer, "attn.logits"))
        if p is not None:
            self.emit(Observation(p, logits.detach(), ctx.valid, self.cap.sequences, ctx.n_heads, ctx.is_diff,
                                  ctx.query_offset))
        return logits


@contextlib.contextmanager
def capture(model: nn.Module, points: Sequence[str] | str | None = None, reducers=None,
            block_rows: int | None = None, preset: str | None = None) -> Iterator[Capture]:
    """Observe named points of a model during the forwards inside the block, streamed into reducers.

    Any model whose attention goes through transformers' ``AttentionInterface`` can be observed, an encoder (BERT)
    too: its valid entries are what its own mask allows. Every hook is removed in ``finally``.

    Args:
        model: the model to observe.
        points: point names or patterns (``"layers.*.attn.logits"``); None: Table 5's two kinds (or only ``preset``'s).
        reducers: a callable ``reducer(obs: Observation)``, or a list of them, fed each observed tensor.
        block_rows: query rows per attention block (maps are then observed block by block); None: whole.
        preset: the name of a ``PRESETS`` group of points, added to ``points``.

    Yields:
        The ``Capture``: the resolved points and the number of sequences seen.

    Raises:
        OutlierscopeError: an unknown point name (with "did you mean")."""
    if points is None:
        points = DEFAULT_POINTS if preset is None else ()
    resolved = resolve_points(model, points, preset)
    cap = Capture(points=resolved)
    em = _Emitter(cap, _as_list(reducers), {(p.layer, p.kind): p for p in resolved})
    taps = frozenset(p.kind for p in resolved if p.kind in ATTN_TAPS)
    wants_logits = any(p.kind == "attn.logits" for p in resolved)
    # keeps: the attention function must not reuse memory that a reducer may hold; one that declares
    # ``keeps_observations = False`` (the library's: they reduce a tensor before returning) spares a copy of each map
    keeps = any(getattr(r, "keeps_observations", True) for r in em.reducers)
    stage = Stage(apply=em.logits, observes=wants_logits, keeps=keeps, name="capture", taps=taps, tap=em.tap)
    handles = []

    def pre_forward(mod, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if mask is None and ids is not None:
            mask = torch.ones(ids.shape[:2], dtype=torch.bool, device=ids.device)
        cap._padding = mask.bool() if mask is not None and mask.dim() == 2 else None
        cap._ids = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None

    def post_forward(mod, args, kwargs, output):
        if cap._padding is not None:
            cap.sequences += cap._padding.shape[0]
        cap._padding = cap._ids = None

    try:
        handles.append(model.register_forward_pre_hook(pre_forward, with_kwargs=True))
        handles.append(model.register_forward_hook(post_forward, with_kwargs=True))
        for mod, side, p in _module_targets(model, resolved):
            register = mod.register_forward_pre_hook if side == "input" else mod.register_forward_hook
            handles.append(register(em.hook(p, side), with_kwargs=True))
        with attention_stages(model, stage, block_rows=block_rows) if wants_logits or taps else contextlib.nullcontext(), \
                float64_model(model):  # a float64 model's forwards inside are float64 in every operation
            yield cap
    finally:
        for h in handles:
            h.remove()


__all__ = ["capture", "Capture", "Observation", "point_name"]
