"""MX, NVFP4, small floats and asymmetric integers against references that are not our code: torchao's MX and NVFP4
implementations, torch's float8 casts, the OCP MX v1.0 rules applied element by element in plain Python, values worked
by hand, and numpy float64."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from outlierscope.quant.numerics.formats import MINIFLOATS, asym_quant, mx_quant, nvfp4_quant, round_minifloat

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

TORCHAO_ELEM = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp6_e2m3": "fp6_e2m3",
                "mxfp6_e3m2": "fp6_e3m2", "mxfp4": torch.float4_e2m1fn_x2}


def _data(seed: int) -> torch.Tensor:
    """Adversarial: magnitudes over 12 decades, an all-zero block, exact powers of two, subnormal-range values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 64, generator=g) * torch.logspace(-6, 6, 48)[:, None]
    x[3, :32] = 0
    x[5] = torch.exp2(torch.randint(-10, 10, (64,), generator=g).float()) * torch.sign(torch.randn(64, generator=g))
    x[7, :32] = torch.linspace(-1, 1, 32) * 1e-3
    x[7, 0] = 1.0  # one large element: the rest of its block falls into the subnormal range of the element format
    return x


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("fmt", list(TORCHAO_ELEM))
def test_mx_equals_torchao(fmt, seed):
    x = _data(seed)
    scale, data = mx.to_mx(x, TORCHAO_ELEM[fmt], 32)
    ref = mx.to_dtype(data, scale, TORCHAO_ELEM[fmt], 32, torch.float32)
    assert torch.equal(mx_quant(x, fmt), ref)


