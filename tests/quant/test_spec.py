"""The one spec type: one parser and one canonical text for every part (property test), the paper's keyword form as
the same type, the table columns and words the committed cells were named by, bitsandbytes weights as a part, and
the names before it as deprecated aliases."""

import itertools
import math
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.quant.specs.recipes import RECIPES
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.specs.transforms import Calib, Hadamard, Layers, Linears, Outliers, Rotate, Smooth

SIZE = st.integers(1, 256)
INT = st.sampled_from(["int", "asym", "fint"]).flatmap(lambda f: st.integers(2, 8).map(lambda b: f"{f}{b}"))
BLOCK = st.sampled_from(["mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "mxint8", "nvfp4", "ct-mxfp4", "ct-mxfp8_e4m3"])


def _gran(names: list[str], sized=("per_block", "per_group")):
    """A granularity text of ``names``: the sized ones with :N, per_channel with or without."""
    def one(g):
        if g in sized:
            return SIZE.map(lambda n: f"{g}:{n}")
        if g == "per_channel":
            return st.one_of(st.just(g), SIZE.map(lambda n: f"{g}:{n}"))
        return st.just(g)
    return st.sampled_from(names).flatmap(one)


LOGITS = st.one_of(
    st.tuples(st.integers(2, 15).map(lambda b: f"int{b}") | st.sampled_from(["e4m3", "e5m2"]),
              st.sampled_from(["per_tensor", "per_head", "per_row"])).map(lambda t: f"logits={t[0]}/{t[1]}"),
    st.just("logits=bnb-int8"))
QKV = st.tuples(st.sampled_from(["q", "k", "v", "kv", "q,k"]), st.one_of(
    st.tuples(INT | st.sampled_from(["e4m3", "e5m2"]),
              _gran(["per_tensor", "per_head", "per_token", "per_row", "per_channel", "per_block", "per_group"]))
    .map(lambda t: f"{t[0]}/{t[1]}"), BLOCK)).map(lambda t: f"{t[0]}={t[1]}")
PROBS = st.one_of(st.tuples(st.integers(2, 8).map(lambda b: f"int{b}") | st.just("e4m3"),
                            st.sampled_from(["per_row", "static"])).map(lambda t: f"probs={t[0]}/{t[1]}"),
                  BLOCK.map(lambda f: f"probs={f}"))
A = st.one_of(st.tuples(INT | st.just("e4m3"), _gran(["per_token", "per_tensor", "per_group", "static"]))
              .map(lambda t: f"a={t[0]}/{t[1]}"), BLOCK.map(lambda f: f"a={f}"))
W = st.one_of(st.tuples(INT | st.just("e4m3"), _gran(["per_channel", "per_group", "per_tensor"], sized=("per_group",)))
              .map(lambda t: f"w={t[0]}/{t[1]}".replace("per_channel:", "per_channel_no:")), BLOCK.map(lambda f: f"w={f}"),
              st.sampled_from(["w=bnb-int8", "w=bnb-nf4"]))
FLAGS = st.one_of(
    st.just("smooth_k"), st.integers(1, 256).map(lambda n: f"smooth_q:{n}"),
    st.integers(0, 2**63 - 1).map(lambda n: f"hadamard:{n}"), st.integers(0, 2**63 - 1).map(lambda n: f"rotate:{n}"),
    st.floats(0, 1, allow_nan=False).map(lambda a: f"smooth:{a}"),
    st.floats(0.01, 100, allow_nan=False).map(lambda t: f"outliers:{t}"),
    st.floats(0.01, 100, allow_nan=False).map(lambda t: f"bnb_outliers:{t}"),
    st.lists(st.sampled_from(["self_attn.*", "mlp.down_proj", "mlp.*", "self_attn.q_proj"]), min_size=1, max_size=3)
    .map(lambda ps: "linears:" + ",".join(ps)),
    st.lists(st.integers(0, 40), min_size=1, max_size=4).map(lambda ls: "layers:" + ",".join(map(str, ls))),
    st.sampled_from(["calib:hellaswag", "calib:notes/text.jsonl"]),
    st.sampled_from(list(RECIPES)))


@st.composite
def spec_texts(draw) -> str:
    """A spec text: a random subset of parts and transforms (and recipe names), in a random order."""
    items = draw(st.lists(st.one_of(LOGITS, QKV, PROBS, A, W, FLAGS), min_size=1, max_size=6))
    return "; ".join(draw(st.permutations(items)))


def _parse_or_skip(text: str) -> QuantSpec:
    try:
        return QuantSpec.parse(text)
    except OutlierscopeError:  # an invalid combination (two formats of a target, calib without smooth, ...)
        assume(False)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(spec_texts())
def test_parse_of_the_canonical_text_is_the_same_spec(text):
    spec = _parse_or_skip(text)
    again = QuantSpec.parse(str(spec))
    assert again == spec and str(again) == str(spec) and hash(again) == hash(spec)


HAND_WRITTEN = ["logits=int4/per_tensor", "logits=e4m3/per_head; layers:0,1", "logits=int12/per_row", "none",
                "q,k=int8/per_block:128; smooth_k", "kv=asym2/per_channel:32", "q+k=int8/per_token; layers:0+2",
                "w=fint8/per_channel; a=fint8/per_token; smooth:0.5; calib:hellaswag",
                "w=int4/per_group:64; a=int8/per_token; linears:self_attn.*,mlp.down_proj",
                "w=bnb-nf4", "w=bnb-int8; k=int4/per_token", "logits=bnb-int8", "w8a8; kivi-4bit", "sage2-int4; w4a16"]


@pytest.mark.parametrize("text", [*RECIPES, *HAND_WRITTEN,
                                  *(f"{a}; {b}" for a, b in itertools.combinations(RECIPES, 2))])
def test_every_recipe_pair_and_example_round_trips(text):
    try:
        spec = QuantSpec.parse(text)
    except OutlierscopeError as e:  # two recipes that quantize one target or repeat a transform: refused, naming it
        assert any(w in str(e) for w in ("quantized twice", "given twice", "two ways of one thing", "bitsandbytes"))
        return
    assert QuantSpec.parse(str(spec)) == spec


# the paper's form (QuantSpec.logits), and the words and table columns its cells are named by (written out by hand)
@pytest.mark.parametrize("kw,text,bits,fmt,gran,words", [
    (dict(bits=4), "logits=int4/per_tensor", 4, "int", "per_tensor", "4-bit int per_tensor"),
    (dict(bits=6, granularity="per_head"), "logits=int6/per_head", 6, "int", "per_head", "6-bit int per_head"),
    (dict(bits=8, format="e4m3", granularity="per_row", layers=(2, 0)), "logits=e4m3/per_row; layers:0,2", 8, "e4m3",
     "per_row", "fp8 e4m3 per_row layers 0,2"),
    (dict(bits=16), "none", 16, "int", "per_tensor", "16 (unquantized)"),
    (dict(bits=16, format="e5m2", granularity="per_head"), "none", 16, "int", "per_tensor", "16 (unquantized)"),
    (dict(bits=8, granularity="per_row", backend="bitsandbytes"), "logits=bnb-int8", 8, "bnb-int8", "per_row",
     "8-bit bnb-int8 per_row"),
])
def test_the_paper_form_is_the_logits_part(kw, text, bits, fmt, gran, words):
    spec = QuantSpec.logits(**kw)
    assert spec == QuantSpec.parse(text) and str(spec) == text and spec.is_logits_only
    assert (*spec.columns, spec.description, spec.label) == (bits, fmt, gran, words, words)
    assert spec.is_identity == (bits == 16)


def test_a_spec_beyond_the_logits_keeps_its_table_columns():
    spec = QuantSpec.parse("sage2-int4")
    assert (*spec.columns, spec.label) == (4, "attn", str(spec), "sage2-int4")
    assert spec.description == str(spec) and not spec.is_logits_only
    assert QuantSpec.parse("logits-int4") == QuantSpec.logits(bits=4) and QuantSpec.parse("logits-int4").label == "logits-int4"


def test_bitsandbytes_weights_are_a_part():
    nf4 = QuantSpec.parse("w=bnb-nf4")
    assert nf4.weights_mode == "nf4" and not nf4.is_identity and not nf4.has_linear
    assert nf4.without_weights() == QuantSpec() and QuantSpec().with_weights("nf4") == nf4
    both = QuantSpec.logits(bits=4).with_weights("int8")
    assert str(both) == "logits=int4/per_tensor; w=bnb-int8" and both.without_weights() == QuantSpec.logits(bits=4)
    assert QuantSpec.logits(bits=4).with_weights("none") == QuantSpec.logits(bits=4)


@pytest.mark.parametrize("text,msg", [
    ("w=bnb-nf4; a=int8/per_token", "our linear emulation does not apply to bitsandbytes' modules"),
    ("w=bnb-int8; smooth:0.5; a=int8/per_token", "our linear emulation does not apply"),
    ("w=bnb-nf4; layers:0", "applies to every decoder layer; leave out layers:"),
    ("logits=bnb-nf4", "applies to w= only"), ("k=bnb-int8", "applies to w= and logits= only"),
    ("w=bnb-nf4/per_channel", "brings its own blocks"), ("w=bnb-int8; w8a8", "target w is quantized twice"),
])
def test_bitsandbytes_parts_refuse_what_does_not_apply(text, msg):
    with pytest.raises(OutlierscopeError, match=msg):
        QuantSpec.parse(text)


@pytest.mark.parametrize("kw,msg", [(dict(bits=4, format="e4m4"), "format must be one of int, e4m3, e5m2"),
                                    (dict(bits=6, format="e4m3"), "bits must be 8 .* for format e4m3"),
                                    (dict(bits=4, backend="bitsandbytes"), "backend must be 'torch' unless format int, bits 8"),
                                    (dict(bits=17), "bits must be in 2..16")])
def test_the_paper_form_refuses_what_it_cannot_say(kw, msg):
    with pytest.raises(OutlierscopeError, match=msg):
        QuantSpec.logits(**kw)


def test_the_constructor_takes_parts_not_the_paper_keywords():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bits'"):
        QuantSpec(bits=4)


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'granularty'"):
        QuantSpec.logits(bits=4, granularty="per_head")


def test_no_module_dispatches_between_spec_types():
    """One spec type: no isinstance between spec classes."""
    pkg = Path(__file__).resolve().parents[2] / "outlierscope"
    for path in pkg.rglob("*.py"):
        assert not re.search(r"isinstance\([^()]*,\s*\(?[\w., ]*\bQuantSpec\b", path.read_text()), path


def _readme_one_liners() -> list[str]:
    """The spec one-liners under the README's "One spec type" (each line of its python block that builds a spec)."""
    from tests.manual import manual

    block = manual().split("**One spec type.**", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.startswith("QuantSpec")]


def test_the_readme_one_liners_quantize_a_model():
    """Each one-liner, imported as the README says, changes a model's output inside quantize_model and leaves it as
    it was afterwards (bitsandbytes NF4: bitsandbytes' modules inside, the original linears after)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ns: dict = {}
    exec("from outlierscope import QuantSpec, quantize_model", ns)
    lines = _readme_one_liners()
    assert len(lines) == 4 and any("bnb-nf4" in x for x in lines)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=32)).eval()
    ids = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        for line in lines:
            spec = eval(line, ns)
            with ns["quantize_model"](model, spec):
                out = model(input_ids=ids).logits
                kinds = {type(m).__name__ for m in model.model.layers.modules()}
            assert (out - ref).abs().max() > 1e-4, line
            assert ("Linear4bit" in kinds) == ("bnb-nf4" in line), line
            assert torch.equal(model(input_ids=ids).logits, ref), line


def test_the_constructor_bounds_layers_as_the_parser_does():
    """A layer index the parser refuses (65536 = 2^16 and above) is refused by the constructor too; the largest one
    accepted round-trips."""
    from outlierscope.errors import ParamError

    for index in (1 << 16, 10**12):
        with pytest.raises(ParamError, match=f"layers must be layer indices below 65536 .*got {index}"):
            QuantSpec.logits(bits=4, layers=(0, index))
        with pytest.raises(OutlierscopeError, match="below 65536"):
            QuantSpec.parse(f"logits=int4/per_tensor; layers:{index}")
    top = QuantSpec.logits(bits=4, layers=((1 << 16) - 1,))
    assert QuantSpec.parse(str(top)) == top


def test_huge_layer_ranges_fail_at_once():
    from outlierscope.quant.specs.parts import MAX_LAYERS, parse_layers
    from outlierscope.quant.specs.spec import QuantSpec

    with pytest.raises(ValueError, match="below 65536"):
        parse_layers("0-3000000000")
    with pytest.raises(OutlierscopeError, match="layer indices must be below 65536"):
        QuantSpec.parse("w8a8; layers:0-3000000000")
    with pytest.raises(OutlierscopeError, match="look like 0-3 or 0,2,5"):
        QuantSpec.parse("w8a8; layers:zero")
    assert parse_layers(f"0-{MAX_LAYERS - 1}")[-1] == MAX_LAYERS - 1


@pytest.mark.parametrize("text, says", [("gptq:order=desc,order=none", "sets order twice"),
                                        ("awq:grid=10,grid=20", "sets grid twice"),
                                        ("gptq:damp=0", "0 < X < 1")])
def test_weight_algorithm_settings_given_twice_or_zero_damping(text, says):
    from outlierscope.quant.specs.spec import QuantSpec

    with pytest.raises(OutlierscopeError, match=says):
        QuantSpec.parse(f"w=int4/per_group:64; {text}")


def test_weight_algorithm_configs_check_their_types():
    from outlierscope.quant.specs.calibrated import AWQConfig, GPTQConfig

    for cfg, kw in ((GPTQConfig, dict(block=1.5)), (GPTQConfig, dict(static=1)), (GPTQConfig, dict(order=3)),
                    (AWQConfig, dict(shrink=True)), (AWQConfig, dict(grid=2.0))):
        with pytest.raises(OutlierscopeError, match="needs"):
            cfg(**kw)


@pytest.mark.parametrize("part, field", [(lambda: Rotate(1.5), "rotate"), (lambda: Smooth(True), "smooth"),
                                         (lambda: Layers((0.5,)), "layers"), (lambda: Calib(" x "), "calib"),
                                         (lambda: Hadamard(True), "hadamard"), (lambda: Outliers(math.nan), "outliers"),
                                         (lambda: Linears(("o_proj ",)), "linears")])
def test_a_part_refuses_what_the_text_cannot_say(part, field):
    with pytest.raises(ParamError) as e:
        part()
    assert e.value.param == field


@pytest.mark.parametrize("text", ["w8a8; smooth:0.5; layers:0-3", "k=int4/per_token; rotate:7",
                                  "w=int4/per_group:64; gptq:damp=0.05,order=desc,static; calib:hellaswag",
                                  "w=int4/per_group:64; awq:grid=10,shrink=0.25", "kivi-2bit", "w4a8"])
def test_every_built_spec_reads_back_as_itself(text):
    spec = QuantSpec.parse(text)
    again = QuantSpec((*reversed(spec.transforms), *reversed(spec.parts)))  # any order in: the canonical one out
    assert again == spec and QuantSpec.parse(str(again)) == spec
