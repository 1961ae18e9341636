"""outlierscope.quant.export against compressed-tensors itself: the named schemes' arguments equal compressed-tensors'
own presets of the same name, the ignore list selects (by compressed-tensors' own matcher) exactly the linears written
out by hand, and what compressed-tensors cannot state is refused in one line."""

import re

import pytest

ctq = pytest.importorskip("compressed_tensors.quantization")

from outlierscope.errors import OutlierscopeError  # noqa: E402
from outlierscope.quant import export as qexport  # noqa: E402
from outlierscope.quant.specs.spec import QuantSpec  # noqa: E402


@pytest.mark.parametrize("ours, preset", [
    ("w8a8", "W8A8"), ("w4a16", "W4A16"), ("w4a8", "W4A8"), ("fp8-dynamic", "FP8_DYNAMIC"), ("ct-mxfp4", "MXFP4"),
    ("nvfp4", "NVFP4"), ("w=ct-mxfp8_e4m3; a=ct-mxfp8_e4m3", "MXFP8"), ("w=fint8/per_group:128", "W8A16"),
    ("w=fint4/per_group:128; a=e4m3/per_token", "W4AFP8"),
])
def test_named_schemes_are_compressed_tensors_presets(ours, preset):
    spec = QuantSpec.parse(ours)
    qexport.check_exportable(spec)
    ours_ = ctq.QuantizationScheme(**qexport.linear_scheme(spec)).model_dump(mode="json")
    assert ours_ == ctq.preset_name_to_scheme(preset, ["Linear"]).model_dump(mode="json")


def test_arguments_worked_by_hand():
    """Granularities and formats outside the presets, against the fields written here."""
    w = QuantSpec.parse("w=fint4/per_group:32; a=fint8/static").part("w")
    assert qexport.tensor_args(w) == {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                      "group_size": 32, "dynamic": False}
    a = QuantSpec.parse("w=fint8/per_tensor; a=fint8/static").part("a")
    assert qexport.tensor_args(a) == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor",
                                      "dynamic": False}
    a = QuantSpec.parse("w=fint8/per_tensor; a=fint6/per_group:64").part("a")
    assert qexport.tensor_args(a) == {"num_bits": 6, "type": "int", "symmetric": True, "strategy": "group",
                                      "group_size": 64, "dynamic": True}
    w = QuantSpec.parse("w=zint4/per_group:128").part("w")  # compressed-tensors' W4A16_ASYM weights
    assert ctq.QuantizationArgs(**qexport.tensor_args(w)) == ctq.preset_name_to_scheme("W4A16_ASYM", ["Linear"]).weights
    kv = qexport.kv_cache_args(QuantSpec.parse("kv=e4m3/per_head"))
    assert ctq.QuantizationArgs(**kv) == ctq.QuantizationArgs(num_bits=8, type="float", symmetric=True,
                                                              strategy="attn_head", dynamic=False)


@pytest.mark.parametrize("text, msg", [
    ("w4a4-rotated", "rotate:SEED"), ("llm-int8", "bitsandbytes"), ("w=e5m2/per_channel", "no e5m2"),
    ("a=int8/per_token", "add a w= part"), ("logits=int8/per_tensor", "as a KV cache"),
    ("kivi-2bit", "as a KV cache"), ("w8a8; k=e4m3/per_tensor", "k and v alike"),
    ("w=fint8/per_channel; kv=int4/per_tensor", "as a KV cache"), ("w=mxint8", "no mxint8"),
    # the restricted grid and a float zero point are not compressed-tensors' grids: the fint spelling is named
    ("w8a8-restricted", "restricted grid.*export w=fint8/per_channel$"),
    ("w=int4/per_group:64", r"absmax / 7\).*absmax / 7.5\); measure and export w=fint4/per_group:64$"),
    ("w=fint8/per_channel; a=int8/per_token", "export a=fint8/per_token$"),
    ("w=fint8/per_channel; kv=int8/per_tensor", "export k=fint8/per_tensor$"),
    ("w=asym4/per_group:32", "zero point is a float"),
    ("w=fint4/per_group:64; awq", "AWQModifier searches other ratios"),
    # OCP's MX scale is not compressed-tensors' (it rounds a block's max to a power of two first)
    ("mxfp4", "OCP's MX scale.*measure and export w=ct-mxfp4$"),
    ("w=mxfp8_e4m3; a=ct-mxfp8_e4m3", "measure and export w=ct-mxfp8_e4m3$"),
])
def test_what_compressed_tensors_cannot_state_is_refused(text, msg):
    with pytest.raises(OutlierscopeError, match=msg):
        qexport.check_exportable(QuantSpec.parse(text))


