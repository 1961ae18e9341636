"""Attention-level error of quantized logits: per-row KL, argmax change and output error against a naive float64
re-computation, exact merging, and the measuring stage on real models (blocked = unblocked, layer subsets, no
effect on the model)."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from outlierscope.analysis.attention_error import AttentionErrorStats, attention_row_errors, measure_attention_error
from outlierscope.models.loading import load_model
from outlierscope.quant.apply import quantize_model
from outlierscope.quant.attention.logits import logits_quant
from outlierscope.quant.specs.spec import QuantSpec


def _softmax(xs):
    m = max(xs)
    z = math.fsum(math.exp(x - m) for x in xs)
    return [math.exp(x - m) / z for x in xs]


def _naive_rows(ref, quant, valid, value, probs=None, quant_value=None):
    """Per real query row (b, h, t): KL(softmax(ref) || softmax(quant)), whether the top key changed, and the relative
    output error of softmax(ref) @ value against (probs or softmax(quant)) @ (quant_value or value), in Python floats."""
    B, H, T, S = ref.shape
    qv = value if quant_value is None else quant_value
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys = [s for s in range(S) if valid[b, min(h, valid.shape[1] - 1), t, s]]
                if not keys:
                    continue
                a, q = [float(ref[b, h, t, s]) for s in keys], [float(quant[b, h, t, s]) for s in keys]
                p, pq = _softmax(a), _softmax(q)
                kl = math.fsum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, pq) if pi > 0)
                changed = q[a.index(max(a))] < max(q) or q.count(max(q)) > a.count(max(a))
                w = pq if probs is None else [float(probs[b, h, t, s]) for s in keys]
                d = value.shape[-1]
                o = [math.fsum(pi * float(value[b, h, s, j]) for pi, s in zip(p, keys)) for j in range(d)]
                oq = [math.fsum(wi * float(qv[b, h, s, j]) for wi, s in zip(w, keys)) for j in range(d)]
                yield b, h, t, kl, changed, math.dist(o, oq) / math.hypot(*o)


def _naive(ref, quant, valid, value):
    B, H, T, _ = ref.shape
    out = {"kl": np.zeros((B, H, T)), "changed": np.zeros((B, H, T), bool), "rel": np.zeros((B, H, T)),
           "rows": np.zeros((B, H, T), bool)}
    for b, h, t, kl, changed, rel in _naive_rows(ref, quant, valid, value):
        out["rows"][b, h, t], out["kl"][b, h, t], out["changed"][b, h, t], out["rel"][b, h, t] = True, kl, changed, rel
    return out


@pytest.mark.parametrize("seed, heads_in_mask, kind", [(0, 1, "noise"), (1, 3, "noise"), (2, 1, "round"), (3, 3, "round")])
def test_row_errors_against_naive(seed, heads_in_mask, kind):
    """``round``: coarse rounding keeps order but makes ties at the maximum; ``noise`` moves maxima: both change
    the top key (``round`` only by ties)."""
    g = torch.Generator().manual_seed(seed)
    B, H, T, S, d = 2, 3, 5, 7, 4
    ref = torch.randn(B, H, T, S, generator=g) * 4
    quant = ref + 3 * torch.randn(B, H, T, S, generator=g) if kind == "noise" else (ref / 3).round() * 3
    valid = torch.rand(B, heads_in_mask, T, S, generator=g) > 0.3
    valid[0, :, 1] = False  # a row with no valid key (padding query)
    value = torch.randn(B, H, S, d, generator=g)
    got = attention_row_errors(ref, quant, valid, value)
    want = _naive(ref, quant, valid, value)
    assert (got["rows"].numpy() == want["rows"]).all()
    np.testing.assert_allclose(got["kl"].numpy(), want["kl"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got["rel_out"].numpy(), want["rel"], rtol=1e-9, atol=1e-12)
    assert (got["changed"].numpy() == want["changed"]).all() and want["changed"].any()
    if kind == "round":  # order kept: the reference's top key is never passed, only joined
        a, q = ref.double().masked_fill(~valid.expand_as(ref), -1e9), quant.double().masked_fill(~valid.expand_as(ref), -1e9)
        assert (q.gather(-1, a.argmax(-1, keepdim=True)) == q.amax(-1, keepdim=True)).all()
    assert (got["kl"] >= -1e-15).all() and got["kl"].max() > 0


def test_identical_logits_have_no_error():
    x = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    e = attention_row_errors(x, x.clone(), torch.ones(1, 1, 4, 4, dtype=torch.bool), torch.randn(1, 2, 4, 3))
    assert e["kl"].abs().max() == 0 and not e["changed"].any() and e["rel_out"].max() == 0


def test_merge_equals_whole():
    g = torch.Generator().manual_seed(3)
    parts = [(torch.randn(2, 2, 4, 6, generator=g), torch.rand(2, 1, 4, 6, generator=g) > 0.2) for _ in range(4)]
    spec = logits_quant(QuantSpec.logits(bits=4))
    whole, a, b = AttentionErrorStats(2, 2), AttentionErrorStats(2, 2), AttentionErrorStats(2, 2)
    for i, (x, v) in enumerate(parts):
        whole.update(i % 2, x, spec(x, v), v)
        (a if i < 2 else b).update(i % 2, x, spec(x, v), v)
    m = a.merge(b)
    assert torch.equal(m.rows, whole.rows) and torch.equal(m.changed, whole.changed) and torch.equal(m.kl_max, whole.kl_max)
    torch.testing.assert_close(m.kl_sum, whole.kl_sum, rtol=1e-12, atol=0)


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding
    return ids, mask


@pytest.mark.parametrize("role", ["transformer", "diff"])
def test_measuring_leaves_the_model_alone_and_blocks_agree(role, batch):
    lm = load_model(f"pair-tiny:{role}", device="cpu")
    ids, mask = batch
    spec = QuantSpec.logits(bits=4, granularity="per_tensor")
    with torch.no_grad(), quantize_model(lm.model, spec):
        ref = lm.model(input_ids=ids, attention_mask=mask).logits
    stats = {}
    for rows in (None, 5):
        st = AttentionErrorStats(lm.model.config.num_hidden_layers, lm.model.config.num_attention_heads)
        with torch.no_grad(), measure_attention_error(lm.model, spec, st, block_rows=rows), \
                quantize_model(lm.model, spec, block_rows=rows):
            out = lm.model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        stats[rows] = st
    a, b = stats[None], stats[5]
    assert int(a.rows[0].sum()) == lm.model.config.num_attention_heads * (12 + 9)  # real query rows only, once per layer
    assert torch.equal(a.rows, b.rows) and torch.equal(a.changed, b.changed)
    torch.testing.assert_close(a.kl_sum, b.kl_sum, rtol=1e-5, atol=1e-9)
    t = a.table()
    assert set(t.columns) >= {"layer", "head", "kl_mean", "kl_max", "argmax_change_rate", "rel_out_mean"}
    assert (t.kl_mean > 0).all() and len(a.per_layer()) == lm.model.config.num_hidden_layers


def test_layer_subset_and_bits_order(batch):
    lm = load_model("pair-tiny:transformer", device="cpu")
    ids, mask = batch
    n_l, n_h = lm.model.config.num_hidden_layers, lm.model.config.num_attention_heads
    kl = {}
    for bits in (8, 4):
        st = AttentionErrorStats(n_l, n_h)
        with torch.no_grad(), measure_attention_error(lm.model, QuantSpec.logits(bits=bits), st):
            lm.model(input_ids=ids, attention_mask=mask)
        kl[bits] = st.kl_sum.sum()
    assert kl[8] < kl[4]
    st = AttentionErrorStats(n_l, n_h)
    with torch.no_grad(), measure_attention_error(lm.model, QuantSpec.logits(bits=4, layers=(1,)), st):
        lm.model(input_ids=ids, attention_mask=mask)
    assert st.rows[1].sum() > 0 and st.rows.sum() == st.rows[1].sum()


def test_evaluate_with_attention_error(hellaswag_cached):
    """evaluate(attn_error=...): the scores are those without it; every layer's real rows are measured; two shards'
    statistics, each through its raw per-virtual-shard table, merge to the whole run's table byte for byte."""
    from outlierscope.eval.evaluate import evaluate
    from outlierscope.parallel import Shard

    lm = load_model("pair-tiny:diff", device="cpu")
    spec = QuantSpec.logits(bits=4)
    st = AttentionErrorStats(lm.model.config.num_hidden_layers)
    plain = evaluate(lm, quant=spec, limit=6, progress=False, batch_size=8)
    res = evaluate(lm, quant=spec, limit=6, progress=False, batch_size=8, attn_error=st)
    assert np.array_equal(plain.items[plain.score_columns].to_numpy(), res.items[res.score_columns].to_numpy())
    per_layer = st.per_layer()
    assert len(per_layer) == lm.model.config.num_hidden_layers and per_layer["rows"].nunique() == 1
    parts = []
    for i in range(2):
        part = AttentionErrorStats(lm.model.config.num_hidden_layers)
        evaluate(lm, quant=spec, limit=6, progress=False, batch_size=2, shard=Shard(i, 2), attn_error=part)
        parts.append(part.shard_table())
    whole = AttentionErrorStats(lm.model.config.num_hidden_layers)
    evaluate(lm, quant=spec, limit=6, progress=False, batch_size=2, attn_error=whole)
    assert sorted(set(parts[0].vshard)) != sorted(set(parts[1].vshard))  # the shards split the batches
    merged = AttentionErrorStats.from_shard_tables(parts, lm.model.config.num_hidden_layers)
    pd.testing.assert_frame_equal(merged.table(), whole.table(), check_exact=True)


