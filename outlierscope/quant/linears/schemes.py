"""Quantize the ``nn.Linear`` layers of a model's decoder layers: their inputs and weights, with SmoothQuant, a Hadamard
rotation or LLM.int8's decomposition (the ``a=``/``w=`` parts of ``QuantSpec``).

What one quantized linear computes, per forward (pseudo-code; ``s`` SmoothQuant's factors, ``H`` the rotation)::

    x' = (x / s) @ H                      # exact in full precision: (x / s) H (W s H)^T = x W^T
    W' = (W * s) @ H                      # (out, in): s scales input columns
    # @ H: as A^T (X B) per row X (m, k) of the factors H = diag(signs) kron(A, B) / sqrt(d) (ops.Rotation)
    cols = outlier_columns(x', 6.0)        # LLM.int8: kept in full precision, left out of every scale
    y = quant_a(x', cols) @ quant_w(W')^T + b

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
from outlierscope.hooks.points import trunk
from outlierscope.quant.linears.ops import (
    Rotation,
    outlier_columns,
    quantize_activation,
    quantize_weight,
    rotation_factors,
    smooth_scales,
)
from outlierscope.quant.linears.sites import (
    Calibration,
    LinearSite,
    linear_sites,
    needs_calibration,
    token_local,
)
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.specs.transforms import BnbOutliers, Rotate, Smooth, Transform


def smoothing(sites: list[LinearSite], calib: Calibration, alpha: float) -> dict[str, torch.Tensor]:
    """Per linear, SmoothQuant's factors ``(in_features,)`` (float64, CPU), shared by the linears that read one input.

    From the input's calibrated max |x| and the largest |W_ij| per input channel over the group; a linear that reads
    an input of its own gets none.

    Args:
        sites: the quantized linears.
        calib: the calibration (its groups and max |x|).
        alpha: SmoothQuant's migration strength."""
    by_name = {s.name: s for s in sites}
    out = {}
    for group in calib.groups:
        if len(group) < 2:
            continue
        w_max = torch.stack([by_name[n].module.weight.detach().abs().amax(0).double().cpu() for n in group]).amax(0)
        s = smooth_scales(calib.act_max[group[0]], w_max, alpha)
        out.update({n: s for n in group})
    return out


class HeldWeights:
    """Quantized weights held across ``quantize_linears`` contexts (a perplexity run enters a spec's context per batch).

    Per (owner, linear name): the original weight's key and the quantized copy, while the bytes held stay within the
    budget; a weight beyond it is quantized at each entry as without a holder. The owner names one spec with its
    calibration (the caller's key); the weight's identity, storage, dtype and device guard the rest, not its in-place
    version: the model's weights must not change in place while a holder is used (a perplexity run never does).

    Args:
        budget: the most bytes held."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self._held: dict = {}

    def get(self, key: tuple, wkey: tuple) -> torch.Tensor | None:
        """The held copy of a weight, if it is the one held for this key.

        Args:
            key: ``(owner, linear name)``.
            wkey: the original weight's key."""
        held = self._held.get(key)
        return held[1] if held is not None and held[0] == wkey else None

    def offer(self, key: tuple, wkey: tuple, w: torch.Tensor) -> None:
        """Hold a quantized copy for a key, in place of the one held before, if it fits the budget.

        Args:
            key: ``(owner, linear name)``.
            wkey: the original weight's key.
            w: the quantized copy."""
        old = self._held.pop(key, None)
        self.used -= 0 if old is None else old[1].nbytes
        if self.used + w.nbytes <= self.budget:
            self._held[key] = (wkey, w)
            self.used += w.nbytes


class _Once(nn.Module):
    """A parametrization computed once from the untouched weight and held (``cache``) while the weight is the same:
    the same tensor object, storage, dtype, device and in-place version (``Tensor._version``). A weight changed in any
    of these ways (``model.double()``, ``.to(device)``, an in-place update) is quantized again. ``cache=False``:
    computed at every access (no held copy). ``compute`` is the transform."""

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

    def __init__(self, spec: QuantSpec, scale: torch.Tensor | None, rot: Rotation | None, awq=None,
                 cache: bool = True):
        super().__init__(cache)
        self.part, self.scale, self.rot, self.awq = spec.part("w"), scale, rot, awq  # not in any state_dict
        self.transforms = spec.transforms

    def compute(self, w: torch.Tensor) -> torch.Tensor:
        if self.awq is not None:
            return self.awq.transform(w, self.part)
        if self.scale is not None:
            w = w * self.scale.to(w.device, w.dtype)  # (O, I) * (I,): SmoothQuant's W diag(s)
        if self.rot is not None:
            w = self.rot.apply(w)  # (O, I) @ R (I, I)
        for t in self.transforms:  # a registered transform's change of the weight (built-ins: none)
            w = t.linear_weight(w)
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