def _meta_llama(layers=3):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("text, layers, expected", [
    ("w8a8", (0, 2), {f"model.layers.{i}.{p}" for i in (0, 2) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}),
    ("w8a8; linears:mlp.down_proj,self_attn.o_proj", (1,), {"model.layers.1.mlp.down_proj",
                                                            "model.layers.1.self_attn.o_proj"}),
    ("w=int8/per_channel; a=int8/per_token; linears:self_attn.*,lm_head", (0, 1, 2),
     {f"model.layers.{i}.self_attn.{p}_proj" for i in range(3) for p in "qkvo"} | {"lm_head"}),
])
def test_ignore_list_selects_exactly_the_quantized_linears(text, layers, expected):
    """compressed-tensors' own matcher, given targets [Linear] and our ignore list, picks the linears named here."""
    from compressed_tensors.utils.match import match_named_modules

    from outlierscope.quant.linears.sites import linear_sites

    model = _meta_llama()
    spec = QuantSpec.parse(text).with_layers(layers)
    ignore = qexport.ignore_list(model, {s.name for s in linear_sites(model, spec)})
    assert {n for n, _ in match_named_modules(model, ["Linear"], ignore)} == expected
    whole = [f"re:model\\.layers\\.{i}\\." for i in range(3) if i not in layers]
    assert [i for i in ignore if i.startswith("re:")] == whole  # a layer left whole is one pattern, nothing more
    assert not [n for n in ignore if not n.startswith("re:") and any(re.match(w[3:], n) for w in whole)]


def test_quantization_config_reads_back_and_names_its_format():
    """The config dict validates as compressed-tensors' QuantizationConfig, with the format its compressor infers."""
    for text, fmt in (("w8a8", "int-quantized"), ("w4a16", "pack-quantized"), ("fp8-dynamic", "float-quantized"),
                      ("nvfp4", "nvfp4-pack-quantized"), ("ct-mxfp4", "mxfp4-pack-quantized")):
        d = qexport.quantization_config(QuantSpec.parse(text), ["lm_head"])
        back = ctq.QuantizationConfig.model_validate(d)
        assert back.format == fmt and back.ignore == ["lm_head"] and back.quant_method == "compressed-tensors"
    d = qexport.quantization_config(QuantSpec.parse("w8a8; kv=e4m3/per_tensor"), [])
    assert ctq.QuantizationConfig.model_validate(d).kv_cache_scheme.type == "float"


def test_recipe_carries_smoothquant_and_the_same_scheme():
    r = qexport.recipe(QuantSpec.parse("w8a8; smooth:0.5"), ["lm_head"])["default_stage"]["default_modifiers"]
    assert list(r) == ["SmoothQuantModifier", "QuantizationModifier"]  # smoothing first, as llm-compressor's examples
    assert r["SmoothQuantModifier"] == {"smoothing_strength": 0.5}
    q = r["QuantizationModifier"]
    assert q["ignore"] == ["lm_head"] and ctq.QuantizationScheme(**q["config_groups"]["group_0"]) == \
        ctq.preset_name_to_scheme("W8A8", ["Linear"])


