"""Linear-layer quantization against a naive float64 reference written here from each scheme's description (quantize
a linear's input token by token or sequence by sequence, its weight row by row or group by group, then x W^T + b),
applied by forward hooks of this test to the unquantized model: the whole model's outputs must agree. Element formats
come from independent references (torch's float8 casts, torchao's MX, compressed-tensors' NVFP4); w8a8 is compared
with torchao's real int8 kernel and llm-int8 with bitsandbytes where it runs."""

import math

import pandas as pd
import pytest
import torch
from torch import nn

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.apply import quantize_model
from outlierscope.quant.linears.ops import rotation, rotation_factors
from outlierscope.quant.linears.schemes import quantize_linears
from outlierscope.quant.linears.sites import linear_sites
from outlierscope.quant.specs.recipes import RECIPES
from outlierscope.quant.specs.spec import LINEAR_RECIPES, QuantSpec
from outlierscope.quant.specs.transforms import Smooth
from outlierscope.quant.weights.calibration import calibrate
from tests.quant.test_recipes import _mx_rows

# the schemes as their sources describe them: w: (format, bits, granule, size), a: the same, plus transforms
DESCRIBED = {
    "w8a8": {"w": ("fint", 8, "row", None), "a": ("fint", 8, "token", None)},
    "w8a8-restricted": {"w": ("int", 8, "row", None), "a": ("int", 8, "token", None)},
    "w8a8-sq": {"w": ("int", 8, "row", None), "a": ("int", 8, "token", None), "smooth": 0.5},
    "w4a16": {"w": ("fint", 4, "group", 128)},
    "w4a8": {"w": ("fint", 4, "group", 128), "a": ("fint", 8, "token", None)},
    "w4a4": {"w": ("int", 4, "row", None), "a": ("int", 4, "token", None)},
    "w4a4-rotated": {"w": ("int", 4, "row", None), "a": ("int", 4, "token", None), "rotate": 0},
    "fp8-dynamic": {"w": ("e4m3", None, "row", None), "a": ("e4m3", None, "token", None)},
    "mxfp4": {"w": ("mxfp4", None, "mx", None), "a": ("mxfp4", None, "mx", None)},
    "ct-mxfp4": {"w": ("ct-mxfp4", None, "mx", None), "a": ("ct-mxfp4", None, "mx", None)},
    "nvfp4": {"w": ("nvfp4", None, "mx", None), "a": ("nvfp4", None, "mx", None)},
    "llm-int8": {"w": ("int", 8, "row", None), "a": ("int", 8, "token", None), "bnb_outliers": 6.0},
    "llm-int8-paper": {"w": ("int", 8, "row", None), "a": ("int", 8, "token", None), "outliers": 6.0},
}
D_MODEL, D_FF = 256, 384  # hidden and intermediate sizes: 2 and 3 groups of 128, 8 and 12 MX blocks, 16 and 24 NVFP4 blocks


