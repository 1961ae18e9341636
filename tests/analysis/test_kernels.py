"""The reducers' one-pass kernels against float64 numpy: exact bins, counts and maxima; power sums within the bound
written in outlierscope/analysis/kernels.py, on adversarial data (large offsets, heavy tails); compiled and eager."""

import math

import numpy as np
import pytest
import torch

from outlierscope.analysis.kernels import kernel, map_pass, token_pass
from outlierscope.analysis.reducers import LogBins, Moments

U = 2.0**-24  # float32 unit roundoff


def edges_f32(lo, ratio, n):
    """The bin edges as the docstring states them: lo r^j in float64, rounded to float32."""
    return np.array([lo * ratio**j for j in range(n + 1)], dtype=np.float64).astype(np.float32)


def nasty_values(edges, rng):
    """Edges, their float32 neighbours on both sides, zeros, denormals, inf, and log-uniform values over 1e-45..3e38."""
    e = edges.astype(np.float32)
    return np.concatenate([
        e, np.nextafter(e, np.float32(0)), np.nextafter(e, np.float32(np.inf)),
        np.array([0.0, 1e-45, 1e-39, 1e-8, 3.4e38, np.inf], dtype=np.float32),
        (10.0 ** rng.uniform(-45, 38.5, 200_000)).astype(np.float32),
    ])


@pytest.mark.parametrize("lo,hi,ratio", [(1e-8, 1e8, 1.01), (1e-3, 1e3, 1.001), (1e-30, 1e30, 1.5)])
def test_bin_index_is_a_search_of_the_float32_edges(lo, hi, ratio):
    bins = LogBins(lo, hi, ratio)
    e = edges_f32(lo, ratio, bins.n)
    a = nasty_values(e, np.random.default_rng(0))
    expect = np.searchsorted(e, a, side="right")  # how many edges are <= a
    got = bins.index(torch.from_numpy(a)).numpy()
    np.testing.assert_array_equal(got, expect)
    # float64 input is binned as its float32 rounding
    a64 = a.astype(np.float64) * (1 + 1e-12)
    np.testing.assert_array_equal(bins.index(torch.from_numpy(a64)).numpy(), np.searchsorted(e, a64.astype(np.float32), side="right"))


def test_bin_table_refuses_an_impossible_ratio():
    with pytest.raises(ValueError, match="ratio"):
        LogBins(1e-3, 1e3, 1.00001)


def row_bound(y, k, m):
    """The kernels' docstring bound on one row's float32 sum of y^k: (m + k + 1) u sum |y|^k."""
    return (m + k + 1) * U * np.sum(np.abs(y) ** k, axis=-1)


def adversarial(rng, shape, offset):
    """Heavy tails (Student t, 1.5 degrees of freedom: infinite variance) on a large offset, float32."""
    return (offset + rng.standard_t(1.5, shape) * 10).astype(np.float32)


@pytest.fixture(params=[False, True], ids=["eager", "compiled"])
def compiled(request):
    return request.param


@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_map_pass_against_float64(compiled, offset):
    rng = np.random.default_rng(1)
    B, H, T, S = 2, 3, 33, 40
    x = adversarial(rng, (B, H, T, S), offset)
    valid = np.broadcast_to(np.tril(np.ones((T, S), bool), S - T)[None, None], (B, 1, T, S)).copy()
    valid[1, 0, :, 30:] = False  # padding keys in one sequence
    shift = (x.mean((0, 2, 3)) + 0.5).astype(np.float32)  # near each head's mean, not at it
    bins = LogBins()
    table, s = bins.table()
    rowmax, idx, sums = kernel(map_pass, compiled)(torch.from_numpy(x), torch.from_numpy(valid), torch.from_numpy(shift),
                                                   table, s, bins.n)
    vb = np.broadcast_to(valid, x.shape)
    np.testing.assert_array_equal(rowmax.numpy(), np.where(vb, np.abs(x), -1).max(-1))
    nb = bins.n + 2
    e = edges_f32(bins.lo, bins.ratio, bins.n)
    expect_idx = np.where(vb, np.searchsorted(e, np.abs(x), side="right"), nb) + np.arange(H)[None, :, None, None] * (nb + 1)
    np.testing.assert_array_equal(idx.numpy(), expect_idx)
    y = np.where(vb, x.astype(np.float64) - shift[None, :, None, None], 0.0)
    for k in range(1, 5):
        exact = np.sum(y**k, axis=-1)
        err = np.abs(sums[k - 1].numpy().astype(np.float64) - exact)
        assert (err <= row_bound(y, k, S)).all(), (k, float((err / row_bound(y, k, S)).max()))


