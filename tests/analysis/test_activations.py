"""Statistics of every observation point (outlierscope.analysis.activations) against a brute-force pass over the
kept tensors of a small model, SmoothQuant's act_scales against a naive re-implementation of its script, and
merges of split streams against one stream (byte-identical tables)."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from outlierscope.analysis.outliers import OutlierStats
from outlierscope.hooks.capture import capture
from tests.hooks.test_capture import make

POINTS = ["layers.*.attn.q", "layers.*.attn.k", "layers.*.attn.v", "layers.*.attn.probs", "layers.*.attn.out",
          "layers.*.mlp.down_proj.input", "layers.*.self_attn.q_proj.input", "layers.*.hidden", "lm_head.input",
          "layers.*.mlp.down_proj.output"]
DELIM = frozenset({5, 7})


def _model():
    model = make("llama")
    with torch.no_grad():  # planted outlier channels: down_proj's channel 3 output x200, q_proj's input channel 5 x50
        model.model.layers[0].mlp.down_proj.weight[3] *= 200
        model.model.layers[1].input_layernorm.weight[5] *= 50
    return model


def _batches(n=4, B=2, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 101, (B, T), generator=g) for _ in range(n)]


def _run(model, batches, first=0, points=POINTS, mask=None, **kw):
    """OutlierStats over ``batches`` (global batch numbers from ``first``), and every observation kept."""
    stats = OutlierStats.for_model(model, seq_len=9, **kw)
    kept = []
    with torch.no_grad(), capture(model, points, reducers=[stats, lambda o: kept.append(o)]) as cap:
        for b, ids in enumerate(batches, start=first):
            stats.set_shard(b % 16)
            cap.sequences = b * ids.shape[0]
            model(input_ids=ids, attention_mask=mask)
    return stats, kept


def _kept(kept, kind):
    """{layer: [(x (B, T, C) float64 numpy, valid (B, T), seq_offset, ids)]}"""
    out = {}
    for o in kept:
        if o.point.kind == kind:
            out.setdefault(o.point.layer, []).append((o.x.double().numpy(), o.valid.numpy(), o.seq_offset,
                                                       None if o.ids is None else o.ids.numpy()))
    return out


def test_channels_positions_and_int8_against_brute_force():
    model = _model()
    stats, kept = _run(model, _batches())
    ch = stats.channels()
    pos = stats.positions()
    for kind in ("attn.k", "mlp.down_proj.input", "hidden", "lm_head.input"):
        for layer, obs in _kept(kept, kind).items():
            rows = ch[(ch.point == kind) & (ch.layer == layer)].sort_values("channel")
            vals = [(abs(x[b, t, c]), s + b, t, c) for x, v, s, _ in obs for b in range(x.shape[0]) for t in range(x.shape[1])
                    if v[b, t] for c in range(x.shape[2])]
            C = obs[0][0].shape[2]
            for c in range(C):
                mine = [e for e in vals if e[3] == c]
                best = max(e[0] for e in mine)
                first = min((e[1], e[2]) for e in mine if e[0] == best)  # first in (sequence, token) order
                r = rows.iloc[c]
                assert r.absmax == best and (r.argmax_seq, r.argmax_token) == first
                assert r.tokens == len(mine)
                assert math.isclose(r.mean_abs, sum(e[0] for e in mine) / len(mine), rel_tol=1e-6)
                assert r.n_ge6 == sum(e[0] >= 6 for e in mine) and r.n_gt100 == sum(e[0] > 100 for e in mine)
            if kind == "attn.k":  # head and dim of a KV channel: c = head * head_dim + dim
                assert (rows["head"] * 8 + rows["dim"] == rows["channel"]).all()
            p = pos[(pos.point == kind) & (pos.layer == layer)].set_index("position")
            for t in range(9):
                tok_max = [x[b, t].__abs__().max() for x, v, _, _ in obs for b in range(x.shape[0]) if v[b, t]]
                assert p.loc[t, "tokens"] == len(tok_max) and p.loc[t, "absmax_max"] == max(tok_max)
                assert math.isclose(p.loc[t, "absmax_mean"], np.mean(tok_max), rel_tol=1e-9)
    head = stats.per_layer().query("point == 'lm_head.input'")  # its row is the one after the last layer
    n = sum(v.sum() * x.shape[2] for obs in _kept(kept, "lm_head.input").values() for x, v, _, _ in obs)
    assert list(head.layer) == [2] and list(head["count"]) == [n] and head["top1"].iloc[0] == max(
        float(abs(x)[v].max()) for obs in _kept(kept, "lm_head.input").values() for x, v, _, _ in obs)
    feats = stats.int8_features()
    assert 3 in set(feats[feats.point == "hidden"].channel)  # the planted channel
    linear = feats.groupby("point")["linear"].first()  # an nn.Linear's input: LLM.int8's and SmoothQuant's tensors
    assert linear["self_attn.q_proj.input"] and not linear["mlp.down_proj.output"] and not linear["hidden"]
    _check_int8(feats, kept)


def _check_int8(feats, kept):
    for kind in ("hidden", "mlp.down_proj.input", "attn.k"):
        per_layer = _kept(kept, kind)
        share = np.stack([sum((np.abs(x) >= 6)[v].sum(0) for x, v, _, _ in obs) / sum(v.sum() for _, v, _, _ in obs)
                          for _, obs in sorted(per_layer.items())])  # (L, C)
        want = set(np.flatnonzero((share >= 0.06).sum(0) >= math.ceil(0.25 * len(per_layer))))
        assert set(feats[feats.point == kind].channel) == want


def test_massive_activations_and_recurrence_against_brute_force():
    model = _model()
    batches = _batches()
    stats, kept = _run(model, batches, massive_abs=3.0, massive_rel=2.0, delimiters=DELIM)
    got = stats.massive()
    for kind in ("hidden", "mlp.down_proj.input"):
        for layer, obs in _kept(kept, kind).items():
            allabs = np.concatenate([np.abs(x)[v].ravel() for x, v, _, _ in obs])
            med = stats.median(kind, layer)
            assert abs(med / np.sort(allabs)[math.ceil(len(allabs) / 2) - 1] - 1) < 0.005  # the median's stated bound
            want = sorted((s + b, t, c) for x, v, s, _ in obs for b, t, c in zip(*np.nonzero(np.abs(x) > 3.0))
                          if v[b, t] and abs(x[b, t, c]) > 2.0 * med)
            rows = got[(got.point == kind) & (got.layer == layer)]
            assert sorted(zip(rows.seq, rows.token, rows.channel)) == want
            ids = torch.cat(batches)  # (sequences, T): the token ids the model was given
            for r in rows.itertuples():
                assert r.token_id == ids[r.seq, r.token]
                assert r.position_kind == ("first" if r.token == 0 else "delimiter" if r.token_id in DELIM else "other")
    assert (got.point == "hidden").any()  # the planted channel
    rec = stats.massive_recurrence()
    want = got.groupby(["point", "layer", "channel", "position_kind"]).agg(n=("seq", "size"), s=("seq", "nunique"))
    assert list(rec.occurrences) == list(want.n) and list(rec.sequences) == list(want.s)
    assert np.allclose(rec.share_of_sequences, want.s.to_numpy() / (len(batches) * 2))


def test_massive_cap_keeps_the_largest_and_says_so():
    model = _model()
    stats, kept = _run(model, _batches(), points=["layers.*.hidden"], massive_abs=0.0, massive_cap=50)
    ex = stats.hidden.massive
    ex.flush()
    allabs = np.sort(np.concatenate([np.abs(o.x.numpy()).ravel() for o in kept]))[::-1]
    assert ex.overflowed and ex.total == len(allabs)
    np.testing.assert_array_equal(ex.top.values.numpy(), allabs[:50])


def test_sinks_against_brute_force():
    model = _model()
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, -2:] = 0  # right padding: those query rows are not counted
    stats, kept = _run(model, _batches(2), mask=mask, sink_k=3)
    sinks = stats.sink_table()
    for layer in range(2):
        obs = [o for o in kept if o.point.kind == "attn.probs" and o.point.layer == layer]
        for h in range(4):
            first, first3, rows = 0.0, 0.0, 0
            for o in obs:
                p, v = o.x.double().numpy(), o.valid.expand_as(o.x).numpy()
                for b in range(p.shape[0]):
                    for t in range(p.shape[2]):
                        if v[b, h, t].any():
                            rows += 1
                            first += p[b, h, t, 0] * v[b, h, t, 0]
                            first3 += (p[b, h, t, :3] * v[b, h, t, :3]).sum()
            r = sinks[(sinks.layer == layer) & (sinks["head"] == h)].iloc[0]
            assert r.rows == rows == 2 * (9 + 7)  # two forwards, the padded sequence's 2 rows left out
            assert math.isclose(r.mass_first, first / rows, rel_tol=1e-6)
            assert math.isclose(r.mass_first_k, first3 / rows, rel_tol=1e-6)


def test_act_scales_equal_smoothquant_script():
    """SmoothQuant's generate_act_scales.py, re-implemented naively: a forward hook on every nn.Linear keeps the max
    over tokens of |input| per channel, float32 on the CPU."""
    model = _model()
    batches = _batches()
    want = {}

    def hook(name):
        def f(m, x, y):
            x = x[0] if isinstance(x, tuple) else x
            t = x.view(-1, x.shape[-1]).abs().detach()
            cur = torch.max(t, dim=0)[0].float().cpu()
            want[name] = torch.max(want[name], cur) if name in want else cur
        return f

    hooks = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids)
    for h in hooks:
        h.remove()
    stats = OutlierStats.for_model(model, seq_len=9)
    with torch.no_grad(), capture(model, preset="smoothquant", reducers=stats):
        for ids in batches:
            model(input_ids=ids)
    got = stats.act_scales()
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name


TABLES = ("table5", "per_layer", "histograms", "channels", "positions", "massive", "massive_recurrence",
          "int8_features", "sink_table")


@pytest.mark.parametrize("cut", [1, 3])
def test_split_streams_merge_to_the_same_bytes(cut):
    model = _model()
    batches = _batches(5)
    kw = dict(massive_abs=3.0, massive_rel=2.0, delimiters=DELIM)
    whole, _ = _run(model, batches, **kw)
    a, _ = _run(model, batches[:cut], **kw)
    b, _ = _run(model, batches[cut:], first=cut, **kw)
    merged = b.merge(a)  # either order
    for name in TABLES:
        x = getattr(merged, name)() if name != "table5" else merged.table5()
        y = getattr(whole, name)() if name != "table5" else whole.table5()
        assert x.to_csv() == y.to_csv(), name
    for maps in (True, False):
        assert merged.topk_points(maps).to_csv() == whole.topk_points(maps).to_csv()
    assert {k: v.tolist() for k, v in merged.act_scales().items()} == {k: v.tolist() for k, v in whole.act_scales().items()}
    pd.testing.assert_frame_equal(merged.channels(), whole.channels())


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_never_enters_channel_maxima_or_act_scales(side):
    """Padded batches (the pad token's embedding planted 1000x, so a padding row would top every maximum): channel
    maxima of the hidden states and down_proj's input, and act_scales, equal those of each sequence run alone without
    padding, taken by plain forward hooks (SmoothQuant's script)."""
    model = _model()
    with torch.no_grad():
        model.model.embed_tokens.weight[0] *= 1000
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(1, 101, (n,), generator=g) for n in (9, 6, 4)]
    want_lin, want_ch = {}, {}

    def keep(store, name, t):
        cur = t.reshape(-1, t.shape[-1]).abs().amax(0).float()  # (C,)
        store[name] = torch.maximum(store[name], cur) if name in store else cur

    hooks = [m.register_forward_hook(lambda m, x, y, n=n: keep(want_lin, n, x[0]))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_hook(lambda m, x, y, i=i: keep(want_ch, ("hidden", i), y[0] if isinstance(y, tuple) else y)))
        hooks.append(layer.mlp.down_proj.register_forward_hook(lambda m, x, y, i=i: keep(want_ch, ("mlp.down_proj.input", i), x[0])))
    with torch.no_grad():
        for s in seqs:
            model(input_ids=s[None])
    for h in hooks:
        h.remove()
    T = 9
    ids, mask = torch.zeros(3, T, dtype=torch.long), torch.zeros(3, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(T - len(s), T)
        ids[b, sl], mask[b, sl] = s, 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    stats = OutlierStats.for_model(model, seq_len=T)
    with torch.no_grad(), capture(model, ["layers.*.hidden", "layers.*.mlp.down_proj.input"], preset="smoothquant",
                                  reducers=stats):
        model(input_ids=ids, attention_mask=mask, position_ids=pos)
    got = stats.act_scales()
    assert sorted(got) == sorted(want_lin)
    for name in want_lin:
        torch.testing.assert_close(got[name], want_lin[name], rtol=1e-5, atol=0, msg=name)
    ch = stats.channels()
    for (kind, layer), w in want_ch.items():
        rows = ch[(ch.point == kind) & (ch.layer == layer)].sort_values("channel")
        np.testing.assert_allclose(rows.absmax.to_numpy(), w.double().numpy(), rtol=1e-5, atol=0)
        assert (rows.tokens == sum(len(s) for s in seqs)).all()