def _input_hook(spec: QuantSpec, padding: _Padding, scale: torch.Tensor | None, rot: Rotation | None,
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
                     scale: torch.Tensor | None, rot: Rotation | None, static_amax: torch.Tensor | None):
    """One linear's input divided by ``scale``, rotated, quantized per ``part`` (the ``a=`` part) with LLM.int8's
    outlier columns kept."""
    y = x
    if scale is not None:
        y = y / scale.to(y.device, y.dtype)  # (..., I)
    if rot is not None:
        y = rot.apply(y)  # (..., I) @ R (I, I)
    for t in spec.transforms:  # a registered transform's exact change of the input (built-ins: none)
        y = t.linear_input(y)
    if part is not None:
        x3 = y if y.dim() == 3 else y.reshape(1, -1, y.shape[-1])  # (B, T, I); routed tokens: (1, N, I)
        valid = None if local else padding.valid_for(x3)
        cols = skip = None
        if spec.outlier_threshold is not None:
            cols = outlier_columns(x3, valid, spec.outlier_threshold)  # (B, 1, I)
            if spec.get(BnbOutliers) is not None:  # bitsandbytes: only the outlier elements leave the row scales
                skip = x3.abs() >= spec.outlier_threshold  # (B, T, I)
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
    """``hold_weights=None``'s choice: whether a held copy of each quantized linear's weight fits.

    On the CPU: yes; on a CUDA device: when the quantized linears' weights on it take at most ``HOLD_FRACTION`` of its
    free memory; elsewhere (offloaded ``meta`` weights, other accelerators): no, quantized at every forward.

    Args:
        sites: the quantized linears.
        free: ``free(device)``: its free bytes; None: ``torch.cuda.mem_get_info``."""
    need: dict = {}
    for s in sites:
        w = s.module.weight
        need[w.device] = need.get(w.device, 0) + w.numel() * w.element_size()
    free = free or (lambda d: torch.cuda.mem_get_info(d)[0])
    return all(d.type == "cpu" or d.type == "cuda" and n <= HOLD_FRACTION * free(d) for d, n in need.items())


def _weight_parametrization(site: LinearSite, spec: QuantSpec, calibration: Calibration | None,
                            scale: torch.Tensor | None, rot: Rotation | None, hold: bool) -> _Once | None:
    """What replaces a site's weight: AWQ's transform, GPTQ's rounded weight, or ``quant_w((W * s) @ H)``; None when
    the weight stays as it is."""
    if spec.awq is not None:
        return _WeightTransform(spec, None, None, calibration.rounded[site.name], hold)
    if spec.gptq is not None:
        return _Rounded(calibration.rounded[site.name], hold)
    reweights = any(type(t).linear_weight is not Transform.linear_weight for t in spec.transforms)
    if spec.part("w") is not None or scale is not None or rot is not None or reweights:
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
    """Quantize the linear layers as a spec's ``a=`` / ``w=`` parts and transforms say, inside the block.

    Every hook and parametrization is removed in ``finally``: the model's weights are the same tensors, unchanged.

    Args:
        model: the model.
        spec: the spec (its linear parts, ``smooth``, ``rotate``, ``outliers``, ``linears``, ``layers``).
        calibration: ``calibrate``'s result, where ``needs_calibration``.
        error: a ``LinearErrorStats`` that receives each quantized linear's relative output error.
        hold_weights: quantize each weight once on entry (False: at every forward; None: where the copies fit,
            ``holds_fit``).
        held: ``(HeldWeights, key)``: keep the quantized weights beyond the block for the next with the same key.

    Yields:
        The quantized linears' sites."""
    sites = linear_sites(model, spec) if spec.has_linear else []
    if not sites:
        yield sites
        return
    _check_linear_spec(spec, calibration, sites)
    hold_weights = holds_fit(sites) if hold_weights is None else hold_weights
    smooth, rotate = spec.get(Smooth), spec.get(Rotate)
    scales = smoothing(sites, calibration, smooth.alpha) if smooth is not None else {}
    rots: dict[int, Rotation] = {}
    padding, handles, parametrized = _Padding(), [], []
    no_mask = _Padding()  # the LM head's input: gathered positions, all real
    last = _LastInput()  # q/k/v's and gate/up's shared input, transformed once
    a = spec.part("a")
    try:
        handles.append(trunk(model).register_forward_pre_hook(padding.pre_forward, with_kwargs=True))
        for site in sites:
            d = site.module.in_features
            rot = rots.setdefault(d, rotation_factors(d, rotate.seed)) if rotate is not None else None
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