def _model(layers: int = 2):
    import transformers as tf
    from transformers import AutoModelForCausalLM

    cfg = tf.LlamaConfig(vocab_size=101, hidden_size=D_MODEL, intermediate_size=D_FF, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").double().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim == 2 and "norm" not in n:
                p.mul_(4.0)
        model.model.embed_tokens.weight[:, 7] *= 40.0  # one massive channel: LLM.int8's outliers, SmoothQuant's case
    return model


# -- the naive reference ------------------------------------------------------------------------------------------

def _elem(x: torch.Tensor, fmt: str, bits) -> torch.Tensor:
    """One granule, symmetric absmax (torch's float8 cast for FP8)."""
    amax = float(x.abs().max()) if x.numel() else 0.0
    if amax == 0:
        return x
    if fmt == "int":
        m = 2 ** (bits - 1) - 1
        return torch.round(x / (amax / m)).clamp(-m, m) * (amax / m)
    if fmt == "fint":  # compressed-tensors' symmetric grid: absmax -> (2^b - 1) / 2, codes -2^(b-1)..2^(b-1)-1
        s = amax / ((2**bits - 1) / 2)
        return torch.round(x / s).clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * s
    s = amax / 448.0
    return (x / s).to(torch.float8_e4m3fn).double() * s


def _naive_weight(w: torch.Tensor, how) -> torch.Tensor:
    fmt, bits, gran, size = how
    if gran == "mx":
        return _mx_rows(w, fmt, float(w.abs().max()) if fmt == "nvfp4" else None)
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        step = size if gran == "group" else w.shape[1]
        for c in range(0, w.shape[1], step):
            out[r, c : c + step] = _elem(w[r, c : c + step], fmt, bits)
    return out


def _naive_input(x: torch.Tensor, real: torch.Tensor, how, outliers, bnb: bool = False) -> torch.Tensor:
    """x (B, T, C): each sequence's real tokens; outlier columns (|x| >= T at a real token) kept and left out of the
    scales (``bnb``: bitsandbytes' int8_vectorwise_quant: only the elements |x| >= T leave a row's scale)."""
    fmt, bits, gran, _ = how
    out = x.clone()
    for b in range(x.shape[0]):
        idx = torch.nonzero(real[b]).view(-1)
        xs = x[b, idx]  # (t, C)
        keep = (xs.abs() >= outliers).any(0) if outliers else torch.zeros(xs.shape[1], dtype=torch.bool)
        inner = xs.masked_fill(xs.abs() >= outliers, 0) if bnb else xs.masked_fill(keep, 0)
        if gran == "mx":
            q = _mx_rows(inner, fmt, float(inner.abs().max()) if fmt == "nvfp4" else None)
        else:
            q = torch.stack([_elem(row, fmt, bits) for row in inner])
        out[b, idx] = torch.where(keep, xs, q)
    return out


def _smooth_factors(model, act_scales: dict, alpha: float) -> dict:
    """SmoothQuant's formula, per group of linears that read one norm's output (q/k/v, gate/up), in float64."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            mods = [layer.get_submodule(p) for p in group]
            w_max = torch.stack([m.weight.detach().abs().amax(0) for m in mods]).amax(0).clamp(min=1e-5)
            a = act_scales[f"model.layers.{i}.{group[0]}"].double().clamp(min=1e-5)
            s = (a**alpha / w_max ** (1 - alpha)).clamp(min=1e-5)
            out.update({f"model.layers.{i}.{p}": s for p in group})
    return out


def _reference(model, desc: dict, mask: torch.Tensor, smooth: dict | None = None):
    """Forward hooks replacing every decoder linear's output with the naive quantized product."""
    names = {m: n for n, m in model.named_modules()}
    handles = []

    def hook(mod, args, output):
        x, w = args[0], mod.weight.detach()
        s = (smooth or {}).get(names[mod])
        if s is not None:
            x, w = x / s, w * s
        if "rotate" in desc:
            r = rotation(w.shape[1], desc["rotate"], torch.float64)
            x, w = x @ r, w @ r
        if "a" in desc:
            t = desc.get("outliers") or desc.get("bnb_outliers")
            x = _naive_input(x, mask.bool(), desc["a"], t, bnb="bnb_outliers" in desc)
        if "w" in desc:
            w = _naive_weight(w, desc["w"])
        return x @ w.T + (mod.bias if mod.bias is not None else 0)

    for layer in model.model.layers:
        for m in layer.modules():
            if isinstance(m, nn.Linear):
                handles.append(m.register_forward_hook(hook))
    return handles


def _batch(T: int = 40):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 101, (3, T), generator=g)
    ids[:, ::9] = 7 % 101  # token 7 often: its embedding has the massive channel
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, -11:] = 0  # right padding
    mask[2, :6] = 0
    return ids, mask


def _positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _act_scales(model, path):
    """A SmoothQuant act_scales.pt made here: per decoder linear, the max |x| per input channel on a batch."""
    scales, handles = {}, []
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear) and ".layers." in n:
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, n=n: scales.__setitem__(n, args[0].abs().amax((0, 1)).float())))
    with torch.no_grad():
        model(input_ids=torch.randint(1, 101, (2, 30), generator=torch.Generator().manual_seed(9)))
    for h in handles:
        h.remove()
    torch.save(scales, path)
    return scales


@pytest.mark.parametrize("name", list(DESCRIBED))
def test_scheme_equals_naive_linear(name, tmp_path):
    """Every named scheme against the naive reference, whole model (2 layers, float64), with padding."""
    model = _model()
    desc = DESCRIBED[name]
    ids, mask = _batch()
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))
    spec, smooth, calib = QuantSpec.parse(name), None, None
    if "smooth" in desc:
        path = tmp_path / "act_scales.pt"
        smooth = _smooth_factors(model, {k: v.double() for k, v in _act_scales(model, path).items()}, desc["smooth"])
        spec = QuantSpec.parse(f"{name}; calib:{path}")
        calib = calibrate(model, None, spec)
    with torch.no_grad():
        handles = _reference(model, desc, mask, smooth)
        try:
            with quantize_model(model, "none"):  # our attention function: eager's float64 NaN at left padding
                want = model(**kw).logits
        finally:
            for h in handles:
                h.remove()
        with quantize_model(model, spec, calibration=calib):
            got = model(**kw).logits
        with quantize_model(model, "none"):
            plain = model(**kw).logits
    real = mask.bool()
    assert (got[real] - plain[real]).abs().max() > 1e-3  # quantization visibly changes the outputs
    tol = 1e-5 if name == "nvfp4" else 1e-9  # NVFP4 is float32 arithmetic: we multiply by 1/scale, compressed-tensors divides
    torch.testing.assert_close(got[real], want[real], rtol=tol, atol=tol)


def test_every_linear_recipe_is_described():
    assert set(DESCRIBED) == set(LINEAR_RECIPES)
    for name in LINEAR_RECIPES:
        assert RECIPES[name].not_modelled and RECIPES[name].source


@pytest.mark.parametrize("text", ["smooth:0.5; calib:{scales}", "rotate:3", "smooth:0.8; rotate:1; calib:{scales}",
                                  "smooth:0.5; linears:mlp.*; calib:{scales}", "rotate:2; linears:mlp.down_proj"])
