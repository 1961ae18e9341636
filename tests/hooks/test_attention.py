"""Blocked attention (query rows in blocks) against the unblocked path: outputs, observed logits,
statistics and quantized logits, on architectures with padding, sliding windows, soft-capping and
DiffLlama's two calls per layer."""

import pytest
import torch

from outlierscope.analysis.outliers import OutlierStats
from outlierscope.errors import ParamError
from outlierscope.hooks.attention import BLOCK_BYTES, attention_stages, block_rows
from outlierscope.hooks.capture import capture
from outlierscope.quant.apply import quantize_model
from outlierscope.quant.specs.spec import QuantSpec
from tests.hooks.test_capture import make

ARCHS = ["llama", "diffllama", "mistral", "gemma2", "gpt2"]
T = 11


def _batch(pad: bool = True):
    ids = torch.randint(0, 101, (3, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if pad:  # (in float64, eager too gives NaN in fully masked padding rows, and it spreads along the sequence)
        mask[1, :3] = 0  # left padding
        mask[2, -4:] = 0  # right padding
    return ids, mask


def _run(model, rows, spec=None, reducers=None, pad=True):
    ids, mask = _batch(pad)
    seen = []

    def keep(o):
        if o.point.kind == "attn.logits":
            seen.append((o.point.layer, o.query_offset, o.x.clone(), o.valid.expand_as(o.x).clone()))

    import contextlib

    with torch.no_grad(), contextlib.ExitStack() as st:
        if spec is not None:
            st.enter_context(quantize_model(model, spec, block_rows=rows))
        st.enter_context(capture(model, ["layers.*.attn.logits", "layers.*.hidden"],
                                 reducers=[keep] + list(reducers or []), block_rows=rows))
        out = model(input_ids=ids, attention_mask=mask).logits
    return out, seen


def same(a, b):
    """Equal up to the matmul's summation order: BLAS kernels sum a block of rows differently from the whole
    matrix (about 1e-16 relative in float64). NaN where both are NaN (eager's float64 fully masked rows)."""
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, equal_nan=True)


def _joined(seen):
    """Per layer, the observed blocks concatenated along the query rows (B, H, T, S), and their first rows."""
    by_layer = {}
    for layer, q0, x, valid in seen:
        by_layer.setdefault(layer, []).append((q0, x, valid))
    return {k: (torch.cat([x for _, x, _ in v], 2), torch.cat([m for _, _, m in v], 2), [q for q, _, _ in v])
            for k, v in by_layer.items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rows", [1, 4])
def test_blocked_equals_unblocked_float64(arch, rows):
    """float64: outputs and observed logits equal to the matmul's rounding, valid masks identical; every block
    seen once, with its offset."""
    model = make(arch).double()
    ref, ref_seen = _run(model, None)
    out, seen = _run(model, rows)
    same(out, ref)
    a, b = _joined(seen), _joined(ref_seen)
    assert a.keys() == b.keys()
    for layer in a:
        same(a[layer][0], b[layer][0])
        assert torch.equal(a[layer][1], b[layer][1])
        assert a[layer][2] == list(range(0, T, rows))  # query offsets (no cache: S == T)
        assert b[layer][2] == [0]


@pytest.mark.parametrize("arch", ARCHS)
def test_blocked_statistics_equal(arch):
    """OutlierStats of a blocked run (float64 model): top-k locations and histograms identical, values and
    moments within float64 rounding (blocks change the summation order and the first shift)."""
    model = make(arch).double()
    a, b = (OutlierStats.for_model(model, T, k=100, layer_k=5) for _ in range(2))
    _run(model, None, reducers=[a], pad=False)
    _run(model, 3, reducers=[b], pad=False)
    for kind in a.kinds():
        same(a.top[kind].values, b.top[kind].values)
        assert torch.equal(a.top[kind].locs, b.top[kind].locs), kind
        assert torch.equal(a.hist[kind], b.hist[kind]), kind
        ma, mb = a.moments[kind].summary(), b.moments[kind].summary()
        assert torch.equal(a.moments[kind].count, b.moments[kind].count)
        for m in ("mean", "std"):
            torch.testing.assert_close(torch.as_tensor(ma[m]), torch.as_tensor(mb[m]), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("arch", ["llama", "diffllama", "mistral", "gemma2"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_head", "per_row"])
@pytest.mark.parametrize("rows", [2, 5])
def test_blocked_quantization_equals_unblocked(arch, granularity, rows):
    """Quantized attention in blocks: the global scale (per_tensor, per_head) from a first pass; in float64 equal
    to the unblocked result up to the matmul's rounding (a wrong scale would move the output by a whole step)."""
    model = make(arch).double()
    spec = QuantSpec.logits(bits=4, granularity=granularity)
    ref, ref_seen = _run(model, None, spec)
    out, seen = _run(model, rows, spec)
    same(out, ref)
    a, b = _joined(seen), _joined(ref_seen)
    for layer in a:  # capture inside quantize_model: the observed logits are the unquantized ones
        same(a[layer][0], b[layer][0])


def test_blocked_quantization_float32_predictions():
    model = make("llama")
    for g in ("per_tensor", "per_head", "per_row"):
        spec = QuantSpec.logits(bits=4, granularity=g)
        ref, _ = _run(model, None, spec)
        out, _ = _run(model, 3, spec)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_quantization_is_observed_in_blocks_after_it():
    """quantize_model outside capture: the capture sees the quantized blocks, scaled with the global absmax."""
    model = make("llama").double()
    spec = QuantSpec.logits(bits=3, granularity="per_tensor")
    ids, mask = _batch()
    runs = []
    for rows in (None, 4):
        seen = []
        with torch.no_grad(), quantize_model(model, spec), capture(model, ["layers.0.attn.logits"],
                                                                        reducers=lambda o, seen=seen: seen.append(o.x.clone()),
                                                                        block_rows=rows):
            model(input_ids=ids, attention_mask=mask)
        runs.append(torch.cat(seen, 2))
    same(runs[0], runs[1])


def test_diffllama_second_call_keeps_no_full_probabilities():
    """DiffLlama calls attention twice per layer: blocked, the second call recomputes (memo holds no probabilities)
    and the stages observe once per layer."""
    from outlierscope.hooks.attention import _current_function

    model = make("diffllama").double()
    ids, mask = _batch()
    names = []
    with torch.no_grad(), capture(model, ["layers.*.attn.logits"], reducers=lambda o: names.append(o.point.layer),
                                  block_rows=4):
        fn = _current_function(model)
        model(input_ids=ids, attention_mask=mask)
        assert fn._memo[3] is None  # no (B, H, T, S) probabilities kept
    assert names == [0] * 3 + [1] * 3  # 3 blocks of 4 rows per layer, once each


def test_bf16_logits_are_float32():
    model = make("llama").to(torch.bfloat16)
    ids, mask = _batch()
    dtypes = []
    with torch.no_grad(), capture(model, ["layers.*.attn.logits"], reducers=lambda o: dtypes.append(o.x.dtype)):
        out = model(input_ids=ids, attention_mask=mask).logits
    assert dtypes and set(dtypes) == {torch.float32}
    assert out.dtype == torch.bfloat16
    ref32 = make("llama")  # same seed: same weights in float32
    with torch.no_grad():
        r = ref32(input_ids=ids, attention_mask=mask).logits
    assert (out.float() - r).abs().max() < 0.25 * r.abs().max()


def test_block_rows_from_budget():
    assert block_rows(8, 32, 2048) == BLOCK_BYTES // (4 * 8 * 32 * 2048)
    assert block_rows(1, 1, 1, block_bytes=1) == 1
    assert block_rows(2, 4, 100, block_bytes=4 * 2 * 4 * 100 * 7) == 7


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_block_rows_must_be_positive(bad):
    model = make("llama")
    with pytest.raises(ParamError, match="block_rows must be"):
        with attention_stages(model, lambda ctx, x: x, block_rows=bad):
            pass
    assert model.config._attn_implementation == "eager"


def test_nested_contexts_inherit_block_rows():
    """A capture entered inside quantize_model(block_rows=...) keeps the outer block size."""
    model = make("llama")
    ids, mask = _batch()
    rows = []
    with torch.no_grad(), quantize_model(model, QuantSpec.logits(bits=8, granularity="per_row"), block_rows=5), \
            capture(model, ["layers.0.attn.logits"], reducers=lambda o: rows.append(o.x.shape[2])):
        model(input_ids=ids, attention_mask=mask)
    assert rows == [5, 5, 1]
