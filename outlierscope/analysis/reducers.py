"""Streaming primitives: exact top-k with locations, log-spaced histograms, float64 moments.

Each keeps memory independent of the number of values seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


class TopK:
    """Exact running top-k of values, each with an integer location row (e.g. layer, head, seq, query, key)."""

    def __init__(self, k: int, n_loc: int):
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        self.k = k
        self.values = torch.empty(0, dtype=torch.float64)
        self.locs = torch.empty(0, n_loc, dtype=torch.int64)

    def update(self, values: torch.Tensor, locs: torch.Tensor) -> None:
        """Merge candidate ``values`` (N,) with their locations (N, n_loc)."""
        v = torch.cat([self.values, values.double().cpu()])
        loc = torch.cat([self.locs, locs.cpu()])
        # larger value first, then smaller location: deterministic under ties
        order = np.lexsort([*(loc.numpy().T[::-1]), -v.numpy()])[: self.k]
        v, loc = v[order], loc[order]
        self.values, self.locs = v, loc

    def update_dense(self, absx: torch.Tensor, valid: torch.Tensor, coord_fn) -> None:
        """Candidates from a dense tensor: the top-k valid entries of ``absx``; ``coord_fn(idx)`` maps
        their multi-indices (N, ndim) to location rows."""
        flat = absx.masked_fill(~valid, -1.0).reshape(-1)
        n = min(self.k, flat.numel())
        if n == 0:
            return
        vals, idx = torch.topk(flat, n, sorted=False)
        keep = vals >= 0
        vals, idx = vals[keep], idx[keep]
        if not len(vals):
            return
        multi = torch.stack(torch.unravel_index(idx, absx.shape), dim=1)  # (N, ndim)
        self.update(vals, coord_fn(multi))

    def merged(self, other: TopK) -> TopK:
        out = TopK(max(self.k, other.k), self.locs.shape[1])
        out.update(torch.cat([self.values, other.values]), torch.cat([self.locs, other.locs]))
        return out

    def kth(self, k: int) -> float:
        """The k-th largest value (1-based), NaN if fewer than k values were seen."""
        return float(self.values[k - 1]) if len(self.values) >= k else math.nan


@dataclass(frozen=True)
class LogBins:
    """Log-spaced bins of |x|: bin 0 holds |x| < lo (zeros too), bins 1..n hold [lo r^(i-1), lo r^i),
    bin n+1 holds |x| >= hi. The median estimate is a bin's geometric centre, so its relative error is
    at most sqrt(r) - 1 (0.4988% for r = 1.01) for values in [lo, hi)."""

    lo: float = 1e-8
    hi: float = 1e8
    ratio: float = 1.01

    @property
    def n(self) -> int:
        return math.ceil(math.log(self.hi / self.lo) / math.log(self.ratio))

    @property
    def rel_error_bound(self) -> float:
        return math.sqrt(self.ratio) - 1

    def index(self, absx: torch.Tensor) -> torch.Tensor:
        a = absx.float()
        idx = torch.floor(torch.log(a.clamp_min(self.lo) / self.lo) / math.log(self.ratio)).long() + 1
        idx = idx.clamp(1, self.n + 1)
        return torch.where(a < self.lo, torch.zeros_like(idx), idx)

    def edges(self) -> np.ndarray:
        """Lower edges of bins 0..n+1 (bin 0 starts at 0)."""
        return np.concatenate([[0.0], self.lo * self.ratio ** np.arange(self.n + 1)])

    def centre(self, i: int) -> float:
        if i == 0:
            return 0.0
        if i == self.n + 1:
            return self.hi
        return self.lo * self.ratio ** (i - 0.5)

    def quantile(self, counts: np.ndarray, q: float) -> float:
        """Estimate of the lower q-quantile (the value of rank ceil(q n)) from bin counts."""
        total = counts.sum()
        if total == 0:
            return math.nan
        rank = max(1, math.ceil(q * total))
        i = int(np.searchsorted(np.cumsum(counts), rank))
        return self.centre(i)


class Moments:
    """Float64 power sums of x over a reduction, kept per group (e.g. per layer and head)."""

    def __init__(self, shape: tuple[int, ...]):
        self.count = torch.zeros(shape, dtype=torch.float64)
        self.sums = torch.zeros((4, *shape), dtype=torch.float64)
        self.maxabs = torch.zeros(shape, dtype=torch.float64)

    def update(self, x: torch.Tensor, valid: torch.Tensor, dims: tuple[int, ...], row: int) -> None:
        """Add the valid entries of ``x``, reduced over ``dims``, into row ``row`` (e.g. the layer)."""
        xd = torch.where(valid, x.double(), 0.0)
        self.count[row] += valid.expand_as(x).sum(dims).double()
        p = xd
        for i in range(4):
            self.sums[i, row] += p.sum(dims)
            if i < 3:
                p = p * xd
        self.maxabs[row] = torch.maximum(self.maxabs[row], xd.abs().amax(dims))

    @staticmethod
    def describe(count, s1, s2, s3, s4) -> dict:
        """mean, std (population), Pearson kurtosis m4/m2^2 (3 for a Gaussian) from power sums."""
        count = np.asarray(count, dtype=np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = s1 / count
            m2 = s2 / count - mean**2
            m4 = s4 / count - 4 * mean * s3 / count + 6 * mean**2 * s2 / count - 3 * mean**4
            std = np.sqrt(np.maximum(m2, 0))
            kurt = m4 / m2**2
        return {"mean": mean, "std": std, "kurtosis": kurt}