def compressed_tensors_nvfp4(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' NVFP4 fake quantization of a 2-d ``x`` (groups of 16 along the last dim) under the global
    scale of ``amax``: its E4M3 group scales keep subnormals (as NVIDIA's conversion and Model Optimizer do)."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = preset_name_to_scheme("NVFP4", ["Linear"]).weights
    gs = generate_gparam(-amax, amax)
    groups = x.reshape(x.shape[0], -1, 16)  # (rows, n, 16)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=gs)
    return fake_quantize(x, scale, zp, args, global_scale=gs)


def compressed_tensors_mx(x: torch.Tensor, preset: str) -> torch.Tensor:
    """compressed-tensors' own MX fake quantization (its ``MXFP4`` / ``MXFP8`` preset: groups of 32 along the last dim
    of a 2-d ``x``, E8M0 scales from its ``generate_mx_scales``)."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = preset_name_to_scheme(preset, ["Linear"]).weights
    groups = x.reshape(x.shape[0], -1, 32)  # (rows, n, 32)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    return fake_quantize(x, scale, zp, args)


@pytest.mark.parametrize("data", ["adversarial", "bf16-weights-0", "bf16-weights-1"])
@pytest.mark.parametrize("ours, preset", [("ct-mxfp4", "MXFP4"), ("ct-mxfp8_e4m3", "MXFP8")])
def test_ct_mx_equals_compressed_tensors_and_ocp_does_not(ours, preset, data):
    """``ct-mxfp4`` / ``ct-mxfp8_e4m3`` are compressed-tensors' MX bit for bit (subnormal-range and all-zero blocks,
    bfloat16-valued weights); OCP's ``mxfp4`` / ``mxfp8_e4m3`` differ from it on the blocks whose max has mantissa
    >= 1.75 (percents of the values), so neither name may stand for the other."""
    x = _data(2) if data == "adversarial" else _bf16_weights(int(data[-1]))
    ref = compressed_tensors_mx(x, preset)
    assert torch.equal(mx_quant(x, ours), ref)
    assert (mx_quant(x, ours.removeprefix("ct-")) != ref).float().mean() > 1e-3


def test_ct_mx_scale_rounds_up_from_mantissa_1_75_by_hand():
    """Blocks whose max is 1.5 (mantissa below 1.75) and 1.75: OCP's exponent is floor(log2 max) - 2 = -2 for both
    (X = 1/4: 1.75 -> 7 saturates to 6 -> 1.5); compressed-tensors rounds 1.75 up to 2 first, X = 1/2, 1.75 -> 3.5
    -> 4 (ties to even) -> 2.0, and 0.3 -> 0.6 -> 0.5 -> 0.25 where OCP gives 0.3 -> 1.2 -> 1.0 -> 0.25."""
    x = torch.zeros(2, 32)
    x[0, :2] = torch.tensor([1.5, 0.3])
    x[1, :2] = torch.tensor([1.75, 0.3])
    ocp, ct = mx_quant(x, "mxfp4"), mx_quant(x, "ct-mxfp4")
    assert ocp[:, :2].tolist() == [[1.5, 0.25], [1.5, 0.25]]
    assert ct[:, :2].tolist() == [[1.5, 0.25], [2.0, 0.25]]


def _block_scales(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Each block's E4M3 scale as NVIDIA's conversion gives it (16-element blocks; computed here in float64)."""
    s = x.double().reshape(x.shape[0], -1, 16).abs().amax(-1) / 6 / (float(amax) / 2688)
    return s.clamp(max=448).to(torch.float8_e4m3fn).double()


def _bf16_weights(seed: int) -> torch.Tensor:
    """bfloat16-valued weights of a real checkpoint's kind (8 mantissa bits: block maxima repeat, scales meet E4M3
    ties), with an outlier row and column, as float32."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 256, generator=g) * 0.02
    w[:, 7] *= 30
    w[11] *= 8
    return w.bfloat16().float()


@pytest.mark.parametrize("data", ["adversarial", "bf16-weights-0", "bf16-weights-1"])
def test_nvfp4_equals_compressed_tensors(data):
    """compressed-tensors' own fake quantization (the checkpoints' format): the same values bit for bit, on random
    float32 data (subnormal and zero block scales included) and on bfloat16-valued weights, where block scales land on
    E4M3 ties that another order of operations rounds the other way."""
    x = _data(2) if data == "adversarial" else _bf16_weights(int(data[-1]))
    amax = x.abs().amax()
    got, ref = nvfp4_quant(x, amax), compressed_tensors_nvfp4(x, amax)
    if data == "adversarial":
        s = _block_scales(x, amax)
        assert ((s > 0) & (s < 2**-6)).sum() >= 10 and (s == 0).sum() >= 10  # subnormal and zero scales are tested
    assert torch.equal(got, ref)


def test_nvfp4_equals_torchao_where_scales_are_normal():
    """torchao clamps a block scale up to E4M3's smallest normal 2^-6 and divides by ``amax / 2688`` where
    compressed-tensors multiplies by ``2688 / amax``: on random float32 data (no ties) equal within a float32
    rounding wherever the scale is normal, and different in blocks whose scale is subnormal (we keep it, as the hardware) or rounds to zero (we zero
    the block)."""
    x = _data(2)
    amax = x.abs().amax()
    ref = nv.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=nv.per_tensor_amax_to_scale(amax)).dequantize(torch.float32)
    got = nvfp4_quant(x, amax)
    normal = (_block_scales(x, amax) >= 2**-6).repeat_interleave(16, -1)  # (rows, cols)
    torch.testing.assert_close(got[normal], ref[normal], rtol=2**-22, atol=0)  # float32 rounding of the order only
    assert not torch.equal(got[~normal], ref[~normal])
    assert torch.equal(got[(_block_scales(x, amax) == 0).repeat_interleave(16, -1)].abs().max(), torch.tensor(0.0))


def test_mxint8_by_the_ocp_rules():
    """MXINT8, element by element in Python: X = 2^(floor(log2 max|V|) - 0), P = round_half_even(V / X * 64) / 64
    clamped to +-127/64 (the OCP spec's 8-bit elements with an implicit 2^-6)."""
    x = _data(3)[:, :64]
    x[9, :3] = torch.tensor([-1.996, 1.996, 0.5])  # -127.7 and 127.7 steps: clamped to +-127 (never -128)
    got = mx_quant(x, "mxint8")
    for row in range(x.shape[0]):
        for b in range(2):
            block = [float(v) for v in x[row, 32 * b : 32 * (b + 1)]]
            amax = max(abs(v) for v in block)
            for i, v in enumerate(block):
                if amax == 0:
                    want = v
                else:
                    X = Fraction(2) ** math.floor(math.log2(amax))
                    q = max(-127, min(127, round(Fraction(v) / X * 64)))  # Python's round: half to even
                    want = float(q * X / 64)
                assert float(got[row, 32 * b + i]) == pytest.approx(want, rel=0, abs=0), (row, b, i)


def test_ocp_worked_values():
    """A block with max |V| = 1.0: mxfp4's shared exponent is 0 - emax(E2M1) = -2, so X = 1/4 and V / X = 4V is rounded
    to E2M1 {0, 0.5, 1, 1.5, 2, 3, 4, 6}: 0.3 -> 1.2 -> 1.0 -> 0.25; 0.55 -> 2.2 -> 2 -> 0.5; 0.7 -> 2.8 -> 3 -> 0.75;
    1.0 -> 4 -> 1.0; -0.9 -> -3.6 -> -4 -> -1.0."""
    x = torch.zeros(32)
    x[:5] = torch.tensor([0.3, 0.55, 0.7, 1.0, -0.9])
    got = mx_quant(x[None], "mxfp4")[0, :5].tolist()
    assert got == [0.25, 0.5, 0.75, 1.0, -1.0]


def test_minifloat_grid_worked_by_hand():
    e2m1 = round_minifloat(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, 0.26]), "e2m1").tolist()
    # ties to the even mantissa: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; 7 saturates at 6
    assert e2m1 == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, 0.5]
    assert round_minifloat(torch.tensor([8.0, 7.6, 7.4, 0.0625, 0.09]), "e2m3").tolist() == [7.5, 7.5, 7.5, 0.0, 0.125]
    assert round_minifloat(torch.tensor([30.0, 26.0, 0.03125, 0.05]), "e3m2").tolist() == [28.0, 24.0, 0.0, 0.0625]


