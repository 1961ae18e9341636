"""A new format and a new transform, defined and registered in this file alone, go through everything a built-in one
does: the spec's text, quantize_model on attention and on a linear layer, `outlierscope recipes`, and export (which
refuses what compressed-tensors cannot write, in one line). docs/develop/extending.md walks through this file."""

from dataclasses import dataclass, field

import pytest
import torch

from outlierscope.cli import main
from outlierscope.errors import OutlierscopeError
from outlierscope.quant.numerics.registry import FORMATS, Format, register_format
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.specs.transforms import TRANSFORMS, Transform, register_transform


@dataclass(frozen=True)
class Halves(Format):
    """Values rounded to the nearest multiple of 1/2 (a toy grid: no scale)."""

    seen: list = field(default_factory=list, compare=False)  # every tensor it quantized

    def quantize(self, x, dims, valid, bits):
        self.seen.append(x.clone())
        out = torch.round(x * 2) / 2
        return out if valid is None else torch.where(valid, out, x)


@dataclass(frozen=True)
class Pow2(Transform):
    """q times a power of two and k divided by it; a linear's input divided by it and its weight times it (exact).

    factor: the power of two."""

    factor: int
    key, rank, attention, linears = "pow2", 70, True, True

    def arg(self):
        return str(self.factor)

    @classmethod
    def parse(cls, arg, text):
        return cls(int(arg))

    def qk(self, q, k, q_valid, k_valid):
        return q * self.factor, k / self.factor

    def linear_input(self, x):
        return x / self.factor

    def linear_weight(self, w):
        return w * self.factor


@dataclass(frozen=True)
class LinearPow2(Pow2):
    """pow2 on the linears alone."""

    key, attention = "lpow2", False


@pytest.fixture
def toy():
    fmt = register_format(Halves("halves", "values rounded to multiples of 1/2 (a toy)", targets=("k", "a", "w")))
    register_transform(Pow2)
    register_transform(LinearPow2)
    try:
        yield fmt
    finally:
        FORMATS.pop("halves")
        TRANSFORMS.pop("pow2")
        TRANSFORMS.pop("lpow2")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # bf16-valued weights, as real checkpoints
    return model


IDS = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8]])


def _logits(model, spec=None):
    from outlierscope.quant.apply import quantize_model

    with torch.no_grad():
        if spec is None:
            return model(IDS).logits
        with quantize_model(model, spec):
            return model(IDS).logits


def test_the_spec_text_round_trips(toy):
    spec = QuantSpec.parse("pow2:4; k=halves/per_token; w=halves/per_channel")
    assert str(spec) == "k=halves/per_token; w=halves/per_channel; pow2:4"
    assert QuantSpec.parse(str(spec)) == spec and spec.get(Pow2).factor == 4 and spec.part("k").fmt is toy
    assert spec.has_attention and spec.has_linear and spec.bits == 8
    with pytest.raises(OutlierscopeError, match="q: halves applies to k= and a= and w= only"):
        QuantSpec.parse("q=halves/per_token")
    with pytest.raises(OutlierscopeError, match="pow2 is given twice"):
        QuantSpec.parse("pow2:2; pow2:4; k=halves/per_token")


def test_attention_runs_the_transform_then_the_format(toy):
    """pow2 alone changes no logit (q k^T is unchanged: powers of two scale exactly); with k=halves on layer 0, the
    format sees k / 4 exactly where it saw k without the transform, and the output differs from both."""
    model = _model()
    base = _logits(model)
    assert torch.equal(_logits(model, "pow2:4"), base)
    halves = _logits(model, "k=halves/per_token; layers:0")
    plain = list(toy.seen)
    toy.seen.clear()
    both = _logits(model, "k=halves/per_token; pow2:4; layers:0")
    assert len(toy.seen) == len(plain) == 1 and torch.equal(toy.seen[0], plain[0] / 4)
    assert not torch.equal(halves, base) and not torch.equal(both, halves)
    assert torch.equal(_logits(model), base)  # nothing left behind


def test_a_linear_runs_the_transform_then_the_format(toy):
    """A linear's output under 'a=halves; w=halves; pow2:2' is round(x / 2) @ round(W * 2)^T, computed here by hand
    (weights and inputs of order 1, so that the rounding and each factor of 2 show in the output)."""
    from outlierscope.quant.apply import quantize_model

    model = _model()
    lin = model.model.layers[0].mlp.down_proj
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        lin.weight.copy_((torch.randn(lin.weight.shape, generator=g) * 3).to(torch.bfloat16).float())
    w = lin.weight.detach().clone()
    x = (torch.randn(1, 5, lin.in_features, generator=g) * 3).to(torch.bfloat16).float()
    with torch.no_grad(), quantize_model(model, "a=halves/per_token; w=halves/per_channel; pow2:2"):
        y = lin(x)

    def rnd(t):
        return torch.round(t * 2) / 2

    want = torch.nn.functional.linear(rnd(x / 2), rnd(w * 2))
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    for wrong in (torch.nn.functional.linear(rnd(x), rnd(w * 2)), torch.nn.functional.linear(rnd(x / 2), rnd(w))):
        assert not torch.equal(y, wrong)  # each hook shows
    assert torch.equal(lin.weight, w)  # the weight is the model's again


def test_recipes_lists_them_and_checks_their_text(toy, capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "  halves           values rounded to multiples of 1/2 (a toy); on k, a, w" in out
    assert "  pow2             q times a power of two and k divided by it" in out
    assert main(["recipes", "pow2:8; w=halves/per_group:32"]) == 0
    assert capsys.readouterr().out.strip() == "w=halves/per_group:32; pow2:8"


@pytest.mark.parametrize("text,says", [("w=halves/per_channel", "compressed-tensors has no halves format"),
                                       ("w=fint8/per_channel; pow2:2", "attention parts, got pow2"),
                                       ("w=fint8/per_channel; lpow2:2", "lpow2:2 has no compressed-tensors form")])
def test_export_refuses_what_it_cannot_write(toy, tmp_path, capsys, text, says):
    assert main(["export", "--model", "pair-tiny:diff", "--quant", text, "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and not (tmp_path / "e").exists()
