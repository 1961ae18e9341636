"""Streaming primitives: exact top-k with locations, log-spaced histograms, moments.

Each keeps memory independent of the number of values seen. The per-element work that feeds them in a profile is
done in one pass per observed tensor by ``outlierscope.analysis.kernels`` (its docstring has the table of what
each pass computes per element, and the error bound of the float32 row sums that the moments add in float64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from outlierscope.analysis.kernels import bin_index, bin_table, power_sums


def dense_candidates(absm: torch.Tensor, k: int, coord_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of a tensor with their locations; ties go to the first in flat (row-major) order.

    Args:
        absm: |x|, with invalid entries set to -1.
        k: how many.
        coord_fn: maps the entries' multi-indices ``(N, ndim)`` to location rows.

    Returns:
        ``(values (N,), locations (N, n_loc))``, N <= k."""
    S = absm.shape[-1]
    flat_rows = absm.reshape(-1, S)  # (R, S)
    return row_candidates(flat_rows.amax(-1), lambda rows: flat_rows[rows], absm.shape, k, coord_fn)


def row_candidates(rowmax: torch.Tensor, row_values, shape: tuple[int, ...], k: int,
                   coord_fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``dense_candidates`` of a tensor given its row maxima and a way to read rows, in two exact stages.

    The k largest entries lie in the rows whose maximum is at least the k-th largest row maximum, so those rows are
    kept (in order) and the entries picked inside them: every entry above the k-th largest value, then the entries
    equal to it in flat order.

    Args:
        rowmax: the maximum of each row (last dim), shaped ``shape[:-1]``.
        row_values: ``row_values(rows)``: the |x| (-1 where invalid) of the flat rows ``rows (R,)`` as ``(R, S)``.
        shape: the tensor's shape.
        k: how many.
        coord_fn: maps multi-indices ``(N, ndim)`` to location rows."""
    S = shape[-1]
    rowmax = rowmax.reshape(-1)  # (R,)
    kr = min(k, rowmax.numel())
    thr = torch.topk(rowmax, kr, sorted=False).values.min()
    rows = torch.nonzero(rowmax >= thr).view(-1)  # ascending
    cand = row_values(rows).reshape(-1)  # (rows*S,), still in flat order
    kk = min(k, cand.numel())
    vk = torch.topk(cand, kk, sorted=False).values.min()
    above = torch.nonzero(cand > vk).view(-1)
    ties = torch.nonzero(cand == vk).view(-1)[: kk - above.numel()]
    cols = torch.cat([above, ties])
    vals = cand[cols]
    keep = vals >= 0
    vals, cols = vals[keep], cols[keep]
    flat_idx = rows[cols // S] * S + cols % S
    multi = torch.stack(torch.unravel_index(flat_idx, shape), dim=1)  # (N, ndim)
    return vals, coord_fn(multi)


class TopK:
    """Exact running top-k of values, each with an integer location row (layer, head, seq, query, key ...).

    Ties are broken by location, compared field by field in the order ``tie``. Give the order in which
    ``dense_candidates`` meets the entries of one observation (its flat order) after the fields that differ between
    observations, and any split of a stream merges exactly.

    Args:
        k: how many values to keep.
        n_loc: the fields of a location row.
        tie: the order in which location fields break ties; None: as stored."""

    def __init__(self, k: int, n_loc: int, tie: tuple[int, ...] | None = None):
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        self.tie = tuple(range(n_loc)) if tie is None else tuple(tie)
        if sorted(self.tie) != list(range(n_loc)):
            raise ValueError(f"tie must order the {n_loc} location fields, got {tie}")
        self.k = k
        self.values = torch.empty(0, dtype=torch.float64)
        self.locs = torch.empty(0, n_loc, dtype=torch.int64)

    def update(self, values: torch.Tensor, locs: torch.Tensor) -> None:
        """Merge candidate values with their locations.

        Args:
            values: ``(N,)``.
            locs: ``(N, n_loc)``."""
        v = torch.cat([self.values, values.double().cpu()])
        loc = torch.cat([self.locs, locs.cpu()])
        # larger value first, then smaller location (fields in tie order): deterministic under ties
        fields = loc.numpy().T
        order = np.lexsort([*(fields[i] for i in reversed(self.tie)), -v.numpy()])[: self.k]
        v, loc = v[order], loc[order]
        self.values, self.locs = v, loc

    def update_dense(self, absx: torch.Tensor, valid: torch.Tensor, coord_fn) -> None:
        """Merge the top-k valid entries of a dense tensor.

        Args:
            absx: |x|.
            valid: bool, broadcastable to ``absx``.
            coord_fn: maps the entries' multi-indices ``(N, ndim)`` to location rows."""
        self.update(*dense_candidates(absx.masked_fill(~valid, -1.0), self.k, coord_fn))

    def merge(self, other: TopK) -> None:
        """Add another stream's values: the top-k of both, ties broken by location (exact).

        Args:
            other: a top-k with the same location fields."""
        if other.locs.shape[1] != self.locs.shape[1]:
            raise ValueError(f"cannot merge a top-k with {other.locs.shape[1]} location fields into one with {self.locs.shape[1]}")
        self.update(other.values, other.locs)

    def kth(self, k: int) -> float:
        """The k-th largest value; NaN if fewer than k values were seen.

        Args:
            k: 1-based rank."""
        return float(self.values[k - 1]) if len(self.values) >= k else math.nan


@dataclass(frozen=True)
class LogBins:
    """Log-spaced bins of |x|, compared in float32; the median's relative error is at most ``sqrt(ratio) - 1``.

    Bin 0 holds |x| < lo (zeros too), bins 1..n hold [lo r^(i-1), lo r^i), bin n+1 holds |x| >= lo r^n (>= hi); the
    edges are lo r^i rounded to float32. A quantile is its bin's geometric centre: within 0.4988% for r = 1.01, for
    values in [lo, hi).

    Attributes:
        lo: the first edge.
        hi: the last edge (at most).
        ratio: the ratio r of consecutive edges."""

    lo: float = 1e-8
    hi: float = 1e8
    ratio: float = 1.01

    def __post_init__(self):
        self.table()  # a ratio the bin table cannot serve fails here, before any data

    @property
    def n(self) -> int:
        return math.ceil(math.log(self.hi / self.lo) / math.log(self.ratio))

    @property
    def rel_error_bound(self) -> float:
        return math.sqrt(self.ratio) - 1

    def table(self, device="cpu") -> tuple[torch.Tensor, int]:
        """The lookup table of ``index`` and its shift (``bin_table``).

        Args:
            device: where the table lives."""
        return bin_table(self.lo, self.ratio, self.n, str(device))

    def index(self, absx: torch.Tensor) -> torch.Tensor:
        """The bin of each |x|: the number of float32 edges ``lo r^j`` at or below float32(|x|), exact on any device.

        Args:
            absx: |x|.

        Returns:
            int32, the shape of ``absx``."""
        return bin_index(absx, *self.table(absx.device))

    def edges(self) -> np.ndarray:
        """Lower edges of bins 0..n+1 (bin 0 starts at 0)."""
        return np.concatenate([[0.0], self.lo * self.ratio ** np.arange(self.n + 1)])

    def centre(self, i: int) -> float:
        """A bin's geometric centre (0 for bin 0, ``hi`` for the last).

        Args:
            i: the bin."""
        if i == 0:
            return 0.0
        if i == self.n + 1:
            return self.hi
        return self.lo * self.ratio ** (i - 0.5)

    def quantile(self, counts: np.ndarray, q: float) -> float:
        """An estimate of the lower q-quantile (the value of rank ceil(q n)) from bin counts.

        Args:
            counts: the count of each bin.
            q: the quantile, in (0, 1].

        Returns:
            The bin's centre; NaN when nothing was counted."""
        total = counts.sum()
        if total == 0:
            return math.nan
        rank = max(1, math.ceil(q * total))
        i = int(np.searchsorted(np.cumsum(counts), rank))
        return self.centre(i)


def _float_sums(t: torch.Tensor, dim: int, rest: tuple[int, ...]) -> torch.Tensor:
    """``t`` summed along ``dim`` in its own dtype (float32: rows of at most a few thousand entries), then over
    ``rest`` (dims before ``dim``) in float64 on the host."""
    rows = t.sum(dim).cpu().double()
    return rows.sum(rest) if rest else rows


def masked_mean(x: torch.Tensor, valid: torch.Tensor, dim: int, rest: tuple[int, ...], n: torch.Tensor) -> torch.Tensor:
    """The mean of the valid entries of ``x`` per group, rounded to x's dtype (a shift exact there), as float64.

    Args:
        x: the tensor.
        valid: bool, broadcastable to ``x``.
        dim: the dim summed in x's dtype.
        rest: further dims (before ``dim``) summed in float64.
        n: the valid entries per group."""
    return (_float_sums(torch.where(valid, x, 0.0), dim, rest).reshape(n.shape) / n.clamp_min(1)).to(x.dtype).double()


class Moments:
    """Moments of x per group (per layer and head, say), streamed: count, shifted power sums, max |x|.

    The power sums are of ``x - shift``, ``shift`` being each group's mean in its first batch with valid entries:
    centred, the sums do not cancel catastrophically for a group with a large mean. Powers are summed along one row
    in float32 and the row sums added in float64 on the host; float64 input stays float64 throughout.

    Args:
        shape: the groups' shape."""

    def __init__(self, shape: tuple[int, ...]):
        self.count = torch.zeros(shape, dtype=torch.float64)
        self.shift = torch.zeros(shape, dtype=torch.float64)
        self.sums = torch.zeros((4, *shape), dtype=torch.float64)
        self.maxabs = torch.zeros(shape, dtype=torch.float64)

    def centre(self, row: int, n: torch.Tensor, mean_fn) -> torch.Tensor:
        """The shifts (float64) of a row's groups; a group seen for the first time is centred on this batch's mean.

        Args:
            row: the row (the layer, say).
            n: the batch's valid entries per group.
            mean_fn: returns the batch's mean per group (a value of x's dtype); called only for new groups."""
        new = (self.count[row] == 0) & (n > 0)
        if new.any():
            self.shift[row] = torch.where(new, mean_fn(), self.shift[row])
        return self.shift[row]

    def add(self, row: int, n: torch.Tensor, sums: torch.Tensor, maxabs: torch.Tensor) -> None:
        """Add a batch of a row's sums.

        Args:
            row: the row.
            n: the valid entries per group.
            sums: ``(4, groups)`` float64 sums of ``(x - shift)^k`` about ``centre``'s shifts.
            maxabs: max |x| per group."""
        self.count[row] += n
        self.sums[:, row] += sums
        self.maxabs[row] = torch.maximum(self.maxabs[row], maxabs.double().cpu())

    def update(self, x: torch.Tensor, valid: torch.Tensor, dims: tuple[int, ...], row: int,
               maxabs: torch.Tensor | None = None) -> None:
        """Add the valid entries of ``x``, reduced over ``dims``, into a row.

        Args:
            x: the tensor.
            valid: bool, broadcastable to ``x`` (a compact mask is cheaper than an expanded one).
            dims: the dims reduced; the last of them is summed in float32.
            row: the row (the layer, say).
            maxabs: the reduced max |x|, when the caller has it."""
        last = max(dims)  # summed in float32
        rest = tuple(d for d in dims if d != last)
        xw = x if x.dtype in (torch.float32, torch.float64) else x.float()
        gshape = [1 if d in dims else x.shape[d] for d in range(x.dim())]  # x's shape, 1 on reduced dims
        n = valid.sum(dims).double().cpu().expand_as(self.count[row])  # broadcasts over the kept dims

        shift = self.centre(row, n, lambda: masked_mean(xw, valid, last, rest, n))
        xs = (xw - shift.to(xw.device, xw.dtype).view(gshape)).masked_fill_(~valid, 0.0)
        rows = power_sums(xs, last).cpu().double()  # (4, x's shape without ``last``): float32 row sums
        sums = (rows.sum(tuple(d + 1 for d in rest)) if rest else rows).reshape(4, *n.shape)  # (4, groups)
        m = maxabs if maxabs is not None else xw.abs().masked_fill_(~valid, 0.0).amax(dims)
        self.add(row, n, sums, m)

    def merge(self, other: Moments) -> None:
        """Add another's data of the same groups, re-centred on this shift by the binomial expansion (float64 rounding).

        Groups new here take the other's shift and sums as they are.

        Args:
            other: moments of the same shape."""
        if other.count.shape != self.count.shape:
            raise ValueError(f"cannot merge moments of shape {tuple(other.count.shape)} into {tuple(self.count.shape)}")
        fresh = self.count == 0
        d = torch.where(fresh, torch.zeros_like(self.shift), other.shift - self.shift)  # y = x - c_self = (x - c_other) + d
        s1, s2, s3, s4 = other.sums
        n = other.count
        moved = torch.stack([
            s1 + n * d,
            s2 + 2 * d * s1 + n * d**2,
            s3 + 3 * d * s2 + 3 * d**2 * s1 + n * d**3,
            s4 + 4 * d * s3 + 6 * d**2 * s2 + 4 * d**3 * s1 + n * d**4,
        ])
        self.shift = torch.where(fresh, other.shift, self.shift)
        self.sums += moved
        self.count += other.count
        self.maxabs = torch.maximum(self.maxabs, other.maxabs)

    def summary(self) -> dict:
        """``describe`` of every group: arrays shaped like ``count``."""
        return self.describe(self.count.numpy(), *self.sums.numpy(), shift=self.shift.numpy())

    @staticmethod
    def describe(count, s1, s2, s3, s4, shift=0.0) -> dict:
        """Mean, standard deviation (population) and Pearson kurtosis m4/m2^2 (3 for a Gaussian) from shifted sums.

        Args:
            count: entries per group.
            s1: sums of ``(x - shift)``.
            s2: sums of its squares.
            s3: sums of its cubes.
            s4: sums of its fourth powers.
            shift: the shift of the sums."""
        count = np.asarray(count, dtype=np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            d = s1 / count  # mean of the shifted data
            m2 = s2 / count - d**2
            m4 = s4 / count - 4 * d * s3 / count + 6 * d**2 * s2 / count - 3 * d**4
            std = np.sqrt(np.maximum(m2, 0))
            kurt = m4 / m2**2
        return {"mean": np.asarray(shift) + d, "std": std, "kurtosis": kurt}


class Exceedances:
    """Every value above a threshold with its location, kept exactly up to a cap: the same for any split of the stream.

    Beyond the cap the ``cap`` largest are kept (ties broken by location) and ``total`` says how many there were.
    Candidates are buffered and pruned to the cap only when the buffer outgrows it.

    Args:
        threshold: the value to exceed.
        cap: the most values kept.
        n_loc: the fields of a location row."""

    def __init__(self, threshold: float, cap: int, n_loc: int):
        self.threshold, self.cap = threshold, cap
        self.top = TopK(cap, n_loc)
        self.total = 0
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._n_pending = 0

    def update(self, values: torch.Tensor, locs: torch.Tensor) -> None:
        """Add candidates, already above the threshold.

        Args:
            values: ``(N,)``.
            locs: ``(N, n_loc)``."""
        if values.numel() == 0:
            return
        self.total += values.numel()
        self._pending.append((values.double().cpu(), locs.cpu()))
        self._n_pending += values.numel()
        if self._n_pending > self.cap:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self.top.update(torch.cat([v for v, _ in self._pending]), torch.cat([loc for _, loc in self._pending]))
            self._pending, self._n_pending = [], 0

    def merge(self, other: Exceedances) -> None:
        """Add another stream's exceedances (exact).

        Args:
            other: exceedances with the same cap and location fields."""
        other.flush()
        self.flush()
        self.top.merge(other.top)
        self.total += other.total

    @property
    def overflowed(self) -> bool:
        return self.total > self.cap

    def __getstate__(self):
        self.flush()
        return self.__dict__