def test_mitigations_change_nothing_unquantized(text, tmp_path):
    """SmoothQuant's migration and the rotation alone (or on linears left unquantized): float rounding only."""
    model = _model()
    spec = QuantSpec.parse(text.format(scales=tmp_path / "s.pt"))
    _act_scales(model, tmp_path / "s.pt")
    calib = calibrate(model, None, spec) if spec.get(Smooth) is not None else None
    ids, mask = _batch()
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))
    with torch.no_grad():
        with quantize_model(model, "none"):
            plain = model(**kw).logits
        with quantize_model(model, spec, calibration=calib):
            got = model(**kw).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], plain[real], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("d", [64, 256, 12, 20, 28, 36, 384, 576, 1536])
def test_rotation_is_an_orthonormal_hadamard(d):
    r = rotation(d, 7, torch.float64)
    torch.testing.assert_close(r @ r.T, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(r.abs(), torch.full_like(r, 1 / math.sqrt(d)))  # +-1/sqrt(d): a scaled Hadamard matrix


@pytest.mark.parametrize("d", [1, 8, 12, 20, 28, 36, 64, 256, 384, 576, 1536, 4096])
def test_rotation_factors_apply_the_dense_rotation(d):
    """``rotate:`` multiplies by the rotation's two Hadamard factors: in float64 the dense product x @ R up to
    rounding (R the dense matrix, itself checked against scipy and the seed's signs below); float32 and bfloat16 inputs
    come back in their dtype, computed in float32; the input is never changed."""
    r = rotation_factors(d, 7)
    dense = rotation(d, 7, torch.float64)
    assert torch.equal(r.matrix(), dense)
    assert r.outer.shape[0] * r.inner.shape[0] == d and r.outer.shape[0] + r.inner.shape[0] <= max(d, 2 * math.isqrt(d) + 36)
    x = torch.randn(2, 9, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d)) * 3
    before = x.clone()
    want = x @ dense  # (2, 9, d)
    torch.testing.assert_close(r.apply(x), want, rtol=0, atol=1e-13 * math.sqrt(d))
    assert torch.equal(x, before)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = r.apply(xd)
        assert got.dtype == dtype and got.shape == x.shape
        exact = (xd.double() @ dense).to(torch.float32)
        tol = 1e-5 * math.sqrt(d) if dtype == torch.float32 else 0.0
        torch.testing.assert_close(got.float(), exact.to(dtype).float(), rtol=1e-2 if dtype == torch.bfloat16 else 0,
                                   atol=tol + (0.05 if dtype == torch.bfloat16 else 0))


@pytest.mark.parametrize("d", [64, 256, 12, 20, 28, 384, 576])
def test_rotation_signs_sit_on_the_input_side(d):
    """QuaRot's randomized Hadamard is diag(signs) . H: row i of every seed's matrix is the same Hadamard row times
    the seed's i-th sign (drawn as the test draws it); for a power of 2, H is scipy's Sylvester matrix."""
    from scipy.linalg import hadamard as scipy_hadamard

    def signs(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 2, (d,), generator=g, dtype=torch.float64) * 2 - 1

    unsigned = [rotation(d, seed, torch.float64) * signs(seed)[:, None] * math.sqrt(d) for seed in (0, 7, 123)]
    for h in unsigned[1:]:
        torch.testing.assert_close(h, unsigned[0], rtol=0, atol=1e-12)
    if d & (d - 1) == 0:
        torch.testing.assert_close(unsigned[0], torch.tensor(scipy_hadamard(d), dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("text", ["w4a4; rotate:{seed}", "a=int8/per_token; w=int4/per_group:64; rotate:{seed}"])
def test_rotation_seed_changes_what_is_quantized(text):
    """Two seeds: the same outputs unquantized (float rounding), different quantized outputs (a seed whose signs
    only flipped the rotated values would quantize alike: a symmetric grid commutes with a sign flip)."""
    model = _model()
    ids, mask = _batch()
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))
    real = mask.bool()
    out = {}
    with torch.no_grad():
        for seed in (0, 7):
            with quantize_model(model, text.format(seed=seed)):
                out[seed] = model(**kw).logits[real]
            with quantize_model(model, f"rotate:{seed}"):
                out[f"plain{seed}"] = model(**kw).logits[real]
    torch.testing.assert_close(out["plain0"], out["plain7"], rtol=1e-10, atol=1e-10)
    assert (out[0] - out[7]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["w8a8-restricted", "nvfp4", "llm-int8", "w=int4/per_group:64; a=int4/per_tensor",
                                  "w=asym4/per_group:128; a=asym8/per_tensor", "a=e4m3/per_tensor"])
