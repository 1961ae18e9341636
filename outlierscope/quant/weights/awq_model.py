"""

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from outlierscope.errors import OutlierscopeError
from outlierscope.models.float64 import float64_model
from outlierscope.quant.linears.ops import quantize_weight
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.weights.awq import clip_groups, search_clip, search_scale, weight_mean
from outlierscope.quant.weights.sequential import Fixed, input_subsets, layerwise, run_layer

NO_CLIP = ("q_", "k_", "query", "key", "Wqkv")  # AutoAWQ's names of linears it never clips ("due to qk bmm")


@dataclass(frozen=True)
class AWQWeight:
    """A linear's AWQ.

    Attributes:
        scale: ``(I,)`` in the model's dtype: its input divided by it, its weight's columns multiplied; None: not
            scaled.
        clip: ``(O, groups)`` the bound of each group of the scaled weight; None: not clipped."""

    scale: torch.Tensor | None
    clip: torch.Tensor | None

    def transform(self, w: torch.Tensor, part) -> torch.Tensor:
        """``Q(clip(W s))``: the weight the scaled input meets, in w's dtype.

        Args:
            w: the weight ``(O, I)``.
            part: the spec's ``w=`` part."""
        if self.scale is not None:
            w = w * self.scale.to(w.device, w.dtype)  # (O, I) * (I,)
        if self.clip is not None:
            w = clip_groups(w, self.clip.to(w.device))
        return quantize_weight(w, part)

    def weight(self, w: torch.Tensor, part) -> torch.Tensor:
        """``Q(clip(W s)) / s``: the same product on the unscaled input (the calibration pass's stand-in).

        Args:
            w: the weight ``(O, I)``.
            part: the spec's ``w=`` part."""
        q = self.transform(w, part)
        return q if self.scale is None else q / self.scale.to(q.device, q.dtype)


@contextlib.contextmanager
def _recording(modules: dict[str, nn.Module]) -> Iterator[dict[str, list]]:
    """Pre-hooks that keep each module's (args, kwargs) of every forward: name -> list."""
    got = {p: [] for p in modules}

    def hook(p):
        def pre(mod, args, kwargs):
            got[p].append((args, kwargs))
        return pre

    handles = [m.register_forward_pre_hook(hook(p), with_kwargs=True) for p, m in modules.items()]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _holding(modules: list[nn.Linear]) -> Iterator[list[Fixed]]:
    """Each module's weight replaced by a ``Fixed`` whose tensor the caller sets; removed in ``finally``."""
    held = []
    try:
        for m in modules:
            f = Fixed(m.weight.detach())
            parametrize.register_parametrization(m, "weight", f)
            held.append(f)
        yield held
    finally:
        for m in modules[:len(held)]:
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)


def _same(a, b) -> bool:
    """Two call arguments alike (tensors equal, tuples alike item by item, other values equal)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, tuple | list):
        return isinstance(b, tuple | list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or a == b


def batched(calls: list[tuple[tuple, dict]], size: int = 16) -> list[tuple[tuple, dict]]:
    """A module's calls merged ``size`` sequences at a time, where everything but the hidden states is alike.

    The hidden states (the first positional argument or ``hidden_states``, ``(1, T, C)`` each) are stacked into
    ``(n, T, C)``, everything else taken from the first call (the packed calibration sequences share positions and
    mask); else the calls as they are.

    Args:
        calls: the ``(args, kwargs)`` of each call.
        size: sequences per merged call."""
    def hidden(call):
        args, kwargs = call
        return args[0] if args else kwargs.get("hidden_states")

    def rest(call):
        args, kwargs = call
        return (args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states" or args})

    h0 = hidden(calls[0]) if calls else None
    if h0 is None or h0.dim() != 3 or h0.shape[0] != 1 or any(
            hidden(c) is None or hidden(c).shape != h0.shape or not _same(rest(c), rest(calls[0])) for c in calls[1:]):
        return calls
    out = []
    for i in range(0, len(calls), size):
        h = torch.cat([hidden(c) for c in calls[i:i + size]])  # (n, T, C)
        args, kwargs = calls[0]
        out.append(((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h}))
    return out


def _outputs(module: nn.Module, calls: list[tuple[tuple, dict]]) -> list[torch.Tensor]:
    outs = []
    for args, kwargs in calls:
        with float64_model(module):
            out = module(*args, **kwargs)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


def _parent(layer: nn.Module, paths: list[str]) -> tuple[str, nn.Module]:
    """The module that judges a group: the linears' common parent (a lone linear: itself)."""
    if len(paths) == 1:
        return paths[0], layer.get_submodule(paths[0])
    parts = [p.split(".") for p in paths]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    path = ".".join(common)
    return path or "", layer.get_submodule(path) if path else layer


