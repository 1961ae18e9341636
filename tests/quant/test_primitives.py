"""Property tests of the absmax primitives (hypothesis) plus examples."""

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from outlierscope.quant.attention.logits import logits_quant
from outlierscope.quant.numerics.primitives import absmax_scale, fake_quant, qmax, quantize_absmax
from outlierscope.quant.specs.spec import QuantSpec, parse_layers

floats = st.floats(-1e4, 1e4, allow_nan=False, width=32)
tensors = arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 9)), elements=floats)
bits_st = st.integers(2, 15)


@settings(max_examples=150, deadline=None)
@given(tensors, bits_st, st.integers(0, 2**31 - 1))
@example(np.array([[1.1754944e-38]], dtype=np.float32), 13, 0)  # a subnormal scale (found by hypothesis)
def test_error_bound_idempotent_odd_and_pure(arr, bits, seed):
    x = torch.from_numpy(arr)
    valid = torch.from_numpy(np.random.default_rng(seed).random(arr.shape) > 0.3)
    before = x.clone()
    s = absmax_scale(x, bits, dims=(1,), valid=valid)
    q = fake_quant(x, s, bits, valid=valid)
    assert torch.equal(x, before)  # input unchanged
    assert torch.isfinite(q).all()
    err = (q.double() - x.double()).abs()
    bound = (s.double() / 2).expand_as(err) * (1 + 1e-6) + 1e-30
    assert (err[valid] <= bound[valid]).all()
    assert torch.equal(q[~valid], x[~valid])  # masked entries untouched
    q2 = fake_quant(q, absmax_scale(q, bits, dims=(1,), valid=valid), bits, valid=valid)
    assert torch.equal(q2, q)  # quantizing twice equals once
    qn = fake_quant(-x, absmax_scale(-x, bits, dims=(1,), valid=valid), bits, valid=valid)
    assert torch.equal(qn, -q)  # odd symmetry


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@settings(max_examples=50, deadline=None)
@given(arr=tensors)
def test_fp8_properties(fmt, arr):
    x = torch.from_numpy(arr)
    q = quantize_absmax(x, 8, (1,), fmt=fmt)
    assert torch.isfinite(q).all()
    assert torch.equal(quantize_absmax(-x, 8, (1,), fmt=fmt), -q)
    # relative error of a normal fp8 number is at most 2^-(mantissa bits + 1)
    mant = 3 if fmt == "e4m3" else 2
    amax = x.abs().amax(1, keepdim=True)
    big = x.abs() >= amax / 64
    assert ((q - x).abs()[big] <= x.abs()[big] * 2.0 ** -(mant + 1) * (1 + 1e-6)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_edge_values_never_nan(dtype, bits):
    big = min(1e30, torch.finfo(dtype).max)  # 1e30 where the dtype has it, else its largest finite value
    cases = [torch.zeros(2, 5), torch.full((2, 5), big), torch.tensor([[big, -1e-30, 0.0, 3.0, -7.0]] * 2),
             torch.tensor([[float("inf"), 1.0, 0.0, 3.0, -7.0]] * 2)]
    for x in cases:
        x = x.to(dtype)
        valid = torch.ones_like(x, dtype=torch.bool)
        valid[1] = False  # a row with no valid entry: returned unchanged
        q = quantize_absmax(x, bits, (1,), valid)
        assert q.dtype == dtype and torch.isfinite(q[torch.isfinite(x)]).all()
        assert torch.equal(q[1], x[1])


def test_scale_in_float32_for_half_inputs():
    x = torch.tensor([[60000.0, 1.0]], dtype=torch.float16)
    s = absmax_scale(x, 8, (1,))
    assert s.dtype == torch.float32 and s.item() == pytest.approx(60000 / 127)


def test_tie_rule_is_half_to_even():
    scale = torch.tensor([[1.0]])
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -2.5, 7.0]])
    assert fake_quant(x, scale, 4).tolist() == [[0.0, 2.0, 2.0, -0.0, -2.0, 7.0]]


def test_grid_and_clamp():
    assert qmax(8) == 127 and qmax(4) == 7 and qmax(2) == 1 and qmax(8, "e4m3") == 448
    x = torch.tensor([[-10.0, -3.0, 0.2, 10.0]])
    q = quantize_absmax(x, 2, (1,))  # grid {-10, 0, 10}
    assert q.tolist() == [[-10.0, -0.0, 0.0, 10.0]]


@pytest.mark.parametrize("bad", [1, 17, 0, 8.5, "8", True])
def test_bits_out_of_range(bad):
    with pytest.raises(ValueError, match="bits must be in 2..16"):
        QuantSpec.logits(bits=bad)


@pytest.mark.parametrize("kw,msg", [(dict(format="int4"), "format must be one of int, e4m3, e5m2"),
                                    (dict(granularity="per_col"), "granularity must be one of per_tensor, per_head, per_row"),
                                    (dict(format="e4m3", bits=4), r"bits must be 8 \(or 16 = unquantized\) for format e4m3"),
                                    (dict(backend="bitsandbytes", granularity="per_tensor"),
                                     "backend must be 'torch' unless format int, bits 8, granularity per_row"),
                                    (dict(bits=None, format="e4m3"), "bits must be in 2..16")])