def test_a_sequence_alone_or_padded_in_a_batch(name):
    """Per-sequence statistics (per_tensor scales, NVFP4's activation scale, outlier columns) see only that
    sequence's real tokens: alone, left-padded and right-padded in a batch give the same outputs (float64).

    The token-local control is ``w8a8-restricted`` (absmax / 127): ``w8a8``'s full-range grid (absmax / 127.5, as
    compressed-tensors) puts every token's largest input exactly on a rounding tie (127.5 steps), so a last-bit
    difference of that input, which left padding makes in attention's float64 sums on some processors (AVX2), moves it
    a whole step: measured here on an AMD EPYC without AVX-512 (token 57 of layer 0's o_proj input)."""
    model = _model()
    g = torch.Generator().manual_seed(11)
    seq, n, L = torch.randint(1, 101, (60,), generator=g), 60, 75
    seq[::7] = 7
    with torch.no_grad(), quantize_model(model, name):
        alone = model(input_ids=seq[None]).logits[0]
        for side in ("left", "right"):
            ids = torch.randint(1, 101, (3, L), generator=g)
            ids[:, 3] = 7  # the padding holds the massive token too: it must not enter a scale
            mask = torch.ones(3, L, dtype=torch.long)
            sl = slice(L - n, L) if side == "left" else slice(0, n)
            ids[1, sl], mask[1] = seq, 0
            mask[1, sl] = 1
            got = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits[1, sl]
            torch.testing.assert_close(got, alone, rtol=1e-9, atol=1e-9, msg=f"{name}, {side}-padded")


def test_weights_are_restored_exactly_and_hooks_removed():
    model = _model()
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    classes = {n: type(m) for n, m in model.named_modules()}
    with torch.no_grad(), quantize_model(model, "w4a4-rotated") as spec:
        q = model.model.layers[0].self_attn.q_proj
        assert not torch.equal(q.weight, before["model.layers.0.self_attn.q_proj.weight"][1])  # quantized inside
        model(input_ids=torch.ones(1, 5, dtype=torch.long))
    assert str(spec) == "a=int4/per_token; w=int4/per_channel; rotate:0"
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]), n  # the same Parameter, the same values
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def _w8a8_case():
    torch.manual_seed(0)
    lin = nn.Linear(D_FF, D_MODEL, bias=True).float()
    x = torch.randn(4, 33, D_FF) * torch.linspace(0.1, 8, D_FF)  # channels of very different ranges
    return lin, x


@pytest.mark.parametrize("name,qmax,lo", [("w8a8-restricted", 127.0, -127), ("w8a8", 127.5, -128)])
def test_w8a8_equals_an_int8_kernel(name, qmax, lo):
    """torchao's integer kernel ``int_scaled_matmul`` (int8 x int8 with int32 accumulation, then the per-token scale;
    on CPU) fed with the int8 codes of per-token activations and per-channel weights (absmax / 127 onto [-127, 127],
    or the full-range absmax / 127.5 onto [-128, 127]): our emulation's outputs agree within float32 summation
    differences (ours sums dequantized float32 products, the kernel integers)."""
    intmm = pytest.importorskip("torchao.kernel.intmm")
    lin, x = _w8a8_case()
    holder = nn.Sequential(lin)
    with torch.no_grad():
        with _linears_of(holder, QuantSpec.parse(name)):
            got = holder(x)
        plain = holder(x)
        xs = x.reshape(-1, D_FF).abs().amax(-1, keepdim=True) / qmax  # (M, 1)
        ws = lin.weight.abs().amax(-1) / qmax  # (N,)
        xq = torch.round(x.reshape(-1, D_FF) / xs).clamp(lo, 127).to(torch.int8)  # (M, K)
        wq = torch.round(lin.weight / ws[:, None]).clamp(lo, 127).to(torch.int8)  # (N, K)
        want = (intmm.int_scaled_matmul(xq, wq.T.contiguous(), xs.contiguous()) * ws + lin.bias).reshape(got.shape)
    err = (got - want).abs().max() / want.abs().max()
    moved = (plain - want).abs().max() / want.abs().max()
    assert err < 2e-6 and moved > 1e-3, (float(err), float(moved))


def test_torchao_w8a8_is_our_w8a8_but_at_ties():
    """torchao's Int8DynamicActivationInt8WeightConfig maps absmax to 127.5 (codes -128..127) as compressed-tensors
    and our ``w8a8``; it multiplies by the scale's reciprocal where we (and compressed-tensors) divide, so a code
    differs by one only where x * (1 / s) and x / s round across a .5 tie (rare). Its output is its codes' exact
    integer product; ours is within those ties of it, and the restricted grid (absmax / 127) is visibly further."""
    quant_api = pytest.importorskip("torchao.quantization")
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import _choose_quant_func_and_quantize_tensor

    lin, x = _w8a8_case()
    ref = nn.Sequential(nn.Linear(D_FF, D_MODEL)).float()
    ref[0].load_state_dict(lin.state_dict())
    quant_api.quantize_(ref, quant_api.Int8DynamicActivationInt8WeightConfig())
    w = ref[0].weight
    with torch.no_grad():
        a = _choose_quant_func_and_quantize_tensor(x, w.act_quant_kwargs)

        def codes(t):  # (rows, K) -> the 127.5 grid's codes, float64
            return torch.round(t.double() / (t.double().abs().amax(-1, keepdim=True) / 127.5)).clamp(-128, 127)

        for got, want in ((a.qdata.reshape(-1, D_FF), codes(x.reshape(-1, D_FF))), (w.qdata, codes(lin.weight))):
            diff = (got.double() - want).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
        out = ref(x).double().reshape(-1, D_MODEL)
        exact = (a.qdata.reshape(-1, D_FF).double() * a.scale.reshape(-1, 1).double()) @ \
            (w.qdata.double() * w.scale.double()).T + lin.bias.double()
        torch.testing.assert_close(out, exact, rtol=0, atol=1e-5 * float(exact.abs().max()))
        holder = nn.Sequential(lin)
        ours = {}
        for name in ("w8a8", "w8a8-restricted"):
            with _linears_of(holder, QuantSpec.parse(name)):
                ours[name] = holder(x).double().reshape(-1, D_MODEL)
    near = (ours["w8a8"] - exact).abs().max()
    assert near < 5e-3 * exact.abs().max()  # ties only
    assert (ours["w8a8-restricted"] - exact).abs().max() > 3 * near  # the grid: visibly further


