"""Streaming reducers against exact numpy computations on data that fits in memory."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from outlierscope.analysis.outliers import OutlierStats
from outlierscope.analysis.reducers import LogBins, Moments, TopK
from outlierscope.hooks.capture import Observation
from outlierscope.hooks.points import Point


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chunks", [1, 7])
def test_topk_exact_values_and_locations(seed, chunks):
    rng = np.random.default_rng(seed)
    x = rng.standard_cauchy((6, 50)).astype(np.float32)
    valid = rng.random((6, 50)) > 0.3
    tk = TopK(20, 2)
    for part in np.array_split(np.arange(6), chunks):
        if len(part) == 0:
            continue
        lo = part[0]
        tk.update_dense(torch.from_numpy(np.abs(x[part])), torch.from_numpy(valid[part]),
                        lambda m, lo=lo: torch.stack([m[:, 0] + lo, m[:, 1]], 1))
    flat = [(abs(float(x[i, j])), i, j) for i in range(6) for j in range(50) if valid[i, j]]
    flat.sort(key=lambda t: (-t[0], t[1], t[2]))
    exp = flat[:20]
    np.testing.assert_array_equal(tk.values.numpy(), np.array([e[0] for e in exp]))
    np.testing.assert_array_equal(tk.locs.numpy(), np.array([[e[1], e[2]] for e in exp]))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(-6, 6))
def test_median_within_bound(seed, log_scale):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    x = (rng.lognormal(0, 2, n) * 10**log_scale).astype(np.float32)
    bins = LogBins()
    counts = torch.bincount(bins.index(torch.from_numpy(x)), minlength=bins.n + 2).numpy()
    exact = np.quantile(x.astype(np.float64), 0.5, method="inverted_cdf")  # the lower median
    est = bins.quantile(counts, 0.5)
    assert abs(est - exact) / exact <= bins.rel_error_bound + 1e-6
    assert bins.rel_error_bound <= 0.005


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-6)])
def test_moments(dtype, rtol):
    """float64 input: exact float64 sums; float32 input: float32 row sums accumulated in float64."""
    rng = np.random.default_rng(0)
    x = rng.standard_t(3, (4, 3, 10)).astype(dtype)
    valid = rng.random((4, 3, 10)) > 0.2
    m = Moments((2, 3))
    m.update(torch.from_numpy(x), torch.from_numpy(valid), (0, 2), row=1)
    for h in range(3):
        v = x[:, h][valid[:, h]].astype(np.float64)
        d = Moments.describe(m.count[1, h].item(), *(m.sums[i, 1, h].item() for i in range(4)), shift=m.shift[1, h].item())
        assert m.count[1, h] == len(v)
        np.testing.assert_allclose(d["mean"], v.mean(), rtol=rtol)
        np.testing.assert_allclose(d["std"], v.std(), rtol=rtol)
        np.testing.assert_allclose(d["kurtosis"], ((v - v.mean()) ** 4).mean() / v.var() ** 2, rtol=rtol * 10)
        assert m.maxabs[1, h] == np.abs(v).max()
    assert m.count[0].sum() == 0


def test_moments_do_not_drift_over_many_batches():
    """A million float32 values with a large offset, streamed in 400 batches."""
    rng = np.random.default_rng(1)
    m = Moments((1, 1))
    allv = []
    for _ in range(400):
        x = (1000 + rng.standard_normal((10, 1, 250))).astype(np.float32)
        m.update(torch.from_numpy(x), torch.ones(10, 1, 250, dtype=torch.bool), (0, 2), row=0)
        allv.append(x.ravel().astype(np.float64))
    v = np.concatenate(allv)
    d = Moments.describe(m.count[0, 0].item(), *(m.sums[i, 0, 0].item() for i in range(4)), shift=m.shift[0, 0].item())
    np.testing.assert_allclose(d["mean"], v.mean(), rtol=1e-9)
    np.testing.assert_allclose(d["std"], v.std(), rtol=1e-6)  # centred sums: no cancellation at offset 1000
    np.testing.assert_allclose(d["kurtosis"], ((v - v.mean()) ** 4).mean() / v.var() ** 2, rtol=1e-5)


def _logit_obs(x, valid, layer=0, off=0):
    return Observation(Point(f"layers.{layer}.attn.logits", layer, "attn.logits"), x, valid, off, x.shape[1], False)


def test_pooled_per_layer_moments():
    rng = np.random.default_rng(2)
    stats = OutlierStats(1, 3, hidden_size=5, seq_len=6)
    xs = []
    for b in range(3):
        x = (rng.standard_normal((2, 6, 5)) * 3 + np.array([0, 50, -20, 1, 0])).astype(np.float32)
        stats(Observation(Point("layers.0.hidden", 0, "hidden"), torch.from_numpy(x), torch.ones(2, 6, dtype=torch.bool), 2 * b))
        xs.append(x.reshape(-1, 5))
    v = np.concatenate(xs).ravel().astype(np.float64)
    row = stats.per_layer().iloc[0]
    assert row["count"] == v.size
    np.testing.assert_allclose([row["mean"], row["std"]], [v.mean(), v.std()], rtol=1e-6)
    np.testing.assert_allclose(row["kurtosis"], ((v - v.mean()) ** 4).mean() / v.var() ** 2, rtol=1e-5)
    ch = stats.per_channel()
    np.testing.assert_allclose(ch["mean"], np.concatenate(xs).mean(0), rtol=1e-6, atol=1e-6)


def test_outlier_stats_table5_against_numpy():
    rng = np.random.default_rng(3)
    L, H, T = 2, 3, 6
    stats = OutlierStats(L, H, hidden_size=4, seq_len=T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    every = []
    for layer in range(L):
        for b in range(3):
            x = torch.from_numpy(rng.standard_cauchy((2, H, T, T)).astype(np.float32))
            stats(_logit_obs(x, causal, layer, off=2 * b))
            every.append(x.abs()[causal.expand_as(x)].numpy())
    allv = np.sort(np.concatenate(every))[::-1]
    t5 = stats.table5().iloc[0]
    for k in (1, 2, 3, 10, 100):
        assert t5[f"top{k}"] == pytest.approx(float(allv[k - 1]), rel=0, abs=0)
    exact_med = np.quantile(allv.astype(np.float64), 0.5, method="inverted_cdf")
    assert abs(t5["median"] - exact_med) / exact_med <= stats.bins.rel_error_bound + 1e-6
    assert t5["count"] == len(allv)


def test_hidden_outlier_features_and_massive():
    L, T, C = 4, 10, 8
    stats = OutlierStats(L, 2, hidden_size=C, seq_len=T)
    for layer in range(L):
        x = torch.full((2, T, C), 0.01)
        if layer < 2:
            x[:, :, 5] = 7.0  # channel 5: |x| >= 6 on every token in 2 of 4 layers
        x[0, 3, 2] = 500.0 if layer == 1 else 0.01  # one massive activation
        valid = torch.ones(2, T, dtype=torch.bool)
        stats(Observation(Point(f"layers.{layer}.hidden", layer, "hidden"), x, valid, 0))
    of = stats.outlier_features()
    assert of["channel"].tolist() == [5] and of.iloc[0]["layers"] == [0, 1]
    ma = stats.massive_activations()
    assert len(ma) == 1 and ma.iloc[0][["layer", "channel", "seq", "token"]].tolist() == [1, 2, 0, 3]


def test_padding_and_batch_size_independence():
    """Per-sequence statistics of a real capture do not depend on batch size or padding side."""
    from outlierscope.hooks.capture import capture
    from outlierscope.models.presets import PairConfig

    model = PairConfig.from_name("pair-test").build("diff", seed=0).eval()
    model.set_attn_implementation("eager")
    torch.manual_seed(0)
    seqs = [torch.randint(1, 512, (n,)) for n in (12, 7, 10, 5)]

    def run(batch_size, side):
        stats = OutlierStats.for_model(model, seq_len=12)
        with torch.no_grad(), capture(model, reducers=stats):
            for i in range(0, len(seqs), batch_size):
                group = seqs[i : i + batch_size]
                T = max(len(s) for s in group)
                ids = torch.zeros(len(group), T, dtype=torch.long)
                mask = torch.zeros(len(group), T, dtype=torch.long)
                for j, s in enumerate(group):
                    sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
                    ids[j, sl], mask[j, sl] = s, 1
                pos = (mask.cumsum(-1) - 1).clamp_min(0)
                model(input_ids=ids, attention_mask=mask, position_ids=pos)
        return stats

    a, b, c = run(1, "right"), run(4, "right"), run(3, "left")
    for other in (b, c):
        for kind in ("attn.logits", "hidden"):
            assert torch.equal(a.hist[kind], other.hist[kind])
            torch.testing.assert_close(a.top[kind].values, other.top[kind].values, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a.moments[kind].count, other.moments[kind].count)
        for table in ("per_head", "per_channel", "per_layer"):
            x, y = getattr(a, table)(), getattr(other, table)()
            cols = ["count", "mean", "std", "kurtosis", "max", "median"]
            cols = [c for c in cols if c in x]
            np.testing.assert_allclose(x[cols].to_numpy(float), y[cols].to_numpy(float), rtol=1e-4, atol=1e-6)


# -- exact merges: a stream split at random points and merged in order equals the whole stream ----------


def _chunks(n, cuts):
    points = sorted({c % (n + 1) for c in cuts} | {0, n})
    return list(zip(points[:-1], points[1:]))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), cuts=st.lists(st.integers(0, 200), max_size=5))
def test_topk_merge_equals_single_stream(seed, cuts):
    rng = np.random.default_rng(seed)
    vals = torch.tensor(np.round(rng.standard_cauchy(120), 1))  # rounded: many ties, broken by location
    locs = torch.tensor(rng.integers(0, 50, (120, 3)))
    whole = TopK(10, 3)
    whole.update(vals, locs)
    merged = TopK(10, 3)
    for a, b in _chunks(len(vals), cuts):
        part = TopK(10, 3)
        part.update(vals[a:b], locs[a:b])
        merged.merge(part)
    assert torch.equal(merged.values, whole.values) and torch.equal(merged.locs, whole.locs)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), cuts=st.lists(st.integers(0, 40), max_size=4), offset=st.floats(-1e4, 1e4))
def test_moments_merge_equals_single_stream(seed, cuts, offset):
    rng = np.random.default_rng(seed)
    x = torch.tensor(rng.standard_normal((40, 3, 16)) * 3 + offset)  # (N, groups, values) float64
    valid = torch.tensor(rng.random((40, 3, 16)) > 0.2)
    whole = Moments((1, 3))
    whole.update(x, valid, (0, 2), 0)
    merged = Moments((1, 3))
    for a, b in _chunks(len(x), cuts):
        part = Moments((1, 3))
        part.update(x[a:b], valid[a:b], (0, 2), 0)
        merged.merge(part)
    assert torch.equal(merged.count, whole.count) and torch.equal(merged.maxabs, whole.maxabs)
    got, ref = merged.summary(), whole.summary()
    for k in ("mean", "std", "kurtosis"):
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-9, atol=1e-9 * (1 + abs(offset)))
    xs = x.masked_fill(~valid, float("nan")).transpose(0, 1).reshape(3, -1).numpy()  # independent numpy reference
    np.testing.assert_allclose(got["mean"][0], np.nanmean(xs, 1), rtol=1e-9, atol=1e-9 * (1 + abs(offset)))
    np.testing.assert_allclose(got["std"][0], np.nanstd(xs, 1), rtol=1e-7)


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_outlierstats_merge_equals_single_stream(cut):
    """A real capture of 4 batches, split after batch ``cut``: merged shards equal one stream (same locations,
    as each shard counts sequences from its own offset)."""
    from outlierscope.hooks.capture import capture
    from outlierscope.models.presets import PairConfig

    model = PairConfig.from_name("pair-test").build("diff", seed=0).eval()
    torch.manual_seed(0)
    batches = [torch.randint(1, 512, (2, 12)) for _ in range(4)]

    def run(parts):
        stats = OutlierStats.for_model(model, seq_len=12)
        with torch.no_grad(), capture(model, reducers=stats) as cap:
            cap.sequences = 2 * parts[0]  # the shard's first global sequence
            for ids in batches[parts[0] : parts[1]]:
                model(input_ids=ids)
        return stats

    whole = run((0, 4))
    merged = run((0, cut)).merge(run((cut, 4)))
    for kind in ("attn.logits", "hidden"):
        assert torch.equal(merged.hist[kind], whole.hist[kind])
        assert torch.equal(merged.top[kind].values, whole.top[kind].values)
        assert torch.equal(merged.top[kind].locs, whole.top[kind].locs)
        torch.testing.assert_close(merged.moments[kind].sums, whole.moments[kind].sums, rtol=1e-9, atol=1e-6)
    assert torch.equal(merged.ge6, whole.ge6)
    pd_ = __import__("pandas")
    pd_.testing.assert_frame_equal(merged.table5(), whole.table5())
    with pytest.raises(ValueError, match="cannot merge"):
        whole.logits.merge(OutlierStats(2, 8, 64, 12).logits)
