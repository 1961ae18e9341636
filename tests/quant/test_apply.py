import pytest
import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.capture import capture
from outlierscope.models.presets import PairConfig
from outlierscope.quant.apply import quantize_model
from outlierscope.quant.specs.spec import QuantSpec


@pytest.fixture(scope="module", params=["transformer", "diff"])
def model(request):
    cfg = PairConfig(name="q", vocab_size=211, n_layers=2, hidden_size=64, n_heads=4, seq_len=64)
    m = cfg.build(request.param, seed=0).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "proj" in n:
                p.mul_(4)  # sharper attention, so that quantization is visible
    m.set_attn_implementation("eager")
    return m


IDS = torch.randint(0, 211, (3, 40), generator=torch.Generator().manual_seed(0))


def _logits(model, spec=None):
    with torch.no_grad():
        if spec is None:
            return model(input_ids=IDS).logits
        with quantize_model(model, spec):
            return model(input_ids=IDS).logits


def test_16_bits_is_exact(model):
    assert torch.equal(_logits(model, QuantSpec.logits(bits=16)), _logits(model))
    assert model.config._attn_implementation == "eager"


GRAN_DIMS = {"per_tensor": (1, 2, 3), "per_head": (2, 3), "per_row": (3,)}


def _reference_quant(x, valid, bits, granularity):
    """Independent float64 absmax quantization: scale = max |x[valid]| / (2^(bits-1) - 1) over the granule."""
    x = x.double()
    qmax = 2 ** (bits - 1) - 1
    scale = x.abs().masked_fill(~valid, 0).amax(GRAN_DIMS[granularity], keepdim=True) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe).clamp(-qmax, qmax) * safe  # round half to even
    return torch.where(valid & (scale > 0), q, x), scale


