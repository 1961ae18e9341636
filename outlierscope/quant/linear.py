"""Quantize the ``nn.Linear`` layers of a model's decoder layers: their inputs and weights, with SmoothQuant, a Hadamard
rotation or LLM.int8's decomposition (the ``a=``/``w=`` parts of :class:`~outlierscope.quant.spec.QuantSpec`).

What one quantized linear computes, per forward (pseudo-code; ``s`` SmoothQuant's factors, ``H`` the rotation)::

    x' = (x / s) @ H                      # exact in full precision: (x / s) H (W s H)^T = x W^T
    W' = (W * s) @ H                      # (out, in): s scales input columns
    cols = outlier_columns(x', 6.0)        # LLM.int8: kept in full precision, left out of every scale
    y = quant_a(x', cols) @ quant_w(W')^T + b

The weights are never changed: ``W'`` is computed from the untouched parameter (a ``torch.nn.utils.parametrize``
parametrization) when the context is entered and held while it lasts (``hold_weights``; memory: one more
copy of the quantized linears' weights; ``hold_weights=False``: computed at each forward, at most one linear's copy at
a time; the default, None, holds them on the CPU and on a GPU where they take at most half its free memory); leaving the context restores the model exactly (the parametrization is removed, the original ``Parameter``
put back).
Activations go through a forward pre-hook. Per-sequence statistics (``a=.../per_tensor``, NVFP4's activation scale,
the outlier columns) read the padding of the forward's 2-D ``attention_mask`` (a trunk pre-hook): padding never enters
them. Token-local parts (``per_token``, ``per_group``, ``static``, MX) need no mask.

The LM head is quantized only when named (``linears:lm_head``; ``*`` patterns match decoder-layer linears only), as
llm-compressor's recipes ``ignore: [lm_head]`` by default. Its site's layer is one past the last decoder layer. It
reads the final hidden state of the positions being scored (gathered rows, not sequences), so it takes token-local
activation parts only.

SmoothQuant's ``s`` is shared by the linears that read the same input tensor (q/k/v, gate/up: SmoothQuant folds it
into the norm before them) and computed from their calibrated ``max|X_j|`` and the largest ``|W_ij|`` over all of
them; a linear reading an input of its own (o_proj, down_proj) is not smoothed, as SmoothQuant's and llm-compressor's
Llama mappings. :func:`calibrate` runs the calibration pass (or reads ``act_scales.pt``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.points import decoder_layers, trunk
from outlierscope.models.float64 import float64_model
from outlierscope.quant.linear_ops import outlier_columns, quantize_activation, quantize_weight, rotation, smooth_scales
from outlierscope.quant.spec import QuantSpec

HEAD = "lm_head"  # the pattern that names the LM head (the model's output embeddings)
CALIB_SEQ_LEN, CALIB_TOKENS = 512, 4096  # the calibration pass: 8 packed sequences of 512 tokens (fewer if shorter)


@dataclass(frozen=True)
class LinearSite:
    """One quantized linear: its decoder layer, its path inside the layer (``self_attn.q_proj``), its full name. The
    LM head: path ``lm_head``, layer one past the last decoder layer."""

    layer: int
    path: str
    name: str
    module: nn.Linear = field(compare=False, repr=False)

    @property
    def is_head(self) -> bool:
        return self.path == HEAD


def layer_linears(model: nn.Module) -> list[list[tuple[str, nn.Linear]]]:
    """Per decoder layer, its ``nn.Linear`` modules as (path inside the layer, module)."""
    return [[(p, m) for p, m in layer.named_modules() if isinstance(m, nn.Linear)] for layer in decoder_layers(model)]


def linear_sites(model: nn.Module, spec: QuantSpec) -> list[LinearSite]:
    """The linears ``spec`` quantizes: those of its layers whose path matches one of ``spec.linears`` (None: all), and
    the LM head when a pattern is ``lm_head``; a pattern that matches nothing is an error with the closest paths."""
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
    """What a calibration pass saw: per linear (full name) its input's per-channel max |x| (float32, CPU), and the
    groups of linears that read the same input tensor (each a tuple of names); ``source``: where it came from."""

    act_max: dict[str, torch.Tensor]
    groups: tuple[tuple[str, ...], ...]
    source: str
    rounded: dict = field(default_factory=dict)  # gptq: linear name -> its RoundedWeight; awq: its AWQWeight


def needs_calibration(spec: QuantSpec) -> bool:
    a = spec.part("a")
    return spec.smooth is not None or (a is not None and a.granularity == "static") or spec.gptq is not None \
        or spec.awq is not None


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
    """The groups of ``sites`` that read the same input tensor (q/k/v, gate/up), found by one forward of two tokens."""
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


@torch.no_grad()
def calibrate(model: nn.Module, tokenizer, spec: QuantSpec, checkpoint_dir=None) -> Calibration:
    """The calibration ``spec`` needs (:func:`needs_calibration`): per-channel max |x| of every quantized linear's
    input over ``CALIB_TOKENS`` tokens of ``spec.calib`` (``hellaswag``: the validation contexts with their gold
    endings, the first documents; or a .txt/.jsonl file) packed into sequences of ``CALIB_SEQ_LEN``, or read from a
    SmoothQuant ``act_scales.pt``; and the groups of linears reading the same input (one short forward). GPTQ and AWQ
    calibrate layer after layer (``checkpoint_dir``: each finished layer saved there, a rerun continues after it)."""
    from outlierscope.data.text import pack_sequences, text_documents

    sites = linear_sites(model, spec)
    if spec.gptq is not None or spec.awq is not None:
        return _layerwise_calibration(model, tokenizer, spec, sites, checkpoint_dir)
    source = spec.calib or "hellaswag"
    if source.endswith(".pt"):
        return Calibration(_read_act_scales(source, sites), input_groups(model, sites), source)
    if source != "hellaswag" and not Path(source).is_file():
        raise OutlierscopeError(f"calib:{source}: no such file; give hellaswag, a .txt/.jsonl file or an act_scales.pt")
    ctx = _max_positions(model) or CALIB_SEQ_LEN
    seqs = pack_sequences(tokenizer, text_documents(source), min(CALIB_SEQ_LEN, ctx), CALIB_TOKENS)  # (N, T)
    act_max: dict = {}
    dev = next(model.parameters()).device
    with _recording(sites, act_max, None), float64_model(model):
        for row in seqs:
            model(input_ids=row[None].to(dev), use_cache=False)
    return Calibration(act_max, input_groups(model, sites), source)


def _layerwise_calibration(model: nn.Module, tokenizer, spec: QuantSpec, sites: list[LinearSite],
                           checkpoint_dir=None) -> Calibration:
    """GPTQ's rounded weights or AWQ's scales and clipping bounds of the quantized linears ``sites``, calibrated layer
    after layer on ``samples`` sequences of ``spec.calib`` (default: LAMBADA's last passages)
    (:func:`~outlierscope.quant.gptq_model.gptq_model`, :func:`~outlierscope.quant.awq_model.awq_model`)."""
    from outlierscope.quant.sequential import DEFAULT_CALIB, calibration_sequences

    ctx = _max_positions(model)
    cfg, run = _layerwise_method(spec)
    seqs = calibration_sequences(tokenizer, spec.calib, cfg, ctx)  # (N, T)
    return Calibration({}, (), spec.calib or DEFAULT_CALIB, run(model, seqs, spec, sites, checkpoint_dir=checkpoint_dir))


def _layerwise_method(spec: QuantSpec):
    """(settings, the pass) of a spec's layer-by-layer calibration: GPTQ's or AWQ's."""
    from outlierscope.quant.awq_model import awq_model
    from outlierscope.quant.gptq_model import gptq_model

    return (spec.gptq, gptq_model) if spec.gptq is not None else (spec.awq, awq_model)


def calibrate_layers_alone(model: nn.Module, tokenizer, spec, layers, checkpoint_dir, progress: bool = True) -> None:
    """For a study that quantizes one layer at a time (``sensitivity``'s ``only_i`` cells): the GPTQ / AWQ calibration
    of ``spec`` restricted to each layer of ``layers`` (``layers:i``), all in one pass (each layer on the outputs of
    the float layers below it, as ``layers:i`` alone calibrates it), saved in ``checkpoint_dir`` where
    :func:`calibrate` of each ``layers:i`` spec finds it: L layer passes instead of L^2 / 2. Nothing for a spec
    without GPTQ or AWQ."""
    from outlierscope.quant.sequential import calibration_sequences

    spec = QuantSpec.of(spec)
    if not spec.has_linear or (spec.gptq is None and spec.awq is None):
        return
    cfg, run = _layerwise_method(spec)
    sites = [s for s in linear_sites(model, dataclasses.replace(spec, layers=None)) if s.layer in set(layers)]
    seqs = calibration_sequences(tokenizer, spec.calib, cfg, _max_positions(model))  # (N, T)
    run(model, seqs, spec, sites, progress=progress, checkpoint_dir=checkpoint_dir, alone=True)


def calibration_record(spec, tokenizer, ctx: int | None = None) -> dict | None:
    """What a spec's calibration reads, for a run's record (None: it reads nothing): the source as given (or its
    default), the sha256 of its bytes (a file; ``lambada-tail``: LAMBADA's documents, the digest of the text record)
    and, for GPTQ and AWQ, the sequences packed from it (no seed: the documents in order): samples, seqlen, tokens
    and the sha256 of the token ids, which name the calibration exactly whatever the file."""
    import hashlib

    from outlierscope.io import sha256_file
    from outlierscope.quant.sequential import DEFAULT_CALIB, calibration_sequences

    spec = QuantSpec.of(spec)
    if not spec.has_linear or not needs_calibration(spec):
        return None
    layerwise = spec.gptq is not None or spec.awq is not None
    source = spec.calib or (DEFAULT_CALIB if layerwise else "hellaswag")
    rec: dict = {"source": source}
    if source == DEFAULT_CALIB:
        from outlierscope.data.running_text import load_text

        rec["sha256"] = load_text("lambada").sha256
    elif Path(source).is_file():
        rec["sha256"] = sha256_file(source)
    if layerwise:
        cfg = spec.gptq if spec.gptq is not None else spec.awq
        seqs = calibration_sequences(tokenizer, spec.calib, cfg, ctx)  # (N, T)
        rec.update(samples=int(seqs.shape[0]), seqlen=int(seqs.shape[1]), tokens=int(seqs.numel()),
                   tokens_sha256=hashlib.sha256(seqs.cpu().numpy().tobytes()).hexdigest())
    return rec


def calibration_records(specs, model: nn.Module, tokenizer) -> dict:
    """:func:`calibration_record` of each spec that calibrates (label -> record), for a run's record."""
    ctx = _max_positions(model)
    recs = {QuantSpec.of(spec).label: calibration_record(spec, tokenizer, ctx) for spec in specs}
    return {k: v for k, v in recs.items() if v is not None}


def calibration_for(model: nn.Module, tokenizer, spec, checkpoint_dir=None) -> Calibration | None:
    """What :func:`~outlierscope.quant.apply.quantize_model` needs besides ``spec``: the calibration pass of a spec
    with SmoothQuant or static activation scales, else None. Checks the ``linears`` patterns first (before any
    forward). Every process computes the same (it reads the same text)."""
    spec = QuantSpec.of(spec)
    if not spec.has_linear:
        return None
    linear_sites(model, spec)
    return calibrate(model, tokenizer, spec, checkpoint_dir) if needs_calibration(spec) else None


def _read_act_scales(path: str, sites: list[LinearSite]) -> dict[str, torch.Tensor]:
    if not Path(path).is_file():
        raise OutlierscopeError(f"calib:{path}: no such file; give an act_scales.pt (profile --preset smoothquant)")
    try:
        scales = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types for a cut or foreign file
        raise OutlierscopeError(f"calib:{path}: not a readable torch file ({type(e).__name__}); give SmoothQuant's "
                                "act_scales.pt (profile --preset smoothquant writes one)") from None
    if not isinstance(scales, dict):
        raise OutlierscopeError(f"calib:{path}: expected SmoothQuant's act_scales.pt (module name -> per-channel "
                                f"max |x|), got a {type(scales).__name__}")
    out = {}
    for s in sites:
        a = scales.get(s.name)
        if a is None or tuple(a.shape) != (s.module.in_features,):
            close = difflib.get_close_matches(s.name, list(scales), n=1)
            raise OutlierscopeError(f"calib:{path} has no scales of {s.name} ({s.module.in_features} channels)"
                                    + (f"; it has {close[0]}" if close and a is None else
                                       f", got shape {tuple(a.shape)}" if a is not None else ""))
        if not torch.isfinite(a).all() or (a < 0).any() or not (a > 0).any():
            raise OutlierscopeError(f"calib:{path}: the scales of {s.name} are "
                                    + ("not all finite" if not torch.isfinite(a).all() else "negative somewhere"
                                       if (a < 0).any() else "all zero")
                                    + "; expected max |x| per channel (>= 0, some > 0): make it again")
        out[s.name] = a.float()
    return out


def smoothing(sites: list[LinearSite], calib: Calibration, alpha: float) -> dict[str, torch.Tensor]:
    """Per linear name, SmoothQuant's factors (in_features,) (float64, CPU): shared by a group of linears reading the
    same input, from its calibrated max |x| and the largest |W_ij| per input channel over the group; linears that read
    an input of their own get none."""
    by_name = {s.name: s for s in sites}
    out = {}
    for group in calib.groups:
        if len(group) < 2:
            continue
        w_max = torch.stack([by_name[n].module.weight.detach().abs().amax(0).double().cpu() for n in group]).amax(0)
        s = smooth_scales(calib.act_max[group[0]], w_max, alpha)
        out.update({n: s for n in group})
    return out


def _rotated(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """``x @ rot`` in float32 at least (float64 for float64 ``x``), back in ``x``'s dtype."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(work) @ rot.to(x.device, work)).to(x.dtype)


class HeldWeights:
    """Quantized weights held across :func:`quantize_linears` contexts (a perplexity run enters a spec's context once
    per batch): per (owner, linear name) the original weight's key and the quantized copy, while the bytes held stay
    within ``budget`` bytes; a weight beyond it is quantized at each context entry as without a holder. ``owner``
    names one spec with its calibration (the caller's key); the original weight's identity, storage, dtype and device
    guard the rest. Not its in-place version (torch bumps it at each registration of a parametrization): the model's
    weights must not be changed in place while a holder is used (a perplexity run never does)."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self._held: dict = {}

    def get(self, key: tuple, wkey: tuple) -> torch.Tensor | None:
        held = self._held.get(key)
        return held[1] if held is not None and held[0] == wkey else None

    def offer(self, key: tuple, wkey: tuple, w: torch.Tensor) -> None:
        old = self._held.pop(key, None)
        self.used -= 0 if old is None else old[1].nbytes
        if self.used + w.nbytes <= self.budget:
            self._held[key] = (wkey, w)
            self.used += w.nbytes


class _Once(nn.Module):
    """A parametrization computed once from the untouched weight and held (``cache``) while the weight is the same:
    the same tensor object, storage, dtype, device and in-place version (``Tensor._version``). A weight changed in any
    of these ways (``model.double()``, ``.to(device)``, an in-place update) is quantized again. ``cache=False``:
    computed at every access (no held copy). :meth:`compute` is the transform."""

    holder: tuple | None = None  # (HeldWeights, its key for this weight): set before registration; kept beyond the
    # context too

    def __init__(self, cache: bool = True):
        super().__init__()
        self.cache = cache
        self._held: tuple | None = None  # (key, the transformed weight): a plain attribute, in no state_dict

    def compute(self, w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()  # fake quantization has no useful gradient; the weights stay leaves of nothing
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if not self.cache:
            return self.compute(w)
        key = (id(w), w.data_ptr(), w._version, w.dtype, w.device)
        if self._held is None or self._held[0] != key:
            self._held = None  # the old copy's memory is free before the new one is made
            across = key[:2] + key[3:]  # torch bumps the version at each registration: not part of the holder's key
            got = self.holder[0].get(self.holder[1], across) if self.holder is not None else None
            self._held = (key, got if got is not None else self.compute(w))
            if self.holder is not None and got is None:
                self.holder[0].offer(self.holder[1], across, self._held[1])
        return self._held[1]


class _Rounded(_Once):
    """The parametrization ``W -> GPTQ's rounded weight`` (codes x scales)."""

    def __init__(self, rounded, cache: bool = True):
        super().__init__(cache)
        self.rounded = rounded  # a plain attribute: not in any state_dict

    def compute(self, w: torch.Tensor) -> torch.Tensor:
        return self.rounded.weight(w.dtype, w.device)


class _WeightTransform(_Once):
    """The parametrization ``W -> quant_w((W * s) @ H)`` (AWQ: ``quant_w(clip(W * s))``), from the untouched weight."""

    def __init__(self, spec: QuantSpec, scale: torch.Tensor | None, rot: torch.Tensor | None, awq=None,
                 cache: bool = True):
        super().__init__(cache)
        self.part, self.scale, self.rot, self.awq = spec.part("w"), scale, rot, awq  # not in any state_dict

    def compute(self, w: torch.Tensor) -> torch.Tensor:
        if self.awq is not None:
            return self.awq.transform(w, self.part)
        if self.scale is not None:
            w = w * self.scale.to(w.device, w.dtype)  # (O, I) * (I,): SmoothQuant's W diag(s)
        if self.rot is not None:
            w = _rotated(w, self.rot)  # (O, I) @ (I, I)
        return quantize_weight(w, self.part) if self.part is not None else w


@dataclass
class _Padding:
    """The 2-D padding mask (B, T) of the forward in progress (None: none given, or a 4-D mask)."""

    mask: torch.Tensor | None = None

    def pre_forward(self, mod, args, kwargs):
        mask = kwargs.get("attention_mask")
        self.mask = mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def valid_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The validity (B, T) of a (B, T, C) input: the mask's last T tokens (a forward with a cache), or None."""
        m = self.mask
        if m is None or x.dim() != 3 or m.shape[0] != x.shape[0] or m.shape[1] < x.shape[1]:
            return None
        return m[:, -x.shape[1]:].to(x.device)  # (B, T)


class _LastInput:
    """The last input a quantized linear's pre-hook transformed, and the result: the linears that read one tensor
    (q/k/v, gate/up) with the same factors, rotation and static scale get the same bytes, computed once. Holds the
    input itself (its identity is part of the key while it lives) and one result."""

    def __init__(self):
        self.key: tuple | None = None
        self.value: torch.Tensor | None = None
        self.input: torch.Tensor | None = None

    @staticmethod
    def _key(x: torch.Tensor, how: tuple) -> tuple:
        return id(x), x.data_ptr(), x._version, tuple(x.shape), x.dtype, how

    def get(self, x: torch.Tensor, how: tuple) -> torch.Tensor | None:
        return self.value if self.input is x and self.key == self._key(x, how) else None

    def put(self, x: torch.Tensor, how: tuple, y: torch.Tensor) -> None:
        self.input, self.value, self.key = x, y, self._key(x, how)

    def clear(self) -> None:
        self.key = self.value = self.input = None


def _input_hook(spec: QuantSpec, padding: _Padding, scale: torch.Tensor | None, rot: torch.Tensor | None,
                static_amax: torch.Tensor | None, last: _LastInput):
    """A forward pre-hook: the linear's input divided by ``scale``, rotated, then quantized per ``spec``'s ``a=``
    part with LLM.int8's outlier columns kept (see the module docstring). ``last``: shared by the sites of one
    context: an input another site just transformed the same way is taken from it."""
    part = spec.part("a")
    local = token_local(spec)  # a token's quantized input depends on that token alone: padding needs no mask
    how = (id(scale), id(rot), None if static_amax is None else float(static_amax), id(padding))

    def pre(mod, args, kwargs):
        x = args[0] if args else kwargs["input"]
        y = last.get(x, how)
        if y is None:
            y = _transform_input(x, spec, part, padding, local, scale, rot, static_amax)
            last.put(x, how, y)
        return ((y, *args[1:]), kwargs) if args else (args, {**kwargs, "input": y})

    return pre


def _transform_input(x: torch.Tensor, spec: QuantSpec, part, padding: _Padding, local: bool,
                     scale: torch.Tensor | None, rot: torch.Tensor | None, static_amax: torch.Tensor | None):
    """One linear's input divided by ``scale``, rotated, quantized per ``part`` (the ``a=`` part) with LLM.int8's
    outlier columns kept."""
    y = x
    if scale is not None:
        y = y / scale.to(y.device, y.dtype)  # (..., I)
    if rot is not None:
        y = _rotated(y, rot)  # (..., I) @ (I, I)
    if part is not None:
        x3 = y if y.dim() == 3 else y.reshape(1, -1, y.shape[-1])  # (B, T, I); routed tokens: (1, N, I)
        valid = None if local else padding.valid_for(x3)
        cols = skip = None
        if spec.outlier_threshold is not None:
            cols = outlier_columns(x3, valid, spec.outlier_threshold)  # (B, 1, I)
            if spec.bnb_outliers is not None:  # bitsandbytes: only the outlier elements leave the row scales
                skip = x3.abs() >= spec.bnb_outliers  # (B, T, I)
        y = quantize_activation(x3, valid, part, cols, static_amax, skip).reshape(y.shape)
    return y


def _measuring(site: LinearSite, padding: _Padding, error):
    """(pre-hook, hook) that give ``error.update`` each forward's output against the unquantized weight on the original
    input (the pre-hook runs before the quantizing one: it keeps the input the linear was given)."""
    stash: dict = {}

    def pre(mod, args, kwargs):
        stash["x"] = args[0] if args else kwargs["input"]

    def post(mod, args, kwargs, out):
        x = stash.pop("x")
        w = mod.parametrizations.weight.original if parametrize.is_parametrized(mod, "weight") else mod.weight
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        ref = torch.nn.functional.linear(x.to(work), w.to(work), None if mod.bias is None else mod.bias.to(work))
        x3 = x if x.dim() == 3 else x.reshape(1, -1, x.shape[-1])  # (B, T, I)
        error.update(site.layer, site.path, ref, out, padding.valid_for(x3))

    return pre, post


HOLD_FRACTION = 0.5  # hold_weights=None: held where the copies take at most this share of a GPU's free memory


def holds_fit(sites: list[LinearSite], free=None) -> bool:
    """``hold_weights=None``'s choice: whether a held copy of each quantized linear's weight fits. On the CPU: yes;
    on a CUDA device: when the quantized linears' weights on it take at most ``HOLD_FRACTION`` of its free memory
    (``free(device)``: bytes; default ``torch.cuda.mem_get_info``); elsewhere (offloaded ``meta`` weights, other
    accelerators): no, quantized at every forward."""
    need: dict = {}
    for s in sites:
        w = s.module.weight
        need[w.device] = need.get(w.device, 0) + w.numel() * w.element_size()
    free = free or (lambda d: torch.cuda.mem_get_info(d)[0])
    return all(d.type == "cpu" or d.type == "cuda" and n <= HOLD_FRACTION * free(d) for d, n in need.items())


def _weight_parametrization(site: LinearSite, spec: QuantSpec, calibration: Calibration | None,
                            scale: torch.Tensor | None, rot: torch.Tensor | None, hold: bool) -> _Once | None:
    """What replaces a site's weight: AWQ's transform, GPTQ's rounded weight, or ``quant_w((W * s) @ H)``; None when
    the weight stays as it is."""
    if spec.awq is not None:
        return _WeightTransform(spec, None, None, calibration.rounded[site.name], hold)
    if spec.gptq is not None:
        return _Rounded(calibration.rounded[site.name], hold)
    if spec.part("w") is not None or scale is not None or rot is not None:
        return _WeightTransform(spec, scale, rot, cache=hold)
    return None


def _check_linear_spec(spec: QuantSpec, calibration: Calibration | None, sites: list[LinearSite]) -> None:
    if needs_calibration(spec) and calibration is None:
        raise OutlierscopeError(f"{spec.label}: smooth, static scales and gptq need a calibration; pass "
                                "calibration=calibrate(model, tokenizer, spec)")
    layerwise = spec.gptq is not None or spec.awq is not None
    missing = [s.name for s in sites if layerwise and s.name not in calibration.rounded]
    if missing:
        raise OutlierscopeError(f"{spec.label}: the calibration has no {'GPTQ' if spec.gptq else 'AWQ'} weight of "
                                f"{missing[0]}; calibrate with this spec (calibrate(model, tokenizer, spec))")


@contextlib.contextmanager
def quantize_linears(model: nn.Module, spec: QuantSpec, calibration: Calibration | None = None,
                     error=None, hold_weights: bool | None = None,
                     held: tuple | None = None) -> Iterator[list[LinearSite]]:
    """Quantize the linear layers as ``spec``'s ``a=``/``w=`` parts, ``smooth``, ``rotate``, ``outliers``,
    ``linears`` and ``layers`` say (module docstring); ``calibration``: :func:`calibrate`'s, when
    :func:`needs_calibration`; ``error``: a :class:`~outlierscope.analysis.linear_error.LinearErrorStats` that also
    receives each quantized linear's relative output error. ``hold_weights``: each weight quantized once, when the
    context is entered (False: at every forward; None: where the copies fit, :func:`holds_fit`); ``held``: (a
    :class:`HeldWeights`, a key naming this spec and its calibration) to keep them beyond the context, for the next
    context of the same key. Yields the quantized sites.
    Every hook and parametrization is removed in ``finally``: the model's weights are the same tensors, unchanged."""
    sites = linear_sites(model, spec) if spec.has_linear else []
    if not sites:
        yield sites
        return
    _check_linear_spec(spec, calibration, sites)
    hold_weights = holds_fit(sites) if hold_weights is None else hold_weights
    scales = smoothing(sites, calibration, spec.smooth) if spec.smooth is not None else {}
    rots: dict[int, torch.Tensor] = {}
    padding, handles, parametrized = _Padding(), [], []
    no_mask = _Padding()  # the LM head's input: gathered positions, all real
    last = _LastInput()  # q/k/v's and gate/up's shared input, transformed once
    a = spec.part("a")
    try:
        handles.append(trunk(model).register_forward_pre_hook(padding.pre_forward, with_kwargs=True))
        for site in sites:
            d = site.module.in_features
            rot = rots.setdefault(d, rotation(d, spec.rotate, torch.float64)) if spec.rotate is not None else None
            s = scales.get(site.name)
            if spec.awq is not None:
                s = calibration.rounded[site.name].scale
            param = _weight_parametrization(site, spec, calibration, s, rot, hold_weights)
            if param is not None:
                param.holder = None if held is None else (held[0], (held[1], site.name))
                parametrize.register_parametrization(site.module, "weight", param)
                parametrized.append(site.module)
            static = None
            if a is not None and a.granularity == "static":
                act = calibration.act_max[site.name]
                static = (act / s if s is not None else act).amax()
            mask = no_mask if site.is_head else padding
            handles.append(site.module.register_forward_pre_hook(_input_hook(spec, mask, s, rot, static, last),
                                                                 with_kwargs=True))
            if error is not None:
                pre, post = _measuring(site, mask, error)
                handles.append(site.module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
                handles.append(site.module.register_forward_hook(post, with_kwargs=True))
        yield sites
    finally:
        last.clear()
        for h in handles:
            h.remove()
        for m in parametrized:
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)


def token_local(spec: QuantSpec) -> bool:
    """Whether every linear's output at a token depends on that token alone (no per-sequence statistic): then a
    context's choices may share its prefix (:func:`~outlierscope.eval.evaluate.layout_for`)."""
    a = spec.part("a")
    return spec.outlier_threshold is None and (a is None or a.granularity in ("per_token", "per_group", "static")
                                      or a.format not in ("nvfp4",) and a.granularity is None)


def check_linear_shapes(spec: QuantSpec, config) -> None:
    """What the linear parts of ``spec`` need of the model, from its config (a model built on the meta device, no
    weights): ``linears`` patterns that match, ``layers`` it has, group sizes dividing each quantized linear's
    in_features, a rotation of each in_features, and the ``calib:`` source against those linears
    (:func:`check_calibration`). A config transformers cannot build is left to the first forward."""
    from outlierscope.models.quiet import quiet_transformers
    from outlierscope.quant.linear_ops import _base_order

    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"), quiet_transformers():
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # custom code, an architecture without a causal-LM class: checked when the model is loaded
        return
    if spec.layers is not None and max(spec.layers) >= len(decoder_layers(model)):
        return  # check_layers says it
    for site in linear_sites(model, spec):
        d = site.module.in_features
        for p in (spec.part("a"), spec.part("w")):
            if p is not None and p.granularity == "per_group" and d % p.size:
                raise OutlierscopeError(f"{p}: {site.path} has {d} inputs, not a multiple of the group size {p.size}; "
                                        "choose a group size that divides it, or leave it out with linears:")
        if spec.rotate is not None:
            _base_order(d)
    check_calibration(spec, model)


def check_calibration(spec: QuantSpec, model: nn.Module) -> None:
    """``calib:`` read before any forward (a mistake found after the 16-bit cell is a defect): a text file that exists,
    is a file and holds text; an act_scales.pt that loads and has finite, non-negative scales of each quantized
    linear's shape, not all zero for any (every smoothing factor would silently be 1: plain W8A8 under the
    SmoothQuant label)."""
    if not needs_calibration(spec):
        return
    if (spec.gptq is not None or spec.awq is not None) and spec.calib is None:
        from outlierscope.data.running_text import lambada_path

        if not lambada_path().exists():
            raise OutlierscopeError(f"{'gptq' if spec.gptq else 'awq'} calibrates on LAMBADA's last passages by "
                                    "default, not fetched yet; run `outlierscope data fetch`, or give calib:FILE")
        return
    source = spec.calib or "hellaswag"
    if source.endswith(".pt"):
        _read_act_scales(source, linear_sites(model, spec))
    elif source != "hellaswag":
        _check_text(source)


def _check_text(source: str) -> None:
    from outlierscope.data.text import text_documents

    path = Path(source)
    if not path.is_file():
        raise OutlierscopeError(f"calib:{source}: " + ("a directory" if path.is_dir() else "no such file")
                                + "; give hellaswag, a .txt/.jsonl file or an act_scales.pt")
    try:
        first = next((d for d in text_documents(source) if d.strip()), None)
    except (UnicodeDecodeError, ValueError, OSError, EOFError) as e:
        raise OutlierscopeError(f"calib:{source}: not readable as text ({type(e).__name__}); give a UTF-8 .txt or "
                                ".jsonl file") from None
    if first is None:
        raise OutlierscopeError(f"calib:{source}: holds no text; give a .txt/.jsonl file with documents")
