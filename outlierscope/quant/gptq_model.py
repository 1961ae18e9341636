"""GPTQ of a model's linear layers, layer after layer, as GPT-QModel and llm-compressor calibrate (their "true
sequential" order): each linear's Hessian comes from the inputs it sees when every linear before it, in this layer
and the layers below, is already quantized.

    seqs    = calibration token ids (N, T)                        # gptq:samples x gptq:seqlen of calib:SOURCE
    inputs  = layer 0's inputs for every sequence (a pre-hook stops each forward there)
    for each decoder layer:
        for each subset of its linears reading one input (q/k/v, o, gate/up, down: found by one forward):
            H = hessian_update over the subset's inputs, the layer run on every sequence's input
            each linear of the subset: gptq_quantize(W, H) -> its rounded weight, in place from now on
        inputs = the (quantized) layer's outputs                  # the next layer's inputs
    every weight restored; the rounded weights returned (int8 codes, scales, g_idx)

Memory: one layer's inputs for the N sequences and one Hessian (I, I) float32 per linear of a subset. The weights
are never changed: during the pass a rounded weight is a parametrization removed in ``finally``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.points import decoder_layers
from outlierscope.quant.gptq import gptq_quantize, hessian_update
from outlierscope.quant.sequential import (
    DEFAULT_CALIB,
    Fixed,
    calibration_sequences,
    input_subsets,
    layer_inputs,
    next_inputs,
    run_layer,
)
from outlierscope.quant.spec import QuantSpec

__all__ = ["DEFAULT_CALIB", "RoundedWeight", "calibration_sequences", "gptq_model"]


@dataclass(frozen=True)
class RoundedWeight:
    """A linear's GPTQ weight: ``codes`` (O, I) int8 (zint: uint8, 0 .. 2^bits - 1), ``scale`` (O, groups) float32
    (float64 for a float64 model), ``g_idx`` (I,) each column's group, ``zero`` (O, groups) a zint grid's integer zero
    points (else None); :meth:`weight` is (codes - zero) x their scale, bit for bit the weight GPTQ produced."""

    codes: torch.Tensor
    scale: torch.Tensor
    g_idx: torch.Tensor
    zero: torch.Tensor | None = None

    def weight(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        idx = self.g_idx.expand(self.codes.shape[0], -1)  # (O, I)
        s = self.scale.gather(1, idx)  # (O, I)
        q = self.codes.to(s.dtype) - (0 if self.zero is None else self.zero.gather(1, idx))
        return (s * q if self.zero is not None else q * s).to(device=device, dtype=dtype)

    @classmethod
    def of(cls, w: torch.Tensor, h: torch.Tensor, spec: QuantSpec) -> RoundedWeight:
        """GPTQ of ``w`` (O, I) with the Hessian ``h`` as ``spec`` says (its ``w=`` part and ``gptq`` settings)."""
        part, cfg = spec.part("w"), spec.gptq
        fmt = part.format
        r = gptq_quantize(w, h, part.bits, fmt, part.size if part.granularity == "per_group" else None, cfg.block,
                          cfg.damp, cfg.order, cfg.static)
        g_idx = r.g_idx if part.granularity == "per_group" else torch.zeros_like(r.g_idx)
        idx = g_idx.expand(w.shape[0], -1)  # (O, I)
        s = r.scale.gather(1, idx)  # (O, I)
        if r.zero is None:
            return cls(torch.round(r.weight / s).to(torch.int8), r.scale, g_idx)  # on the weight's device
        codes = torch.round(r.weight / s) + r.zero.gather(1, idx)  # GPTQ's packed codes: round(W / s + zero)
        return cls(codes.to(torch.uint8), r.scale, g_idx, r.zero)


@contextlib.contextmanager
def _hessians(modules: dict[str, nn.Linear]) -> Iterator[dict[str, list]]:
    """Pre-hooks that stream each module's inputs into its GPTQ Hessian: name -> [H, count]."""
    acc = {p: [None, 0] for p in modules}

    def hook(p):
        def pre(mod, args):
            acc[p][0], acc[p][1] = hessian_update(acc[p][0], acc[p][1], args[0].detach())
        return pre

    handles = [m.register_forward_pre_hook(hook(p)) for p, m in modules.items()]
    try:
        yield acc
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def gptq_model(model: nn.Module, seqs: torch.Tensor, spec: QuantSpec, sites: list,
               progress: bool = True) -> dict[str, RoundedWeight]:
    """GPTQ of the linears ``sites`` (:func:`~outlierscope.quant.linear.linear_sites` of ``spec``), calibrated layer
    after layer on ``seqs`` (N, T) token ids (module docstring). Returns full module name -> :class:`RoundedWeight`;
    the model is as it was."""
    from tqdm.auto import tqdm

    if spec.gptq is None:
        raise OutlierscopeError(f"{spec}: no gptq in the spec; add gptq (e.g. w=fint4/per_group:128; gptq)")
    by_layer: dict[int, dict[str, nn.Linear]] = {}
    names = {}
    for s in sites:
        by_layer.setdefault(s.layer, {})[s.path] = s.module
        names[s.module] = s.name
    out: dict[str, RoundedWeight] = {}
    fixed: list[nn.Module] = []
    try:
        inputs = layer_inputs(model, seqs)
        layers = decoder_layers(model)
        last = max(by_layer, default=-1)
        for i in tqdm(range(last + 1), desc="gptq", unit="layer", disable=not progress or None):
            mine = by_layer.get(i, {})
            for subset in input_subsets(layers[i], mine, inputs[0]) if mine else []:
                modules = {p: mine[p] for p in subset}
                with _hessians(modules) as acc:
                    run_layer(layers[i], inputs)
                for p, m in modules.items():
                    r = RoundedWeight.of(m.weight.detach(), acc[p][0], spec)
                    out[names[m]] = r
                    parametrize.register_parametrization(m, "weight", Fixed(r.weight(m.weight.dtype, m.weight.device)))
                    fixed.append(m)
            if i < last:
                inputs = next_inputs(layers[i], inputs)
    finally:
        for m in fixed:
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)
    return out
