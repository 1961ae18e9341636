"""GPTQ of a model's linear layers, layer after layer, as GPT-QModel and llm-compressor calibrate (their "true
sequential" order): each linear's Hessian comes from the inputs it sees when every linear before it, in this layer
and the layers below, is already quantized.

    seqs    = calibration token ids (N, T)                        # gptq:samples x gptq:seqlen of calib:SOURCE
    inputs  = layer 0's inputs for every sequence (a pre-hook stops each forward there)
    for each decoder layer:
        for each subset of its linears reading one input (q/k/v, o, gate/up, down: found by one forward;
                gptq:sequential=layer, llm-compressor's pipeline: all of the layer's linears, one subset):
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

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.weights.gptq import gptq_quantize, hessian_update
from outlierscope.quant.weights.sequential import (
    DEFAULT_CALIB,
    calibration_sequences,
    layerwise,
    linear_calls,
    run_layer,
    run_until,
    subsets_of,
)

__all__ = ["DEFAULT_CALIB", "RoundedWeight", "calibration_sequences", "gptq_model"]


@dataclass(frozen=True)
class RoundedWeight:
    """A linear's GPTQ weight as codes and scales; ``weight`` is bit for bit the weight GPTQ produced.

    Attributes:
        codes: ``(O, I)`` int8 (zint: uint8, 0 .. 2^bits - 1).
        scale: ``(O, groups)`` float32 (float64 for a float64 model).
        g_idx: ``(I,)`` each column's group.
        zero: ``(O, groups)`` a zint grid's integer zero points; else None."""

    codes: torch.Tensor
    scale: torch.Tensor
    g_idx: torch.Tensor
    zero: torch.Tensor | None = None

    def weight(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """The weight: (codes - zero) times their scale.

        Args:
            dtype: its dtype.
            device: its device."""
        idx = self.g_idx.expand(self.codes.shape[0], -1)  # (O, I)
        s = self.scale.gather(1, idx)  # (O, I)
        q = self.codes.to(s.dtype) - (0 if self.zero is None else self.zero.gather(1, idx))
        return (s * q if self.zero is not None else q * s).to(device=device, dtype=dtype)

    @classmethod
    def of(cls, w: torch.Tensor, h: torch.Tensor, spec: QuantSpec) -> RoundedWeight:
        """GPTQ of a weight with the Hessian of its inputs, as a spec's ``w=`` part and ``gptq`` settings say.

        Args:
            w: the weight ``(O, I)``.
            h: the Hessian ``(I, I)``.
            spec: the spec."""
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


def _gptq_layer(spec: QuantSpec):
    """One layer's GPTQ: per subset of linears reading one input (``gptq:sequential=subset``, true sequential inside
    the layer; ``layer``: all the layer's linears as one subset), the Hessians from the layer run on every input with
    the subsets before it already rounded, then each linear's rounding, fixed."""

    def calibrate(layer: nn.Module, mine: dict[str, nn.Linear], inputs: list, fix) -> dict[str, RoundedWeight]:
        out = {}
        calls = linear_calls(layer, mine, inputs[0])
        once = len(calls) == len({p for p, _ in calls})  # then each subset's forward may stop after its linears
        subsets = subsets_of(calls) if spec.gptq.sequential == "subset" else [list(mine)]
        for subset in subsets:
            modules = {p: mine[p] for p in subset}
            with _hessians(modules) as acc:  # the forward up to the subset's last linear (all of it: one runs twice)
                run_until(layer, inputs, list(modules.values())) if once else run_layer(layer, inputs)
            for p, m in modules.items():
                out[p] = RoundedWeight.of(m.weight.detach(), acc[p][0], spec)
                fix(m, out[p].weight(m.weight.dtype, m.weight.device))
        return out

    return calibrate


def gptq_model(model: nn.Module, seqs: torch.Tensor, spec: QuantSpec, sites: list, progress: bool = True,
               checkpoint_dir=None, alone: bool = False) -> dict[str, RoundedWeight]:
    """GPTQ of a spec's linears, calibrated layer after layer; the model comes back as it was.

    Args:
        model: the model.
        seqs: calibration token ids ``(N, T)``.
        spec: the spec (with ``gptq``).
        sites: its quantized linears (``linear_sites``).
        progress: show a progress bar.
        checkpoint_dir: every finished layer is saved there and a rerun continues after it; None: not kept.
        alone: each layer as if it alone were quantized (``layerwise``).

    Returns:
        Full module name -> ``RoundedWeight``."""
    if spec.gptq is None:
        raise OutlierscopeError(f"{spec}: no gptq in the spec; add gptq (e.g. w=fint4/per_group:128; gptq)")
    return layerwise(model, seqs, spec, sites, "gptq", _gptq_layer(spec),
                     lambda r, m: r.weight(m.weight.dtype, m.weight.device), RoundedWeight, progress, checkpoint_dir, alone)