class _Holder(nn.Module):
    """A one-layer 'decoder' around a module, for quantize_linears outside a transformers model."""


def _linears_of(seq: nn.Sequential, spec):
    from unittest import mock

    from outlierscope.quant.linears import schemes as L

    sites = [L.LinearSite(0, "0", "0", seq[0])]
    return _patched(mock, L, seq, spec, sites)


def _patched(mock, L, seq, spec, sites):
    import contextlib

    @contextlib.contextmanager
    def ctx():
        with mock.patch.object(L, "linear_sites", lambda model, spec: sites), \
                mock.patch.object(L, "trunk", lambda model: seq), L.quantize_linears(seq, spec):
            yield

    return ctx()


def _llm_int8_case():
    """A linear and inputs with two outlier columns whose other elements are large too (|x| up to 5.5 < 6): where
    bitsandbytes' row scales (outlier elements out) and the paper's (outlier columns out) differ."""
    torch.manual_seed(1)
    lin = nn.Linear(D_FF, D_MODEL, bias=False).float()
    x = torch.randn(1, 20, D_FF)
    x[0, :, 17] = torch.linspace(-5.5, 5.5, 20)
    x[0, :, 101] = torch.linspace(4.0, -4.0, 20)
    x[0, 3, 17] = 9.0
    x[0, 8, 101] = -7.5  # two outlier columns
    return lin, x


@pytest.mark.parametrize("name", ["llm-int8", "llm-int8-paper"])
def test_llm_int8_rules_against_float64(name):
    """LLM.int8 (threshold 6), float64 written from the sources: the outlier columns X_O W_O in full precision against
    the int8 weights (vector-wise, both parts), the rest int8 per row with the row's scale over the elements
    |x| < 6 (bitsandbytes' int8_vectorwise_quant) or over the non-outlier columns (the paper, sec. 3.2)."""
    lin, x = _llm_int8_case()
    holder = nn.Sequential(lin)
    with torch.no_grad(), _linears_of(holder, QuantSpec.parse(name)):
        got = holder(x)[0].double()
    xd, w = x[0].double(), lin.weight.detach().double()
    cols = (xd.abs() >= 6.0).any(0)
    assert int(cols.sum()) == 2
    wq = torch.stack([_elem(row, "int", 8) for row in w])
    inner = xd.masked_fill(xd.abs() >= 6.0, 0) if name == "llm-int8" else xd.masked_fill(cols, 0)
    amax = inner.abs().amax(-1, keepdim=True)  # (T, 1): each row's scale
    xi = (torch.round(inner / (amax / 127)).clamp(-127, 127) * (amax / 127)).masked_fill(cols, 0)
    want = xi @ wq.T + xd[:, cols] @ wq[:, cols].T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_llm_int8_equals_bitsandbytes():
    """``llm-int8`` against bitsandbytes' Linear8bitLt(threshold=6.0) itself on this CPU (eval mode: training mode
    dequantizes the weights and skips the decomposition), on float16 values (bitsandbytes quantizes float16 copies):
    within its float16 arithmetic, a tolerance that the paper's rule (``llm-int8-paper``) and plain int8 exceed."""
    bnb = pytest.importorskip("bitsandbytes")
    lin, x = _llm_int8_case()
    holder = nn.Sequential(lin)
    with torch.no_grad():
        lin.weight.copy_(lin.weight.half().float())
        x = x.half().float()
        got = {}
        for name in ("llm-int8", "llm-int8-paper", "w8a8-restricted"):
            with _linears_of(holder, QuantSpec.parse(name)):
                got[name] = holder(x)[0].double()
        ref = bnb.nn.Linear8bitLt(D_FF, D_MODEL, bias=False, has_fp16_weights=False, threshold=6.0)
        ref.load_state_dict(lin.state_dict())
        ref = ref.to("cpu").eval()
        try:
            want = ref(x)[0].double()
        except Exception as e:  # noqa: BLE001 - a backend that does not run here
            pytest.skip(f"bitsandbytes Linear8bitLt does not run here ({type(e).__name__})")
    tol = 2e-3 * float(want.abs().max())
    torch.testing.assert_close(got["llm-int8"], want, rtol=0, atol=tol)
    for other in ("llm-int8-paper", "w8a8-restricted"):
        assert (got[other] - want).abs().max() > 2 * tol, other  # the rule is what agrees