# -- q/k/v/P specs (kernel recipes): against the recipes' naive float64 attention ----------------------------------

def _naive_kernel_errors(calls, n_layers):
    """Per (layer, head) rows, kl sum, changed, rel_out sum from the naive attention's record (one call per layer):
    kl and changed of softmax(ref) vs softmax(quant) (both after the soft cap), rel_out of p @ v vs P~ @ v~."""
    H = calls[0]["ref"].shape[1]
    out = {k: np.zeros((n_layers, H)) for k in ("rows", "kl", "changed", "rel")}
    for layer, c in enumerate(calls):
        rows = _naive_rows(c["ref"], c["quant"], c["valid"], c["value"], c["probs"], c["quant_value"])
        for _, h, _, kl, changed, rel in rows:
            out["rows"][layer, h] += 1
            out["kl"][layer, h] += kl
            out["changed"][layer, h] += changed
            out["rel"][layer, h] += rel
    return out


@pytest.mark.parametrize("arch,recipe", [("llama", "sage2-int4"), ("llama", "nvfp4-attn"), ("gemma3_text", "kivi-2bit"),
                                         ("gpt2", "fa3-fp8-hadamard"), ("diffllama", "sage2-int4")])
def test_kernel_recipe_errors_against_naive(arch, recipe):
    """measure_attention_error for a q/k/v/P recipe, entered before quantize_model (so each layer's input is the
    quantized model's, as in the naive run), equals the naive recipe attention's per-row errors: KL and top-key changes
    from q and k's quantization, output error from everything; the model's outputs are those without measuring."""
    from tests.quant.test_recipes import DESCRIBED, _batch, _model, _run_naive

    # NVFP4's reference (compressed-tensors) dequantizes with a division where we multiply by the reciprocal (NVIDIA's
    # kernels): equal codes, values within one float32 rounding, which can tip a top-key tie in the next layer
    model = _model(arch, layers=1 if recipe == "nvfp4-attn" else 2)
    ids, mask = _batch()
    calls: list = []
    _run_naive(model, DESCRIBED[recipe], ids, mask, record=calls)
    n_layers = len(calls) // (2 if arch == "diffllama" else 1)
    want = _naive_kernel_errors(calls[:: len(calls) // n_layers], n_layers)  # DiffLlama: the layer's first call
    with torch.no_grad():
        with quantize_model(model, recipe):
            plain = model(input_ids=ids, attention_mask=mask).logits
        st = AttentionErrorStats(n_layers)
        with measure_attention_error(model, recipe, st), quantize_model(model, recipe):
            out = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(out, plain)  # measuring changes nothing
    np.testing.assert_array_equal(st.rows.numpy(), want["rows"])
    np.testing.assert_array_equal(st.changed.numpy(), want["changed"])
    np.testing.assert_allclose(st.kl_sum.numpy(), want["kl"], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(st.rel_sum.numpy(), want["rel"], rtol=1e-6, atol=1e-9)
    assert want["rel"].min() > 0  # every head's output moves


def test_kernel_recipe_blocked_equals_unblocked_and_under_quantization(batch):
    """Blocks of rows give the same errors (float32 model: the matmuls round per block, ~1e-7 of a logit, and a KL is
    a small difference of logits); entered before quantize_model with the same spec, the reference is still the
    unquantized attention: layer 0 (same input either way) has the same numbers as without quantizing the model."""
    lm = load_model("pair-tiny:diff", device="cpu")
    ids, mask = batch
    got = {}
    for rows, quantized in ((None, False), (5, False), (None, True)):
        st = AttentionErrorStats(lm.model.config.num_hidden_layers)
        with torch.no_grad(), measure_attention_error(lm.model, "sage2-int4", st, block_rows=rows):
            if quantized:
                with quantize_model(lm.model, "sage2-int4"):
                    lm.model(input_ids=ids, attention_mask=mask)
            else:
                lm.model(input_ids=ids, attention_mask=mask)
        got[rows, quantized] = st
    a = got[None, False]
    assert a.rows.sum() > 0 and a.kl_sum.sum() > 0 and a.rel_sum.sum() > 0
    for other, layers in ((got[5, False], slice(None)), (got[None, True], slice(0, 1))):
        assert torch.equal(a.rows, other.rows) and torch.equal(a.changed[layers], other.changed[layers])
        torch.testing.assert_close(a.kl_sum[layers], other.kl_sum[layers], rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(a.rel_sum[layers], other.rel_sum[layers], rtol=1e-4, atol=1e-9)
    assert not torch.equal(a.kl_sum[1:], got[None, True].kl_sum[1:])  # later layers: the quantized model's input


def test_logits_with_qkv_is_refused_in_one_line():
    from outlierscope.analysis.attention_error import measured_spec
    from outlierscope.errors import OutlierscopeError

    with pytest.raises(OutlierscopeError, match="not both") as e:
        measured_spec("k=int4/per_token;logits=int8/per_tensor")
    assert "\n" not in str(e.value)
    assert isinstance(measured_spec("logits-int4"), QuantSpec)  # logits only: the paper's path
