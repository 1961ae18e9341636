"""The per-element work of the outlier reducers: one pass per observed tensor, compiled into fused loops.

Each function reads the observed tensor once and returns what the reducers keep, reduced along the last
one or two dims (per row, per channel); everything after it (top-k selection, merging, float64 sums) touches
those small results only. The functions are plain PyTorch: ``kernel`` returns them compiled
(``torch.compile``: one fused C++/OpenMP loop on CPU, Triton on a GPU) or as they are (eager; the same
results except the float rounding of sums, see below).

Work per element of the observed tensor (``x``: a map (B, H, T, S) or a token tensor (B, T, C)):

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import torch


@functools.lru_cache(maxsize=16)
def bin_table(lo: float, ratio: float, n: int, device: str = "cpu") -> tuple[torch.Tensor, int]:
    """A lookup table for ``bin_index`` of the bins with the n + 1 float32 edges lo r^j, and its shift ``s``.

    The edges are computed in float64, then rounded. The bits of a float32 >= 0, read as an int32, order like the
    values; cut into cells of 2^s consecutive bit patterns, narrow enough (s <= 23 + log2(r - 1)) to hold at most one
    edge, ``table[cell]`` is (the number of edges below the cell) << (s + 1) | (the low s bits of the edge inside it,
    or 2^s if none).

    Args:
        lo: the first edge.
        ratio: r.
        n: the number of bins.
        device: where the table lives."""
    eb = (lo * ratio ** np.arange(n + 1, dtype=np.float64)).astype(np.float32).view(np.int32).astype(np.int64)
    for s in range(min(23, math.floor(23 + math.log2(ratio - 1))), 7, -1):  # tables of at most 2^23 entries
        start = np.arange(2 ** (31 - s), dtype=np.int64) << s  # first bit pattern of each cell
        below = np.searchsorted(eb, start, side="left")  # edges below the cell
        j = np.minimum(below, n)
        inside = (below <= n) & (eb[j] < start + 2**s)
        second = inside & (below < n) & (eb[np.minimum(below + 1, n)] < start + 2**s)
        if not second.any() and n + 1 < 2 ** (30 - s):
            table = (below << (s + 1)) | np.where(inside, eb[j] & (2**s - 1), 2**s)
            return torch.from_numpy(table.astype(np.int32)).to(device), s
    raise ValueError(f"no bin table for ratio {ratio}: expected a bin ratio >= 1.0001 (finer bins need a table "
                     f"of more than 2^23 entries)")


def bin_index(a: torch.Tensor, table: torch.Tensor, s: int) -> torch.Tensor:
    """The bin of each |x|: the number of edges at or below float32(|x|), int32, exact (integer work only).

    Args:
        a: |x| (>= 0).
        table: ``bin_table``'s table.
        s: its shift."""
    bits = a.float().view(torch.int32)
    cell = table[bits >> s]  # (below << (s + 1)) | the edge's low bits
    # 2 ** s, not 1 << s: compiled with dynamic shapes, s is symbolic, and torch 2.11's shape arithmetic cannot
    # evaluate a shift of a symbolic int (seen on an H200: the statistics fell back to eager)
    return (cell >> (s + 1)) + ((bits & (2**s - 1)) >= (cell & (2 ** (s + 1) - 1))).int()


def power_sums(xs: torch.Tensor, dim: int) -> torch.Tensor:
    """Sums of xs^k, k = 1..4, along a dim, in xs's dtype: ``(4, *reduced shape)``.

    Args:
        xs: the (shifted) values.
        dim: the dim summed."""
    x2 = xs * xs
    return torch.stack([xs.sum(dim), x2.sum(dim), (x2 * xs).sum(dim), (x2 * x2).sum(dim)])


def working(x: torch.Tensor) -> torch.Tensor:
    """The dtype the statistics work in: float32 for half types (sums in float32), float64 stays float64.

    Args:
        x: the tensor."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def map_pass(x: torch.Tensor, valid: torch.Tensor, shift: torch.Tensor, table: torch.Tensor, s: int, n: int):
    """One pass over a map: its rows' maxima, every entry's bin and the rows' power sums.

    Args:
        x: the map ``(B, H, T, S)``.
        valid: bool ``(B, 1|H, T, S)``.
        shift: per head ``(H,)``: the power sums are of ``x - shift``.
        table: ``bin_table``'s table.
        s: its shift.
        n: the number of bins.

    Returns:
        ``rowmax (B, H, T)``: max |x| over a row's valid entries (-1 if none); ``idx (B, H, T, S)`` int32: the bin of
        |x| plus h (n + 3) for head h, h (n + 3) + n + 2 where invalid (one bincount for every head); ``sums (4, B, H,
        T)``: sums over a row's valid entries of (x - shift)^k."""
    xw = working(x)
    H = x.shape[1]
    a = xw.abs()
    rowmax = torch.where(valid, a, -1.0).amax(-1)  # (B, H, T)
    head = (torch.arange(H, device=x.device) * (n + 3)).view(1, H, 1, 1)  # (1, H, 1, 1)
    idx = torch.where(valid, bin_index(a, table, s), n + 2) + head  # (B, H, T, S)
    xs = torch.where(valid, xw - shift.view(1, H, 1, 1), 0.0)  # (B, H, T, S)
    return rowmax, idx.int(), power_sums(xs, -1)