@pytest.mark.parametrize("text", ["w8a8", "w8a8-sq", "w8a8; kivi-4bit", "w=int4/per_group:128; a=int8/per_token",
                                  "a=e4m3/static; w=e4m3/per_tensor; calib:x.txt", "w=nvfp4; linears:mlp.*,self_attn.o_proj",
                                  "w4a4-rotated; layers:0-3", "a=mxfp4; w=mxfp6_e2m3; outliers:4.5"])
def test_text_form_round_trips(text):
    spec = QuantSpec.parse(text)
    assert QuantSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("text,msg", [("w8a9", "did you mean w8a8"), ("a=int8/per_channel", "granularity must be one of"),
                                      ("w=int8/per_token", "granularity must be one of per_channel"),
                                      ("smooth:1.5", "alpha in 0..1"), ("outliers:6", "add an a= part"),
                                      ("w8a8; w4a8", "quantized twice"), ("w8a8; calib:x.pt", "calib:SOURCE is read"),
                                      ("w8a8; linears:mlp.dwn_proj", "did you mean mlp.down_proj"),
                                      ("w=int4/per_group:100", "not a multiple of the group size 100"),
                                      ("w8a8-sq", "need a calibration")])
def test_bad_specs_are_one_line(text, msg):
    model = _model()
    with pytest.raises(OutlierscopeError, match=msg):
        with quantize_model(model, text), torch.no_grad():
            model(input_ids=torch.ones(1, 4, dtype=torch.long))


def test_a_linear_group_is_checked_against_in_features_not_head_dim():
    """head_dim 64 here, the linears' inputs 256 and 384: a weight group of 128 divides every input (accepted before
    anything runs), a key group of 128 does not divide head_dim (refused), and a weight group of 96 does not divide
    256 (refused, naming the linear)."""
    from outlierscope.quant.apply import check_spec

    cfg = _model().config
    check_spec(QuantSpec.parse("w=int4/per_group:128; a=int8/per_token"), cfg)
    with pytest.raises(OutlierscopeError, match="head_dim 64 is not a multiple of the group size 128"):
        check_spec(QuantSpec.parse("k=int4/per_group:128"), cfg)
    with pytest.raises(OutlierscopeError, match="q_proj has 256 inputs"):
        check_spec(QuantSpec.parse("w=int4/per_group:96"), cfg)


def test_linear_patterns_and_layers_choose_the_sites():
    model = _model(layers=3)
    sites = linear_sites(model, QuantSpec.parse("w8a8; linears:mlp.*,self_attn.o_proj; layers:0,2"))
    assert [(s.layer, s.path) for s in sites] == [(i, p) for i in (0, 2) for p in
                                                  ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert sites[0].name == "model.layers.0.self_attn.o_proj"
    with quantize_linears(model, QuantSpec.parse("w4a16; linears:mlp.down_proj")):
        assert model.model.layers[1].mlp.up_proj.weight is model.model.layers[1].mlp.up_proj.weight  # untouched


def test_linear_error_against_each_linears_own_product():
    """LinearErrorStats through quantize_model: per layer and linear, the mean and max over real tokens of
    ||y~ - x W^T - b|| / ||x W^T + b||, x the input the linear was given, computed here by hooks of the test; the
    same numbers split over virtual shards and merged from shard tables."""
    from outlierscope.analysis.linear_error import LinearErrorStats

    model = _model()
    kinds = [p for p, m in model.model.layers[0].named_modules() if isinstance(m, nn.Linear)]
    ids, mask = _batch()
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))
    seen, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        for p in kinds:
            m = layer.get_submodule(p)
            handles.append(m.register_forward_pre_hook(lambda mod, a, key=(i, p): seen.__setitem__(key, [a[0]])))
            handles.append(m.register_forward_hook(lambda mod, a, out, key=(i, p): seen[key].append(out)))
    whole, parts = LinearErrorStats(2, kinds), [LinearErrorStats(2, kinds) for _ in range(2)]
    with torch.no_grad():
        with quantize_model(model, "w4a8", linear_error=whole):
            model(**kw)
        want = {}
        for (i, p), (x, y) in seen.items():
            m = model.model.layers[i].get_submodule(p)
            ref = x @ m.weight.T + (m.bias if m.bias is not None else 0)
            rel = ((y - ref).norm(dim=-1) / ref.norm(dim=-1))[mask.bool()]  # (real tokens,)
            want[(i, p)] = (len(rel), float(rel.mean()), float(rel.max()))
        for b, part in enumerate(parts):  # two batches, two virtual shards
            part.set_shard(b + 3)
            sl = slice(b, b + 2) if b == 0 else slice(2, 3)
            with quantize_model(model, "w4a8", linear_error=part):
                model(**{k: v[sl] for k, v in kw.items()})
    for h in handles:
        h.remove()
    got = whole.table()
    assert len(got) == 2 * len(kinds)
    for r in got.itertuples():
        n, mean, mx = want[(r.layer, r.linear)]
        assert r.tokens == n and r.rel_err_mean == pytest.approx(mean, rel=1e-9) and r.rel_err_max == pytest.approx(mx, rel=1e-9)
    merged = LinearErrorStats.from_shard_tables([p.shard_table() for p in parts], 2).table()
    pd.testing.assert_frame_equal(merged, parts[0].merge(parts[1]).table())
    pd.testing.assert_frame_equal(merged, got, rtol=1e-9)


