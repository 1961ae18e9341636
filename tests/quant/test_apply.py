import pytest
import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.capture import capture
from outlierscope.models.presets import PairConfig
from outlierscope.quant.apply import quantize_attention, quantize_weights
from outlierscope.quant.spec import QuantSpec


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
        with quantize_attention(model, spec):
            return model(input_ids=IDS).logits


def test_16_bits_is_exact(model):
    assert torch.equal(_logits(model, QuantSpec(bits=16)), _logits(model))
    assert model.config._attn_implementation == "eager"


def test_8_bits_close_2_bits_far(model):
    """Measured on these models (max |change| / max |logit| of the output logits): 8 bits 0.011 / 0.007
    (transformer / diff), 6 bits 0.029 / 0.031, 4 bits 0.14 / 0.12, 2 bits 0.55 / 0.56; next-token total
    variation at 8 bits 0.001 / 0.0005. The bounds below leave about 2x margin."""
    ref = _logits(model)
    scale = ref.abs().max()
    rel = {b: ((_logits(model, QuantSpec(bits=b)) - ref).abs().max() / scale).item() for b in (8, 6, 4, 2)}
    assert 0 < rel[8] < 0.025
    assert rel[8] < rel[6] < rel[4] < rel[2] and rel[2] > 0.3
    tv = (torch.softmax(_logits(model, QuantSpec(bits=8)), -1) - torch.softmax(ref, -1)).abs().sum(-1).max() / 2
    assert tv < 0.003


def test_quantized_logits_can_be_profiled(model):
    spec = QuantSpec(bits=3, granularity="per_head")
    seen = []
    with torch.no_grad(), quantize_attention(model, spec), capture(model, "layers.*.attn.logits", reducers=seen.append):
        model(input_ids=IDS[:1])
    for obs in seen:
        v = obs.x[obs.valid.expand_as(obs.x)].view(-1)
        for h in range(obs.x.shape[1]):
            vals = obs.x[0, h][obs.valid[0, 0]]
            assert len(torch.unique(vals)) <= 2 * 3 + 1  # on a 3-bit grid: at most 7 levels per head
        assert len(v)
        # kept observations stay intact: the attention function masks a copy, not the tensor a reducer holds
        assert not (obs.x == torch.finfo(obs.x.dtype).min).any()


def test_layer_restriction(model):
    seen = {}
    spec = QuantSpec(bits=2, layers=(1,))
    with torch.no_grad(), quantize_attention(model, spec), capture(model, "layers.*.attn.logits",
                                                                   reducers=lambda o: seen.__setitem__(o.point.layer, o.x)):
        model(input_ids=IDS[:1])
    with torch.no_grad(), capture(model, "layers.*.attn.logits", reducers=lambda o: seen.__setitem__(("ref", o.point.layer), o.x)):
        model(input_ids=IDS[:1])
    assert torch.equal(seen[0], seen[("ref", 0)]) and not torch.equal(seen[1], seen[("ref", 1)])
    with pytest.raises(OutlierscopeError, match="out of range"):
        with quantize_attention(model, QuantSpec(bits=4, layers=(7,))):
            pass


def test_restored_after_exception(model):
    with pytest.raises(RuntimeError):
        with quantize_attention(model, QuantSpec(bits=4)):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("mode,tol", [("int8", 0.05), ("nf4", 0.5)])
def test_weight_quantization_cpu(mode, tol):
    import bitsandbytes as bnb

    m = PairConfig.from_name("pair-test").build("transformer").eval()
    ref = _small_logits(m)
    quantize_weights(m, mode)
    cls = bnb.nn.Linear8bitLt if mode == "int8" else bnb.nn.Linear4bit
    assert any(isinstance(x, cls) for x in m.modules())
    out = _small_logits(m)
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert 0 < rel < tol
    with torch.no_grad(), quantize_attention(m, QuantSpec(bits=8)):  # combinable with logit quantization
        assert torch.isfinite(m(input_ids=IDS[:, :8] % 512).logits).all()


def _small_logits(m):
    with torch.no_grad():
        return m(input_ids=IDS[:, :8] % 512).logits


def test_weight_mode_error():
    with pytest.raises(OutlierscopeError, match="weights must be one of none, int8, nf4"):
        quantize_weights(PairConfig.from_name("pair-test").build("transformer"), "int4")