@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_minifloat_equals_torch_float8_casts(fmt, dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(20000, generator=g) * torch.logspace(-9, 4, 20000)
    x = x[x.abs() <= torch.finfo(dtype).max]  # in range: the cast is round-to-nearest-even there
    assert torch.equal(round_minifloat(x, fmt), x.to(dtype).float())


def test_asym_against_numpy():
    g = np.random.default_rng(5)
    x = g.normal(size=(6, 40)) * 3 + 1
    lo, hi = x.min(1, keepdims=True), x.max(1, keepdims=True)
    for bits in (2, 4):
        scale = (hi - lo) / (2**bits - 1)
        want = np.clip(np.round((x - lo) / scale), 0, 2**bits - 1) * scale + lo
        got = asym_quant(torch.from_numpy(x), bits, torch.from_numpy(lo), torch.from_numpy(hi)).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        assert len(np.unique(got[0])) <= 2**bits


def _gptqmodel_asym(w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """GPT-QModel's Quantizer (sym=False) per group, written from its find_params / quantize, in float64."""
    g = w.reshape(-1, group)
    lo, hi = np.minimum(g.min(1), 0), np.maximum(g.max(1), 0)
    both = (lo == 0) & (hi == 0)
    lo[both], hi[both] = -1, 1
    scale = ((hi - lo) / (2**bits - 1))[:, None]
    zero = np.round(-lo[:, None] / scale)
    q = np.clip(np.round(g / scale) + zero, 0, 2**bits - 1)
    return (scale * (q - zero)).reshape(w.shape)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_zint_is_gptqs_zero_point_grid_and_compressed_tensors_asymmetric_int(bits):
    """w=zintB/per_group:G against GPT-QModel's asymmetric quantizer written in float64 (groups spanning the row, an
    all-zero group, an all-positive group) and compressed-tensors' own asymmetric int quantization (float32: equal
    but at exact ties x / s = k + 1/2, which round(x / s + zp) rounds to even after adding an odd zero point and
    GPT-QModel's round(x / s) + zp before)."""
    from outlierscope.quant.linears.ops import quantize_weight
    from outlierscope.quant.specs.parts import parse_part

    g = torch.Generator().manual_seed(bits)
    w = (torch.randn(24, 128, generator=g) * 0.05).bfloat16().double()
    w[0, :32] = 0
    w[1, 32:64] = w[1, 32:64].abs() + 0.01
    part = parse_part(f"w=zint{bits}/per_group:32")[0]
    got = quantize_weight(w, part)
    np.testing.assert_allclose(got.numpy(), _gptqmodel_asym(w.numpy(), bits, 32), rtol=0, atol=1e-15)
    assert got[1, 32:64].min() > 0 and torch.equal(got[0, :32], torch.zeros(32, dtype=torch.float64))

    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = ct.QuantizationArgs(num_bits=bits, type="int", symmetric=False, strategy="group", group_size=32)
    w32 = w[2:].float()  # no all-zero group: compressed-tensors gives it scale eps, GPT-QModel [-1, 1]
    grouped = w32.reshape(w32.shape[0], -1, 32)  # (O, groups, G)
    scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    theirs = fake_quantize(w32, scale, zp, args)
    ours = quantize_weight(w32, part)
    ratio = grouped / scale[..., None]  # (O, groups, G)
    tie = ((ratio - ratio.floor()) == 0.5) & (zp[..., None] % 2 == 1)
    differ = (ours != theirs).reshape(grouped.shape)
    assert differ.any() and not (differ & ~tie).any()  # ties of bf16-valued weights happen at every width


def _grid_rounding(x: np.ndarray, fmt: str) -> np.ndarray:
    """Round to nearest, ties to even, saturating, written from the format's definition in float64: every
    non-negative value of the format listed (subnormals, then each binade), the nearest taken; on a tie the one of
    even index (consecutive values alternate the mantissa's last bit, from 0 at zero)."""
    f = MINIFLOATS[fmt]
    emin, m = f.emin, f.mbits
    vals = [k * 2.0 ** (emin - m) for k in range(2**m)]  # zero and the subnormals
    e = emin
    while True:
        binade = [(1 + k / 2**m) * 2.0**e for k in range(2**m)]
        vals += [v for v in binade if v <= f.max_normal]
        if binade[-1] >= f.max_normal:
            break
        e += 1
    grid = np.array(vals)
    a = np.minimum(np.abs(x), f.max_normal)
    hi = np.clip(np.searchsorted(grid, a, side="left"), 1, len(grid) - 1)
    lo = hi - 1
    dl, dh = a - grid[lo], grid[hi] - a
    idx = np.where(dl < dh, lo, np.where(dh < dl, hi, np.where(lo % 2 == 0, lo, hi)))
    out = np.copysign(grid[idx], x)
    return np.where(np.isnan(x), np.nan, out)


@pytest.mark.parametrize("fmt", list(MINIFLOATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_minifloat_rounding_equals_the_grid_definition(fmt, dtype):
    """Every path of ``round_minifloat`` (torch's FP8 cast, E2M1's comparisons, frexp's spacing) against the grid
    written out: random bit patterns over the whole float32 range, every grid value, every midpoint (ties) and the
    float32 values next to each, zeros, infinities, NaN."""
    g = torch.Generator().manual_seed(11)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    f = MINIFLOATS[fmt]
    values = torch.tensor(sorted(set(_grid_rounding(np.linspace(0, f.max_normal * 1.2, 50_000), fmt))))
    mids = (values[1:] + values[:-1]) / 2
    near = torch.cat([values, mids, values * 1.5, torch.tensor([f.max_normal * 2, 1e-30])]).float()
    near = torch.cat([near, torch.nextafter(near, torch.full_like(near, np.inf)),
                      torch.nextafter(near, torch.zeros_like(near))])
    x = torch.cat([x, near, -near, torch.tensor([0.0, -0.0, np.inf, -np.inf, np.nan])]).to(dtype)
    got = round_minifloat(x, fmt)
    want = torch.from_numpy(_grid_rounding(x.double().numpy(), fmt)).to(dtype)
    assert got.dtype == dtype
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok], want[ok]), (x[ok][got[ok] != want[ok]][:5], got[ok][got[ok] != want[ok]][:5])
    assert torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))  # -0.0 where the input was negative