def _group_scale(linears: list[nn.Linear], xs: list[torch.Tensor], judge: nn.Module,
                 calls: list[tuple[tuple, dict]], spec: QuantSpec) -> torch.Tensor:
    """AWQ's scale of one group (module docstring): the grid search with the judging module's mean squared error."""
    part, cfg, dt = spec.part("w"), spec.awq, linears[0].weight.dtype
    calls = batched(calls)  # the judge runs on 16 sequences at a time
    acc = torch.promote_types(dt, torch.float32)  # AutoAWQ's float32 sums; float64 in a float64 model
    x_sum = sum(x.reshape(-1, x.shape[-1]).abs().to(acc).sum(0) for x in xs)  # (I,)
    x_mean = (x_sum / sum(x.numel() // x.shape[-1] for x in xs)).to(dt)
    w_mean = weight_mean([m.weight.detach() for m in linears], part.size if part.granularity == "per_group" else None)
    ref = _outputs(judge, calls)
    originals = [m.weight.detach() for m in linears]

    def loss(s: torch.Tensor) -> float:
        for f, w in zip(held, originals):
            f.w = quantize_weight(w * s.view(1, -1), part) / s.view(1, -1)  # Q(W s) / s, in the model's dtype
        total, n = 0.0, 0
        for r, out in zip(ref, _outputs(judge, calls)):  # float32 squares as the references (float64 kept float64)
            total += (r - out).to(torch.promote_types(r.dtype, torch.float32)).pow(2).sum().item()
            n += r.numel()
        return total / n

    with _holding(linears) as held:
        s, _, _ = search_scale(x_mean, w_mean.to(dt), loss, cfg.grid, bool(cfg.duo))
    return s


def _layer_awq(layer: nn.Module, mine: dict[str, nn.Linear], inputs: list, spec: QuantSpec) -> dict[str, AWQWeight]:
    """AWQ of one layer's linears ``mine`` (path -> module) on its ``inputs`` (module docstring). The groups are the
    layer's, whichever of their linears are quantized: a group partly in ``mine`` (``linears:q_proj``) gets its scale
    searched on the whole group's input and judge with only its quantized linears rounded (the others take ``s`` in
    float, exactly); a lone linear is scaled when its producer could absorb ``s``, quantized or not."""
    every = {p: m for p, m in layer.named_modules() if isinstance(m, nn.Linear)}
    groups = input_subsets(layer, every, inputs[0])
    producers = {g[0]: groups[k - 1][-1] if k else None for k, g in enumerate(groups)}
    groups = [g for g in groups if any(q in mine for q in g)]
    judges = {tuple(g): _parent(layer, g) for g in groups}
    watched = {g[0]: every[g[0]] for g in groups} | {f"judge:{p}": m for p, m in judges.values()}
    with _recording(watched) as got:
        run_layer(layer, inputs)
    cfg, out = spec.awq, {}
    for g in groups:
        xs = [args[0] for args, _ in got[g[0]]]  # (1, T, I) per sequence
        producer = producers[g[0]]
        scaled = len(g) > 1 or (producer is not None and every[producer].out_features == every[g[0]].in_features)
        p, judge = judges[tuple(g)]
        sel = [q for q in g if q in mine]
        s = _group_scale([mine[q] for q in sel], xs, judge, got[f"judge:{p}"], spec) if scaled else None
        x = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs])  # (N T, I)
        x = x if s is None else x / s.view(1, -1)
        for q in sel:
            out[q] = AWQWeight(s, _clip(q, mine[q].weight.detach(), s, x, spec) if cfg.clip else None)
    return out


def _clip(path: str, w: torch.Tensor, s: torch.Tensor | None, x: torch.Tensor, spec: QuantSpec) -> torch.Tensor | None:
    """A linear's clipping bound: search_clip on W s and the scaled input ``x`` (None for q/k: AutoAWQ skips them)."""
    if any(t in path for t in NO_CLIP):
        return None
    part, cfg = spec.part("w"), spec.awq
    w = w if s is None else w * s.view(1, -1)
    return search_clip(w, x, lambda v: quantize_weight(v, part), part.size if part.granularity == "per_group" else None,
                       cfg.grid, cfg.shrink, cfg.clip_tokens)


def awq_model(model: nn.Module, seqs: torch.Tensor, spec: QuantSpec, sites: list, progress: bool = True,
              checkpoint_dir=None, alone: bool = False) -> dict[str, AWQWeight]:
    """AWQ of a spec's linears, calibrated layer after layer; the model comes back as it was.

    Args:
        model: the model.
        seqs: calibration token ids ``(N, T)``.
        spec: the spec (with ``awq``).
        sites: its quantized linears (``linear_sites``).
        progress: show a progress bar.
        checkpoint_dir: every finished layer is saved there and a rerun continues after it; None: not kept.
        alone: each layer as if it alone were quantized (``layerwise``).

    Returns:
        Full module name -> ``AWQWeight``."""
    if spec.awq is None:
        raise OutlierscopeError(f"{spec}: no awq in the spec; add awq (e.g. w=int4/per_group:128; awq)")
    part = spec.part("w")
    return layerwise(model, seqs, spec, sites, "awq", lambda layer, mine, inputs, fix: _layer_awq(layer, mine, inputs, spec),
                     lambda r, m: r.weight(m.weight.detach(), part), AWQWeight, progress, checkpoint_dir, alone)