@pytest.mark.parametrize("per_channel", [True, False])
def test_token_pass_against_float64(compiled, per_channel):
    rng = np.random.default_rng(2)
    B, T, C = 3, 50, 24
    x = adversarial(rng, (B, T, C), 5e3)
    x[0, 3, 7] = 250.0  # above 100 and 6
    # exactly on the boundaries, and one float32 step below / above: LLM.int8 counts |x| >= 6, massive |x| > 100
    x[0, 4, 7], x[0, 5, 7], x[1, 3, 2], x[1, 4, 2] = 6.0, -6.0, 100.0, -100.0
    x[0, 6, 7], x[1, 5, 2] = np.nextafter(np.float32(6), np.float32(0)), np.nextafter(np.float32(100), np.float32(200))
    valid = rng.random((B, T)) > 0.2
    valid[0, 3:7] = valid[1, 3:6] = True
    shift = (np.full(C, 5e3) if per_channel else np.array([5e3 + 1])).astype(np.float32)
    bins = LogBins()
    table, s = bins.table()
    out = kernel(token_pass, compiled)(torch.from_numpy(x), torch.from_numpy(valid)[:, :, None], torch.from_numpy(shift),
                                       table, s, bins.n, 6.0, 100.0, per_channel)
    rowmax, chmax, n_big, n_huge, sumabs, idx, sums = (t.numpy() for t in out)
    v3 = np.broadcast_to(valid[:, :, None], x.shape)
    a = np.abs(x)
    np.testing.assert_array_equal(rowmax, np.where(v3, a, -1).max(-1))
    np.testing.assert_array_equal(chmax, np.where(v3, a, -1).max(1))
    np.testing.assert_array_equal(n_big, (v3 & (a >= 6)).sum(1))
    np.testing.assert_array_equal(n_huge, (v3 & (a > 100)).sum(1))
    assert n_big[0, 7] >= 3 and n_huge[1, 2] == (v3[1, :, 2] & (a[1, :, 2] > 100)).sum()  # the planted boundaries count
    np.testing.assert_array_equal(idx, np.where(v3, np.searchsorted(edges_f32(bins.lo, bins.ratio, bins.n), a, side="right"), bins.n + 2))
    ab = np.where(v3, a.astype(np.float64), 0.0)
    assert (np.abs(sumabs - ab.sum(1)) <= row_bound(np.moveaxis(ab, 1, -1), 1, T)).all()
    y = np.where(v3, x.astype(np.float64) - shift, 0.0)
    rows = np.moveaxis(y, 1, -1) if per_channel else y  # the summed dim last
    m = T if per_channel else C
    for k in range(1, 5):
        err = np.abs(sums[k - 1].astype(np.float64) - np.sum(rows**k, axis=-1))
        assert (err <= row_bound(rows, k, m)).all(), k


def test_compiled_and_eager_give_the_same_counts_and_bins():
    rng = np.random.default_rng(3)
    x = torch.from_numpy(adversarial(rng, (2, 2, 17, 17), 0.0))
    valid = torch.ones(17, 17, dtype=torch.bool).tril()[None, None].expand(2, 1, 17, 17)
    args = (x, valid, torch.zeros(2), *LogBins().table(), LogBins().n)
    eager, comp = map_pass(*args), kernel(map_pass, True)(*args)
    assert torch.equal(eager[0], comp[0]) and torch.equal(eager[1], comp[1])
    torch.testing.assert_close(eager[2], comp[2], rtol=1e-5, atol=1e-3)


def test_moments_of_heavy_tails_on_an_offset_within_the_bound():
    """Streamed Moments (float32 rows, float64 across) against float64 numpy: mean, std and kurtosis of a heavy-tailed
    sample on an offset of 1e4, to the relative error the row bound allows (rows of 4,096)."""
    rng = np.random.default_rng(4)
    m = Moments((1, 1))
    parts = []
    for _ in range(30):
        x = adversarial(rng, (2, 1, 4096), 1e4)
        m.update(torch.from_numpy(x), torch.ones(2, 1, 4096, dtype=torch.bool), (0, 2), row=0)
        parts.append(x.ravel().astype(np.float64))
    v = np.concatenate(parts)
    d = Moments.describe(m.count[0, 0].item(), *(m.sums[i, 0, 0].item() for i in range(4)), shift=m.shift[0, 0].item())
    c = m.shift[0, 0].item()
    rel = (4096 + 5) * U  # the row bound, relative to sum |x - c|^k
    mu, var = v.mean(), v.var()
    assert abs(d["mean"] - mu) <= rel * np.abs(v - c).mean() + 1e-12 * abs(mu)
    assert abs(d["std"] ** 2 - var) <= 3 * rel * ((v - c) ** 2).mean()
    kurt = ((v - mu) ** 4).mean() / var**2
    assert abs(d["kurtosis"] - kurt) / kurt <= 10 * rel * ((v - c) ** 4).mean() / ((v - mu) ** 4).mean()
    assert math.isfinite(d["kurtosis"]) and kurt > 10  # the tails are heavy