def test_the_lm_head_only_when_named():
    """linears:lm_head quantizes the output embeddings alone (per-token int8 inputs, per-row int8 weights, against a
    float64 computation here from the unquantized trunk's last hidden state); '*' never takes it; a tied head keeps
    its tie and leaves the embedding unquantized; a per-sequence activation is refused for it."""
    import transformers as tf
    from transformers import AutoModelForCausalLM

    model = _model()
    assert all(s.path != "lm_head" for s in linear_sites(model, QuantSpec.parse("w8a8; linears:*")))
    ids, mask = (t[:2] for t in _batch())  # unpadded and right-padded (an eager left-padded row is NaN here)
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))

    def q(t):  # (rows, K) int8 absmax / 127 per row, float64
        s = t.abs().amax(-1, keepdim=True) / 127
        return torch.round(t / s) * s

    with torch.no_grad():
        with quantize_model(model, "none"):  # the same attention function as below (a float64 softmax), nothing quantized
            h = model.model(**kw).last_hidden_state  # (B, T, D) float64
        w = model.lm_head.weight
        want = (q(h.reshape(-1, D_MODEL)) @ q(w).T).reshape(*h.shape[:2], -1)  # (B, T, V)
        with quantize_model(model, "w8a8-restricted; linears:lm_head") as _:
            got = model(**kw).logits
        plain = model(**kw).logits
    real = mask.bool()  # (B, T): padded positions are no scored position
    got, want, plain = got[real], want[real], plain[real]  # (N, V)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9 * float(want.abs().max()))
    assert (got - plain).abs().max() > 1e-3 * plain.abs().max()
    cfg = tf.LlamaConfig(vocab_size=101, hidden_size=D_MODEL, intermediate_size=D_FF, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    tied = AutoModelForCausalLM.from_config(cfg).double().eval()
    emb = tied.model.embed_tokens.weight
    with torch.no_grad(), quantize_model(tied, "w=int4/per_channel; linears:lm_head"):
        assert torch.equal(tied.model.embed_tokens(ids), emb[ids])  # the embedding reads the untouched weight
        assert not torch.equal(tied.lm_head.weight, emb)
    assert tied.lm_head.weight is emb and tied.model.embed_tokens.weight is emb
    with pytest.raises(OutlierscopeError, match="linears:lm_head reads the scored positions"):
        with quantize_model(model, "a=int8/per_tensor; linears:lm_head"):
            pass


def test_calibration_record_names_the_text_and_the_tokens_the_calibration_read(tmp_path):
    """A GPTQ spec's record: the calibration file's sha256 (hashlib on its bytes, here), samples x seqlen tokens, and
    the sha256 of exactly the token ids its calibration fed the model (seen by a hook on the embedding during a real
    calibration); a spec that calibrates nothing has no record."""
    import hashlib

    from outlierscope.models.loading import load_model
    from outlierscope.quant.weights.calibration import calibration_for, calibration_record

    text = tmp_path / "calib.txt"
    text.write_text("\n\n".join(f"Paragraph {i} of a calibration text about rivers and hills." * 3 for i in range(40)))
    lm = load_model("pair-tiny:transformer")
    spec = QuantSpec.parse(f"w=fint4/per_group:64; gptq:samples=3,seqlen=32; calib:{text}")
    rec = calibration_record(spec, lm.tokenizer, lm.model.config.max_position_embeddings)
    assert rec["source"] == str(text) and rec["sha256"] == hashlib.sha256(text.read_bytes()).hexdigest()
    assert (rec["samples"], rec["seqlen"], rec["tokens"]) == (3, 32, 96)
    fed = []
    h = lm.model.model.embed_tokens.register_forward_hook(lambda m, a, o: fed.append(a[0].clone()))
    try:
        calibration_for(lm.model, lm.tokenizer, spec)
    finally:
        h.remove()
    assert hashlib.sha256(torch.cat(fed).numpy().tobytes()).hexdigest() == rec["tokens_sha256"]
    assert calibration_record(QuantSpec.parse("w=fint4/per_group:64"), lm.tokenizer) is None


def _bf16_float32_model():
    """``_model`` in float32 with bf16-valued weights (real checkpoints: ties hide in random float32 values)."""
    model = _model().float()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def _calibrated_case(name: str, tmp_path):
    """(model, spec, calibration) of a scheme on :func:`_bf16_float32_model`: a smoothing spec calibrated on an
    act_scales.pt made here."""
    model = _bf16_float32_model()
    spec, calib = QuantSpec.parse(name), None
    if spec.get(Smooth) is not None:
        _act_scales(model, tmp_path / "act_scales.pt")
        spec = QuantSpec.parse(f"{name}; calib:{tmp_path / 'act_scales.pt'}")
        calib = calibrate(model, None, spec)
    return model, spec, calib


@pytest.mark.parametrize("name", ["w4a4-rotated", "nvfp4", "w8a8-sq", "w=int4/per_group:64", "mxfp4"])
def test_weights_are_quantized_once_per_context_and_equal_every_forward(name, tmp_path, monkeypatch):
    """A held weight: quantized once, when the context is entered, and every forward's bytes equal those of the path
    that quantizes again at each forward (float32, bf16-valued weights, the same batch)."""
    from outlierscope.quant.linears import schemes as L

    model, spec, calib = _calibrated_case(name, tmp_path)
    calls = []
    compute = L._WeightTransform.compute
    monkeypatch.setattr(L._WeightTransform, "compute", lambda self, w: calls.append(id(self)) or compute(self, w))
    ids, mask = _batch()
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))
    with torch.no_grad():
        outs = {}
        for hold in (False, True):
            calls.clear()
            with quantize_model(model, spec, calibration=calib, hold_weights=hold) as s:
                outs[hold] = [model(**kw).logits for _ in range(3)]
                sites = linear_sites(model, s)
            assert len(calls) == len(sites) * (1 if hold else 4), hold  # once per linear, or at entry (torch checks
            # the parametrization once) and every forward
    assert len(sites) == 14
    for a, b in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a, b)