def token_pass(x: torch.Tensor, valid: torch.Tensor, shift: torch.Tensor, table: torch.Tensor, s: int, n: int,
               big: float, huge: float, per_channel: bool):
    """One pass over a token tensor: token maxima, per-channel counts and maxima, every entry's bin and the power sums.

    Args:
        x: the tensor ``(B, T, C)``.
        valid: bool ``(B, T, 1)``.
        shift: ``(C,)`` per channel, or ``(1,)``.
        table: ``bin_table``'s table.
        s: its shift.
        n: the number of bins.
        big: LLM.int8's threshold (``n_big`` counts |x| >= big).
        huge: the massive threshold (``n_huge`` counts |x| > huge).
        per_channel: the power sums per channel; else per token.

    Returns:
        ``rowmax (B, T)`` (-1 on padding); per sequence and channel ``(B, C)``: ``chmax``, ``n_big``, ``n_huge``,
        ``sumabs``; ``idx (B, T, C)`` int32 (n + 2 on padding); ``sums``: ``(4, B, C)`` or ``(4, B, T)``."""
    xw = working(x)
    a = xw.abs()
    am = torch.where(valid, a, -1.0)  # (B, T, C)
    idx = torch.where(valid, bin_index(a, table, s), n + 2)  # (B, T, C)
    xs = torch.where(valid, xw - shift, 0.0)  # (B, T, C)
    return (am.amax(-1), am.amax(1), (am >= big).sum(1), (am > huge).sum(1), torch.where(valid, a, 0.0).sum(1),
            idx.int(), power_sums(xs, 1 if per_channel else -1))


class _Compiled:
    """``fn`` compiled on first call (dynamic shapes); if compiling fails (no C++ compiler, no Triton), one
    warning and ``fn`` as it is from then on."""

    def __init__(self, fn):
        self.fn, self.compiled, self.failed = fn, torch.compile(fn, dynamic=True), False

    def __call__(self, *args):
        if not self.failed:
            try:
                return self.compiled(*args)
            except Exception as e:  # a backend failure: the eager function gives the same statistics
                self.failed = True
                warnings.warn(f"outlierscope: statistics run uncompiled ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                              "pass compile=False to skip compiling", RuntimeWarning, stacklevel=2)
        return self.fn(*args)


_compiled: dict = {}


def kernel(fn, compiled: bool):
    """One of this module's passes, compiled or as it is.

    Args:
        fn: the pass.
        compiled: compile it (``torch.compile``, once per pass)."""
    if not compiled:
        return fn
    if fn not in _compiled:
        _compiled[fn] = _Compiled(fn)
    return _compiled[fn]