def test_spec_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        QuantSpec.logits(**{"bits": 8, **kw})


def test_parse_layers():
    assert parse_layers("0-3") == (0, 1, 2, 3) and parse_layers("0,2,5") == (0, 2, 5) and parse_layers(None) is None
    with pytest.raises(ValueError, match="layers must look like"):
        parse_layers("a-b")


@pytest.mark.parametrize("gran", ["per_tensor", "per_head", "per_row"])
def test_granularity_is_per_sequence(gran):
    """One sequence's quantized logits are identical with batch size 1 and 8."""
    torch.manual_seed(0)
    x = torch.randn(8, 4, 6, 6) * torch.rand(8, 1, 1, 1) * 10
    valid = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].expand(8, 4, 6, 6)
    spec = logits_quant(QuantSpec.logits(bits=4, granularity=gran))
    full = spec(x, valid)
    for i in (0, 5):
        assert torch.equal(full[i : i + 1], spec(x[i : i + 1], valid[i : i + 1]))


def test_per_row_scale_sees_only_valid_keys():
    x = torch.tensor([[[[1.0, 100.0], [1.0, 2.0]]]])  # row 0 may only see key 0
    valid = torch.tensor([[[[True, False], [True, True]]]])
    q = logits_quant(QuantSpec.logits(bits=2, granularity="per_row"))(x, valid)
    assert q[0, 0, 0].tolist() == [1.0, 100.0] and q[0, 0, 1].tolist() == [0.0, 2.0]


@pytest.mark.parametrize("seed", range(3))
def test_bitsandbytes_per_row_int8_matches(seed):
    torch.manual_seed(seed)
    x = torch.randn(2, 3, 16, 16) * 5
    valid = torch.ones(16, 16, dtype=torch.bool).tril()[None, None].expand_as(x)
    ours = logits_quant(QuantSpec.logits(bits=8, granularity="per_row"))(x, valid)
    bnb = logits_quant(QuantSpec.logits(bits=8, granularity="per_row", backend="bitsandbytes"))(x, valid)
    assert torch.isfinite(bnb).all()
    # identical except where x / scale sits within float rounding of a .5 tie (x*127/amax vs x/(amax/127))
    scale = absmax_scale(x, 8, (3,), valid)
    frac = (x / scale).abs() % 1
    near_tie = (frac - 0.5).abs() < 1e-4
    diff = ours != bnb
    assert (diff & ~near_tie).sum() == 0
    assert ((ours - bnb).abs() <= scale * (1 + 1e-6)).all()


@settings(max_examples=100, deadline=None)
@given(tensors, bits_st, st.integers(0, 2**31 - 1))
def test_scale_is_absmax_of_valid_over_qmax(arr, bits, seed):
    """The scale itself, against numpy: max |x| over the valid entries of each row / (2^(bits-1) - 1)."""
    valid = np.random.default_rng(seed).random(arr.shape) > 0.3
    s = absmax_scale(torch.from_numpy(arr), bits, dims=(1,), valid=torch.from_numpy(valid))
    expect = np.where(valid, np.abs(arr), 0).max(1, keepdims=True) / np.float32(2 ** (bits - 1) - 1)
    np.testing.assert_array_equal(s.numpy(), expect.astype(np.float32))


@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
@settings(max_examples=50, deadline=None)
@given(arr=tensors)
def test_fp8_equals_torch_cast(fmt, dtype, arr):
    """FP8 fake-quant = divide by amax / max finite, cast through torch's float8 type, multiply back."""
    x = torch.from_numpy(arr)
    amax = x.abs().amax(1, keepdim=True)
    scale = amax / torch.finfo(dtype).max
    ok = scale >= torch.finfo(torch.float32).tiny  # a subnormal scale (|x| ~ 1e-36): x unchanged, as for zero
    expect = torch.where(ok, (x / torch.where(ok, scale, 1)).to(dtype).float() * scale, x)
    torch.testing.assert_close(quantize_absmax(x, 8, (1,), fmt=fmt), expect, rtol=0, atol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_full_range_grid_against_numpy(bits):
    """fint: scale absmax / ((2^b - 1) / 2), values in [-2^(b-1), 2^(b-1) - 1] (numpy float64, written here): +absmax
    loses half a step to the clamp, -absmax reaches the extra negative level."""
    import numpy as np

    from outlierscope.quant.numerics.primitives import quantize_absmax

    x = np.random.default_rng(bits).normal(size=(6, 40))
    x[0, 3], x[1, 5] = 9.0, -9.0  # the row's absmax on each side
    s = np.abs(x).max(-1, keepdims=True) / ((2**bits - 1) / 2)
    want = np.clip(np.round(x / s), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * s
    got = quantize_absmax(torch.from_numpy(x), bits, (-1,), fmt="fint").numpy()
    np.testing.assert_array_equal(got, want)
    assert got[0, 3] < 9.0 and got[1, 5] == -9.0 * (2 ** (bits - 1)) / ((2**bits - 1) / 2)