@pytest.mark.parametrize("text", [
    "w=fint8/per_channel; a=fint8/per_token", "w=fint4/per_group:16", "w=fint4/per_group:16; a=fint8/per_token",
    "w=e4m3/per_channel; a=e4m3/per_token", "nvfp4", "ct-mxfp4", "w=fint8/per_channel; a=fint8/static",
    "w=fint8/per_channel; linears:mlp.down_proj,self_attn.o_proj", "w=fint8/per_channel; layers:0,2",
    "w=fint8/per_channel; a=fint8/per_token; kv=e4m3/per_tensor", "w=fint8/per_channel; a=fint8/per_token; "
    "linears:*,lm_head", "w=fint8/per_channel; linears:mlp.down_proj,lm_head; layers:1",
])
def test_a_checkpoints_config_reads_back_as_the_spec(text):
    """spec -> quantization_config -> spec, through compressed-tensors' matcher on the module tree."""
    model = _meta_llama()
    spec = QuantSpec.parse(text)
    config = qexport.quantization_config(spec, qexport.ignore_list(model, {s.name for s in _sites(model, spec)}))
    assert qexport.spec_from_config(config, model) == spec


def _sites(model, spec):
    from outlierscope.quant.linears.sites import linear_sites

    return linear_sites(model, spec)


def test_a_config_with_no_spec_form_is_refused():
    model = _meta_llama()
    w = qexport.tensor_args(QuantSpec.parse("w=fint8/per_channel").part("w"))
    mixed = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": w}},
             "ignore": ["lm_head", "model.layers.0.mlp.up_proj", "model.layers.1.self_attn.q_proj"]}
    with pytest.raises(OutlierscopeError, match="different linears in different layers"):
        qexport.spec_from_config(mixed, model)
    block = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {**w, "strategy": "block",
                                                                              "block_structure": [128, 128]}}}}
    with pytest.raises(OutlierscopeError, match="strategy 'block'"):
        qexport.spec_from_config(block, model)


@pytest.mark.parametrize("text, said", [("w=nvfp4", True), ("nvfp4", True), ("w8a8", False), ("a=nvfp4; w=fint8/per_channel", False)])
def test_differences_name_how_nvfp4_weights_are_decoded(text, said):
    """compare.json's differences say how a loaded NVFP4 checkpoint's weights were decoded (float32, as the emulation)
    wherever the weights are NVFP4, and only there."""
    notes = qexport.differences(QuantSpec.parse(text))
    assert any(n.startswith("nvfp4 weights:") for n in notes) is said, notes


def test_a_gptq_spec_exports_as_llm_compressors_gptq_modifier():
    """gptq:static,sequential=layer (order none / desc) becomes GPTQModifier in QuantizationModifier's place, with llm-compressor
    0.14's field names (block_size, dampening_frac, actorder None / "weight": checked by constructing GPTQModifier
    in its venv when this was written; its whole run's codes are ours, tests/quant/test_gptq_model.py); dynamic
    groups, GAR or GPT-QModel's order inside a layer, which its GPTQ does not compute, are refused."""
    from outlierscope.errors import OutlierscopeError
    from outlierscope.quant.export import check_exportable, recipe
    from outlierscope.quant.specs.spec import QuantSpec

    for text, actorder in (("gptq:static,sequential=layer", None),
                          ("gptq:damp=0.05,order=desc,block=64,static,sequential=layer", "weight")):
        spec = QuantSpec.parse(f"w=fint4/per_group:64; {text}")
        check_exportable(spec)
        mods = recipe(spec, ["lm_head"])["default_stage"]["default_modifiers"]
        assert set(mods) == {"GPTQModifier"}
        g = mods["GPTQModifier"]
        assert g["actorder"] == actorder and g["block_size"] == spec.gptq.block and g["dampening_frac"] == spec.gptq.damp
        assert g["config_groups"]["group_0"]["weights"]["group_size"] == 64 and g["ignore"] == ["lm_head"]
    for text in ("gptq", "gptq:order=gar,static,sequential=layer", "gptq:order=desc,sequential=layer",
                 "gptq:static"):
        with pytest.raises(OutlierscopeError, match="export gptq:static,sequential=layer"):
            check_exportable(QuantSpec.parse(f"w=fint4/per_group:64; {text}"))
