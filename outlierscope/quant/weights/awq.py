"""

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.specs.calibrated import AWQConfig  # noqa: F401 (re-exported)

CLIP_EPS_W, SCALE_EPS = 1e-6, 1e-4  # AutoAWQ's: the weight normalisation and the scale floor


def weight_mean(weights: list[torch.Tensor], group: int | None) -> torch.Tensor:
    """AWQ's per-input-channel weight magnitude of the linears reading one input.

    Each weight is normalised by its quantization groups' max |W| (+1e-6) and averaged over all their rows, in the
    weights' dtype, float32 at least (AutoAWQ: the weights' dtype; a float64 model's statistic is float64).

    Args:
        weights: the linears' weights ``(O_k, I)``.
        group: input channels per quantization group; None: the whole row.

    Returns:
        ``(I,)``."""
    dt = torch.promote_types(weights[0].dtype, torch.float32)
    w = torch.cat([x.to(dt) for x in weights])  # (sum O_k, I)
    rows, n_in = w.shape
    g = group or n_in
    a = w.abs().reshape(rows, n_in // g, g)  # (O, I/G, G)
    a = a / (a.amax(-1, keepdim=True) + CLIP_EPS_W)
    return a.reshape(rows, n_in).sum(0) / rows


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float) -> torch.Tensor:
    """One grid point's scales ``(I,)``, duo (with the weights' magnitude) or activation-only; a new tensor.

    Args:
        x_mean: the inputs' per-channel mean |x|.
        w_mean: ``weight_mean``'s; None: activation-only.
        ratio: the grid point's exponent."""
    if w_mean is not None:
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + SCALE_EPS)).clamp(min=SCALE_EPS)
    else:
        s = x_mean.pow(ratio).clamp(min=SCALE_EPS)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def search_scale(x_mean: torch.Tensor, w_mean: torch.Tensor, loss: Callable[[torch.Tensor], float],
                 grid: int = 20, duo: bool = True) -> tuple[torch.Tensor, int, list[float]]:
    """AWQ's grid search over the ratios ``i / grid``: the scales of least loss.

    Args:
        x_mean: the inputs' per-channel mean |x|, in the dtype the scales are computed in.
        w_mean: ``weight_mean``'s.
        loss: ``loss(scales)``: the output error they give.
        grid: the number of ratios.
        duo: scales from both magnitudes; False: from the activations' alone.

    Returns:
        ``(scales (I,), the chosen ratio's index, every ratio's loss)``."""
    losses, best, best_i = [], None, -1
    for i in range(grid):
        s = candidate_scales(x_mean, w_mean if duo else None, i / grid)
        err = float(loss(s))
        losses.append(err)
        if err < (losses[best_i] if best_i >= 0 else float("inf")):
            best, best_i = s, i
    if best is None:
        raise OutlierscopeError(f"awq: no finite loss in the scale search (losses {losses[:3]}...); the module's "
                                "output is not finite on the calibration text")
    return best, best_i, losses


# elements of search_clip's per-step product (o, n, I/G, G): 8 MiB of float32, about what a core's cache holds. The
# product is the search's cost; a step of 64 rows of SmolLM2's gate_proj (75 MiB) ran 4x slower than steps this size
CLIP_STEP_ELEMENTS = 2**21


def clip_errors(w: torch.Tensor, x: torch.Tensor, quant: Callable[[torch.Tensor], torch.Tensor], group: int | None,
                grid: int = 20, shrink: float = 0.5, tokens: int = 512,
                rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The errors AWQ's clipping search compares for a weight on its inputs.

    Each (row, group)'s largest |w| ``(O, I/G)`` and the mean squared output error of every shrink step
    ``(S, O, I/G)``, S = ``shrink * grid``, in w's dtype. ``rows`` is speed and memory only: each row's sums over a
    group and means over the tokens reduce the same elements in the same order whatever the step (tested).

    Args:
        w: the weight ``(O, I)``.
        x: its inputs ``(N, I)``, every (N // tokens)-th row read.
        quant: the weight quantizer ``(O', I) -> (O', I)`` (a ``w=`` part).
        group: input channels per group; None: the whole row.
        grid: the grid's steps.
        shrink: the largest fraction shrunk.
        tokens: input rows read.
        rows: output rows per step; None: about ``CLIP_STEP_ELEMENTS`` elements."""
    n_out, n_in = w.shape
    g = group or n_in
    x = x.reshape(-1, n_in)[:: max(1, x.reshape(-1, n_in).shape[0] // tokens)]  # (n, I)
    xg = x.reshape(1, x.shape[0], n_in // g, g)  # (1, n, I/G, G)
    rows = rows or max(1, CLIP_STEP_ELEMENTS // (x.shape[0] * n_in))
    tops, errs = [], []
    for r in range(0, n_out, rows):
        wb = w[r:r + rows]  # (o, I)
        wg = wb.reshape(wb.shape[0], 1, n_in // g, g)  # (o, 1, I/G, G)
        top = wg.abs().amax(-1, keepdim=True)  # (o, 1, I/G, 1)
        ref = (xg * wg).sum(-1)  # (o, n, I/G)
        step = []
        for i in range(int(shrink * grid)):
            m = top * (1 - i / grid)
            q = quant(torch.clamp(wg, -m, m).reshape(wb.shape)).reshape(wg.shape)  # (o, 1, I/G, G)
            step.append(((xg * q).sum(-1) - ref).pow(2).mean(1))  # (o, I/G)
        tops.append(top.reshape(wb.shape[0], n_in // g))  # (o, I/G)
        errs.append(torch.stack(step))  # (S, o, I/G)
    return torch.cat(tops), torch.cat(errs, 1)


def search_clip(w: torch.Tensor, x: torch.Tensor, quant: Callable[[torch.Tensor], torch.Tensor], group: int | None,
                grid: int = 20, shrink: float = 0.5, tokens: int = 512, rows: int | None = None) -> torch.Tensor:
    """AWQ's clipping search: each row's group bound ``(O, groups)``, the shrink step of least ``clip_errors``.

    The first of equal steps wins; with none finite, no shrink.

    Args:
        w: the weight ``(O, I)``.
        x: its inputs ``(N, I)``.
        quant: the weight quantizer.
        group: input channels per group; None: the whole row.
        grid: the grid's steps.
        shrink: the largest fraction shrunk.
        tokens: input rows read.
        rows: output rows per step."""
    top, errs = clip_errors(w, x, quant, group, grid, shrink, tokens, rows)  # (O, I/G), (S, O, I/G)
    best, least = top.clone(), torch.full_like(top, 1e9)
    for i in range(errs.shape[0]):
        m = top * (1 - i / grid)
        better = errs[i] < least
        least[better], best[better] = errs[i][better], m[better]
    return best


def clip_groups(w: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """A weight clamped to ``[-bound, bound]`` per (row, group); a new tensor.

    Args:
        w: the weight ``(O, I)``.
        bound: ``(O, groups)``."""
    n_out, n_in = w.shape
    b = bound.to(w.dtype).reshape(n_out, -1, 1)  # (O, I/G, 1)
    return torch.clamp(w.reshape(n_out, b.shape[1], -1), -b, b).reshape(n_out, n_in)  # (O, I/G, G) -> (O, I)
