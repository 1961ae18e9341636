"""

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.numerics.registry import FORMATS, integer_formats
from outlierscope.quant.specs.calibrated import ORDERS, SEQUENTIAL, GPTQConfig  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class GPTQResult:
    """One linear's GPTQ.

    Attributes:
        weight: ``(O, I)`` on the grid, dequantized (float32; float64 for a float64 weight).
        scale: ``(O, groups)`` in group order (per-channel: one column).
        g_idx: ``(I,)`` each input column's group.
        perm: the order the columns were processed in; None: as they are.
        zero: ``(O, groups)`` the integer zero points of a zint grid; else None."""

    weight: torch.Tensor
    scale: torch.Tensor
    g_idx: torch.Tensor
    perm: torch.Tensor | None
    zero: torch.Tensor | None = None


def hessian_update(h: torch.Tensor | None, n: int, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """GPTQ's running Hessian after one batch of a layer's inputs, as GPT-QModel and llm-compressor keep it.

    The Hessian is rescaled to the new count and ``2/n x^T x`` added (their ``add_batch`` / ``accumulate_hessian``, up
    to float32 rounding; float64 for float64 inputs).

    Args:
        h: ``(I, I)`` float32; None: the first batch.
        n: the count so far.
        x: the batch ``(B, T, I)`` (B sequences).

    Returns:
        ``(a new Hessian, the new count)``."""
    B, n_in = x.shape[0], x.shape[-1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32  # float32 as the references; float64 for tests
    h = torch.zeros(n_in, n_in, dtype=dt, device=x.device) if h is None else h * (n / (n + B))
    n += B
    inp = (2 / n) ** 0.5 * x.reshape(-1, n_in).t().to(dt)  # (I, B*T)
    return h + inp.matmul(inp.t()), n


def inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of ``(H + damp mean(diag H) I)^-1``, as GPT-QModel and llm-compressor compute it.

    Args:
        h: the Hessian ``(I, I)`` (not changed).
        damp: the damping fraction.

    Raises:
        OutlierscopeError: a Hessian that stays singular, naming the fix."""
    h = h.clone()
    h.diagonal().add_(damp * torch.mean(torch.diag(h)))  # the mean of a contiguous copy: GPT-QModel's summation order
    try:
        return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except torch.linalg.LinAlgError:
        raise OutlierscopeError(f"the Hessian is not positive definite with damp={damp}; raise damp (e.g. 0.1) or "
                                "calibrate on more tokens") from None