@pytest.mark.parametrize("granularity", ["per_tensor", "per_head", "per_row"])
@pytest.mark.parametrize("bits", [8, 4, 3])
def test_quantized_attention_equals_float64_reference(model, granularity, bits):
    """The unquantized logits (observed before the quantizer), quantized independently in float64 over the valid
    entries of each granule, then softmax over the allowed keys and @ V: equal to what the layer computes."""
    ids = IDS.clone()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: masked keys and padding query rows must not enter any scale
    layer = 1
    attn = model.model.layers[layer].self_attn
    raw, quant, got = {}, {}, {}
    hooks = [attn.v_proj.register_forward_hook(lambda m, a, o: got.__setitem__("v", o)),
             attn.o_proj.register_forward_pre_hook(lambda m, a: got.__setitem__("o_in", a[0]))]
    keep = lambda d: (lambda o: d.__setitem__(o.point.layer, (o.x.clone(), o.valid.clone())))  # noqa: E731
    spec = QuantSpec.logits(bits=bits, granularity=granularity)
    try:
        with torch.no_grad(), capture(model, "layers.*.attn.logits", reducers=keep(raw)), \
                quantize_model(model, spec), capture(model, "layers.*.attn.logits", reducers=keep(quant)):
            model(input_ids=ids, attention_mask=mask)
    finally:
        for h in hooks:
            h.remove()
    x, valid = raw[layer]
    valid = valid.expand_as(x)
    ref, scale = _reference_quant(x, valid, bits, granularity)
    torch.testing.assert_close(quant[layer][0].double(), ref, rtol=1e-6, atol=1e-6)
    # the grid: every valid quantized value is an integer multiple of max|x[valid]| / qmax of its granule
    k = quant[layer][0].double() / torch.where(scale > 0, scale, torch.ones_like(scale))
    assert torch.allclose(k[valid], k[valid].round(), atol=1e-4)
    assert k[valid].abs().amax().item() == pytest.approx(2 ** (bits - 1) - 1)  # the absmax lands on the top level
    if model.config.model_type == "diffllama":
        return  # the differential combination of the two maps is tested against the paper's formula elsewhere
    B, H, T, S = x.shape
    hkv = model.config.num_key_value_heads
    v = got["v"].double().view(B, T, hkv, -1).transpose(1, 2).repeat_interleave(H // hkv, 1)  # (B, H, S, d)
    causal = torch.ones(T, S, dtype=torch.bool).tril()
    allowed = causal & mask.bool()[:, None, None, :]  # (B, 1, T, S)
    probs = torch.softmax(ref.masked_fill(~allowed, -torch.inf), -1)
    out = (probs @ v).transpose(1, 2).reshape(B, T, -1)  # (B, T, H*d)
    rows = mask.bool()  # real query rows
    torch.testing.assert_close(got["o_in"].double()[rows], out[rows], rtol=1e-5, atol=1e-5)


def test_quantized_logits_can_be_profiled(model):
    spec = QuantSpec.logits(bits=3, granularity="per_head")
    seen = []
    with torch.no_grad(), quantize_model(model, spec), capture(model, "layers.*.attn.logits", reducers=seen.append):
        model(input_ids=IDS[:1])
    for obs in seen:
        # kept observations stay intact: the attention function masks a copy, not the tensor a reducer holds
        assert not (obs.x == torch.finfo(obs.x.dtype).min).any()


def test_layer_restriction(model):
    seen = {}
    spec = QuantSpec.logits(bits=2, layers=(1,))
    with torch.no_grad(), quantize_model(model, spec), capture(model, "layers.*.attn.logits",
                                                                   reducers=lambda o: seen.__setitem__(o.point.layer, o.x)):
        model(input_ids=IDS[:1])
    with torch.no_grad(), capture(model, "layers.*.attn.logits", reducers=lambda o: seen.__setitem__(("ref", o.point.layer), o.x)):
        model(input_ids=IDS[:1])
    assert torch.equal(seen[0], seen[("ref", 0)]) and not torch.equal(seen[1], seen[("ref", 1)])
    with pytest.raises(OutlierscopeError, match="out of range"):
        with quantize_model(model, QuantSpec.logits(bits=4, layers=(7,))):
            pass


def test_restored_after_exception(model):
    with pytest.raises(RuntimeError, match="^boom$"):
        with quantize_model(model, QuantSpec.logits(bits=4)):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_weight_quantization_cpu(mode):
    """w=bnb-int8 / w=bnb-nf4: inside quantize_model every decoder linear is bitsandbytes' module; each computes
    F.linear with bitsandbytes' own dequantized weights, and those weights are the originals up to the format's
    rounding (int8: within one step of the row's absmax / 127; NF4: bitsandbytes' own block-64 quantize/dequantize of
    the original weights). On exit the original modules are back, unchanged."""
    import bitsandbytes as bnb

    m = PairConfig.from_name("pair-test").build("transformer").eval()
    before = {n: mod for n, mod in m.model.layers.named_modules() if type(mod) is torch.nn.Linear}
    originals = {n: mod.weight.detach().clone() for n, mod in before.items()}
    ref = _small_logits(m)
    cls = bnb.nn.Linear8bitLt if mode == "int8" else bnb.nn.Linear4bit
    with quantize_model(m, f"w=bnb-{mode}; logits=int8/per_tensor"):  # combinable with logit quantization
        replaced = {n: mod for n, mod in m.model.layers.named_modules() if isinstance(mod, cls)}
        assert set(replaced) == set(originals) and type(m.lm_head) is torch.nn.Linear  # the LM head stays
        _check_bnb_weights(replaced, originals, mode, m.config.hidden_size)
        assert torch.isfinite(quantized := _small_logits(m)).all() and (quantized - ref).abs().max() > 0
    after = {n: mod for n, mod in m.model.layers.named_modules() if type(mod) is torch.nn.Linear}
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert all(torch.equal(before[n].weight, originals[n]) for n in before)
    assert torch.equal(_small_logits(m), ref)


def _check_bnb_weights(replaced: dict, originals: dict, mode: str, hidden: int) -> None:
    import bitsandbytes.functional as bf

    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1))
    for name, lin in replaced.items():
        w0 = originals[name]
        if mode == "int8":
            w = lin.weight.data.float() * lin.state.SCB[:, None] / 127
            assert ((w - w0).abs() <= w0.abs().amax(1, keepdim=True) / 127).all()
            assert (w - w0).abs().max() > 0  # really rounded
        else:
            w = bf.dequantize_4bit(lin.weight.data, lin.weight.quant_state)
            ref = bf.dequantize_4bit(*bf.quantize_4bit(w0, blocksize=64, quant_type="nf4"))
            torch.testing.assert_close(w, ref, rtol=0, atol=5e-3 * w0.abs().max().item())  # absmax kept in half precision
            assert (w - w0).abs().max() > 0
        xi = x[:, : lin.in_features] if lin.in_features <= x.shape[1] else torch.randn(5, lin.in_features)
        with torch.no_grad():
            torch.testing.assert_close(lin(xi), torch.nn.functional.linear(xi, w, lin.bias), rtol=1e-5, atol=1e-6)


def _small_logits(m):
    with torch.no_grad():
        return m(input_ids=IDS[:, :8] % 512).logits


def test_weight_mode_error():
    from outlierscope.quant.bnb import bnb_weights

    with pytest.raises(OutlierscopeError, match="weights must be one of none, int8, nf4"):
        with bnb_weights(PairConfig.from_name("pair-test").build("transformer"), "int4"):
            pass
    with pytest.raises(OutlierscopeError, match="unknown format 'bnb-int4'"):
        QuantSpec.parse("w=bnb-int4")