def test_a_held_weight_is_quantized_again_when_the_weight_changes():
    """An in-place change or a new dtype of the original weight inside the context: quantized again, as a fresh
    context would (the reference: a new context on the changed model)."""
    model = _bf16_float32_model()
    ids = torch.randint(1, 101, (2, 20), generator=torch.Generator().manual_seed(3))
    q = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        with quantize_model(model, "w=int4/per_group:64"):
            before = model(input_ids=ids).logits
            q.parametrizations.weight.original.mul_(0.5)
            changed = model(input_ids=ids).logits
            model.double()
            wider = model(input_ids=ids).logits
        with quantize_model(model, "w=int4/per_group:64"):
            fresh64 = model(input_ids=ids).logits
        model.float()
        with quantize_model(model, "w=int4/per_group:64"):
            fresh = model(input_ids=ids).logits
    assert not torch.equal(before, changed)
    assert torch.equal(changed, fresh)
    assert wider.dtype == torch.float64 and torch.equal(wider, fresh64)


@pytest.mark.parametrize("name", ["w4a4-rotated", "nvfp4", "w8a8-sq", "llm-int8", "fp8-dynamic"])
def test_an_input_read_by_several_linears_is_quantized_once(name, tmp_path, monkeypatch):
    """q/k/v and gate/up read one tensor: its smoothing, rotation and quantization run once per forward (4 inputs a
    layer, not 7) and every byte equals the path that transforms it for each linear (float32, bf16-valued weights,
    padding on both sides)."""
    from outlierscope.quant.linears import schemes as L

    model, spec, calib = _calibrated_case(name, tmp_path)
    calls = []
    transform = L._transform_input
    monkeypatch.setattr(L, "_transform_input", lambda *a: calls.append(1) or transform(*a))
    ids, mask = _batch()
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))
    outs = {}
    with torch.no_grad():
        for shared in (True, False):
            if not shared:
                monkeypatch.setattr(L._LastInput, "get", lambda self, x, how: None)
            calls.clear()
            with quantize_model(model, spec, calibration=calib):
                outs[shared] = model(**kw).logits
            assert len(calls) == (4 if shared else 7) * 2, shared  # 2 layers
    assert torch.equal(outs[True], outs[False])


def test_held_weights_by_default_only_where_they_fit():
    """``hold_weights=None``: held on the CPU; on a GPU only when the quantized linears' bytes on it are at most half
    its free memory (a fake free-memory function, weights on the meta device as stand-ins of other devices); offloaded
    or unknown devices: not held. The default path on the CPU holds (quantized once)."""
    from outlierscope.quant.linears.schemes import holds_fit

    model = _bf16_float32_model()
    sites = linear_sites(model, QuantSpec.parse("w8a8"))
    need = sum(s.module.weight.numel() * 4 for s in sites)
    assert holds_fit(sites, free=lambda d: 0)  # CPU: always
    with torch.device("meta"):
        meta = _model().float()
    msites = linear_sites(meta, QuantSpec.parse("w8a8"))
    assert not holds_fit(msites, free=lambda d: 10**15)  # meta (offloaded): never

    class _Cuda:  # a device of type cuda with the CPU weights' sizes
        type = "cuda"

    fake = [type("S", (), {"module": type("M", (), {"weight": type("W", (), {
        "device": _Cuda, "numel": s.module.weight.numel, "element_size": s.module.weight.element_size})})})
        for s in sites]
    assert holds_fit(fake, free=lambda d: 2 * need)
    assert not holds_fit(fake, free=lambda d: 2 * need - 1)