def column_order(diag: torch.Tensor, order: str, group: int | None) -> torch.Tensor | None:
    """The order the columns are quantized in, from the Hessian's diagonal.

    ``desc``: GPTQ's act order (decreasing diagonal); ``gar``: GPT-QModel's group-aware reordering (Gafni et al.
    2025): the groups whole, by decreasing largest diagonal (a stable sort), each group's columns by decreasing
    diagonal; columns after the last whole group stay at the end.

    Args:
        diag: the Hessian's diagonal ``(I,)``.
        order: ``none``, ``desc`` or ``gar``.
        group: input columns per group (``gar`` needs them).

    Returns:
        The permutation; None for ``none``."""
    if order == "none":
        return None
    if order == "desc":
        return torch.argsort(diag, descending=True)
    n = diag.numel() // group
    values, local = torch.sort(diag[: n * group].view(n, group), dim=1, descending=True)  # (groups, G)
    glob = torch.argsort(values[:, 0], descending=True, stable=True)  # (groups,)
    base = (torch.arange(n, device=diag.device) * group).view(n, 1)  # (groups, 1)
    perm = (local + base)[glob].reshape(-1)  # (groups * G,)
    return torch.cat([perm, torch.arange(n * group, diag.numel(), device=diag.device)])


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, fmt: str = "fint", group: int | None = None,
                  block_size: int = 128, damp: float = 0.01, order: str = "none",
                  static_groups: bool = False) -> GPTQResult:
    """GPTQ of a weight with the Hessian of its inputs; neither input is changed.

    Args:
        w: the weight ``(O, I)``.
        h: the Hessian ``(I, I)``.
        bits: the width.
        fmt: an integer grid (``integer_formats()``).
        group: input columns per scale; None: one scale per output row.
        block_size: columns per block of the lazy updates.
        damp: the damping fraction.
        order: ``column_order``'s.
        static_groups: each group's scale from the weight before any update (GPT-QModel's ``static_groups``)."""
    grid = FORMATS.get(fmt)
    if grid is None or not grid.integer or grid.bits is None:
        raise OutlierscopeError(f"GPTQ grid must be one of {', '.join(integer_formats())}, got {fmt!r}")
    if order not in ORDERS or (order == "gar" and group is None):
        raise OutlierscopeError(f"GPTQ order must be one of {', '.join(ORDERS)} (gar: with groups), got {order!r}")
    n_out, n_in = w.shape
    if h.shape != (n_in, n_in):
        raise OutlierscopeError(f"the Hessian must be ({n_in}, {n_in}) for a weight of {n_in} inputs, got {tuple(h.shape)}")
    if group is not None and n_in % group:
        raise OutlierscopeError(f"{n_in} input columns are not a multiple of the group size {group}")
    dt = torch.float64 if w.dtype == torch.float64 else torch.float32  # float32 as the references; float64 for tests
    W, H = w.to(dt).clone(), h.to(dt).clone()
    row_scale = grid.scale_params(W, bits, (1,))  # per-channel: the weight as given (GPT-QModel's first find_params)
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    G = group or n_in
    static = None  # static groups: every group's (scale, zero) from the original column order, before any update
    if group is not None and static_groups:
        static = tuple(None if t is None else t.reshape(n_out, n_in // G)  # (O * I/G, 1) -> (O, I/G)
                       for t in grid.scale_params(W.reshape(n_out * (n_in // G), G), bits, (1,)))
    perm = column_order(H.diagonal(), order, group)
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    U = inverse_hessian_factor(H, damp)
    Q, taken = _columns(W, U, bits, grid, group, block_size, static, perm, row_scale)
    g_idx = torch.arange(n_in, device=w.device) // G  # (I,): in processing order
    if static is not None:
        scale, zero = static
    elif group is None:
        scale, zero = row_scale
    else:  # (O, groups) each
        scale = torch.cat([p[0] for p in taken], 1)
        zero = None if taken[0][1] is None else torch.cat([p[1] for p in taken], 1)
    if perm is not None:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
        if order == "gar" and static is None:  # whole groups moved: each keeps its columns, its scale goes back
            back = torch.argsort(perm[::G] // G)
            scale, zero = scale[:, back], (None if zero is None else zero[:, back])
        g_idx = perm[inv] // G if static is not None or order == "gar" else g_idx[inv]
    Q.add_(0.0)  # a weight rounded to code 0 is +0.0 as GPT-QModel's scale * (q - zero) makes it (round() gave -0.0)
    return GPTQResult(Q, scale, g_idx, perm, zero)


def _columns(W: torch.Tensor, U: torch.Tensor, bits: int, grid, group: int | None, block_size: int,
             static: tuple | None, perm: torch.Tensor | None, row_scale: tuple) -> tuple[torch.Tensor, list[tuple]]:
    """The column loop (module docstring) on ``W`` (O, I, processing order; updated in place: the caller's copy).
    Returns the rounded weight and, for dynamic groups, each group's (scale, zero) (O, 1) in processing order."""
    n_out, n_in = W.shape
    Q, scales, scale = torch.zeros_like(W), [], row_scale
    for i1 in range(0, n_in, block_size):
        i2 = min(i1 + block_size, n_in)
        W1, E1, U1 = W[:, i1:i2].clone(), torch.zeros(n_out, i2 - i1, dtype=W.dtype, device=W.device), U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            if group is not None and static is None and j % group == 0:
                scale = grid.scale_params(W[:, j:j + group], bits, (1,))  # W: before this block's own updates (GPT-QModel)
                scales.append(scale)
            elif static is not None:
                col = (int(perm[j]) if perm is not None else j) // group
                scale = tuple(None if t is None else t[:, col, None] for t in static)  # (O, 1) each
            q = grid.round(W1[:, i:i + 1], scale, bits)[:, 0]  # (O,)
            Q[:, j] = q
            e = (W1[:, i] - q) / U1[i, i]
            W1[:, i:] -= e.unsqueeze(1).matmul(U1[i, i:].unsqueeze(0))  # (O, 1) x (1, rest)
            E1[:, i] = e
        W[:, i2:] -= E1.matmul(U[i1:i2, i2:])
    return Q, scales
