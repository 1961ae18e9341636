"""AWQ of a whole model, layer after layer, against AutoAWQ's procedure written here in float64: each layer's inputs
captured by full forwards of a copy whose earlier layers are already quantized, the scales searched by the loss of the
judging module (self_attn, o_proj, mlp, down_proj), then folded as AutoAWQ's ``apply_scale`` folds them (into the
norms, v_proj's and up_proj's rows), the groups clipped (``apply_clip``) and the weights rounded in place. Our
emulation never folds (the inputs are divided by the scales at run time): the logits of the two models agree."""

import copy

import numpy as np
import pytest
import torch

from outlierscope.quant.apply import quantize_model
from outlierscope.quant.linears.sites import Calibration, linear_sites
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.weights.awq_model import awq_model
from tests.quant.test_awq import _q, _ref_clip

BITS, GROUP, GRID = 4, 16, 20


def _llama(kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, vocab_size=300, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16())  # bf16 values, as checkpoints hold them
        for layer in model.model.layers:  # norms that are not all ones, and a few large input channels
            layer.input_layernorm.weight.copy_((1 + torch.rand(64) * torch.linspace(0, 4, 64)).bfloat16())
            layer.post_attention_layernorm.weight.copy_((1 + torch.rand(64) * 2).bfloat16())
    return model.to(torch.float64)


def _capture(model, seqs, modules):
    """Each module's (args, kwargs) for every sequence, by full forwards of ``model``."""
    got = {k: [] for k in modules}
    hooks = [m.register_forward_pre_hook(lambda m, a, kw, k=k: got[k].append((a, kw)), with_kwargs=True)
             for k, m in modules.items()]
    with torch.no_grad():
        for row in seqs:
            model(input_ids=row[None], use_cache=False)  # no cache: the judges run again on these inputs
    for h in hooks:
        h.remove()
    return got


def _scale(linears, judge, calls, xs):
    """AutoAWQ's _search_best_scale in float64 (means summed in float32, as it sums them), of the group's quantized
    ``linears`` (the others of the group keep their float weights: ``s`` folds into them exactly)."""
    ws = [m.weight.detach().clone() for m in linears]
    cat = torch.cat(ws).numpy()
    a = np.abs(cat).reshape(-1, GROUP)
    w_mean = (a / (a.max(1, keepdims=True) + 1e-6)).reshape(cat.shape).mean(0)
    x = torch.cat([v.reshape(-1, v.shape[-1]) for v in xs])
    x_mean = (x.abs().float().sum(0) / x.shape[0]).double().numpy()

    def run():
        return torch.cat([(lambda o: o[0] if isinstance(o, tuple) else o)(judge(*a, **kw)) for a, kw in calls])

    with torch.no_grad():
        want = run()
        best, best_err = None, np.inf
        for r in range(GRID):
            ratio = r / GRID
            s = np.maximum(x_mean ** ratio / (w_mean ** (1 - ratio) + 1e-4), 1e-4)
            s = s / np.sqrt(s.max() * s.min())
            for m, w in zip(linears, ws):
                m.weight.copy_(torch.from_numpy(_q(w.numpy() * s, BITS, GROUP) / s))
            err = ((run() - want) ** 2).mean().item()
            if err < best_err:
                best, best_err = s, err
        for m, w in zip(linears, ws):
            m.weight.copy_(w)
    return torch.from_numpy(best)


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _reference(model, seqs, clip_tokens, chosen=ALL):
    """The AutoAWQ-quantized copy of ``model`` (folded scales, clipped, rounded weights); only the linears ``chosen``
    quantized (a group's scale searched with those of it rounded, and none where none of it is chosen)."""
    model = copy.deepcopy(model)
    mha = model.config.num_key_value_heads == model.config.num_attention_heads
    ones = torch.ones(model.config.hidden_size, dtype=torch.float64)
    one_i = torch.ones(model.config.intermediate_size, dtype=torch.float64)

    def scale(group, judge, calls, xs, fallback):
        mine = [m for n, m in group if n in chosen]
        return _scale(mine, judge, calls, xs) if mine else fallback

    for layer in model.model.layers:
        at, mlp = layer.self_attn, layer.mlp
        got = _capture(model, seqs, {"attn": at, "o": at.o_proj, "mlp": mlp, "down": mlp.down_proj})
        x = {k: [a[0] if a else kw["hidden_states"] for a, kw in v] for k, v in got.items()}
        s_qkv = scale([("q_proj", at.q_proj), ("k_proj", at.k_proj), ("v_proj", at.v_proj)], at, got["attn"],
                      x["attn"], ones)
        s_o = scale([("o_proj", at.o_proj)], at.o_proj, got["o"], x["o"], None) if mha else None
        s_mlp = scale([("gate_proj", mlp.gate_proj), ("up_proj", mlp.up_proj)], mlp, got["mlp"], x["mlp"], ones)
        s_down = scale([("down_proj", mlp.down_proj)], mlp.down_proj, got["down"], x["down"], one_i)
        with torch.no_grad():  # apply_scale: 1/s into what comes before, s into the linears' columns
            layer.input_layernorm.weight.div_(s_qkv)
            for m in (at.q_proj, at.k_proj, at.v_proj):
                m.weight.mul_(s_qkv)
            if s_o is not None:
                at.v_proj.weight.div_(s_o[:, None])
                at.o_proj.weight.mul_(s_o)
            layer.post_attention_layernorm.weight.div_(s_mlp)
            for m in (mlp.gate_proj, mlp.up_proj):
                m.weight.mul_(s_mlp)
            mlp.up_proj.weight.div_(s_down[:, None])
            mlp.down_proj.weight.mul_(s_down)
        feats = {"v": (x["attn"], s_qkv), "o": (x["o"], s_o), "gate": (x["mlp"], s_mlp), "up": (x["mlp"], s_mlp),
                 "down": (x["down"], s_down)}
        for name, m in (("v", at.v_proj), ("o", at.o_proj), ("gate", mlp.gate_proj), ("up", mlp.up_proj),
                        ("down", mlp.down_proj)):
            if f"{name}_proj" not in chosen:
                continue
            xs, s = feats[name]
            xf = torch.cat([v.reshape(-1, v.shape[-1]) for v in xs])
            xf = xf if s is None else xf / s
            w = m.weight.detach().numpy()
            bound = _ref_clip(w, xf.numpy(), BITS, GROUP, GRID, 0.5, clip_tokens)
            with torch.no_grad():
                m.weight.copy_(torch.from_numpy(np.clip(w.reshape(w.shape[0], -1, GROUP), -bound[..., None],
                                                        bound[..., None]).reshape(w.shape)))
        with torch.no_grad():
            for n in chosen:
                m = getattr(at if n in ALL[:4] else mlp, n)
                m.weight.copy_(torch.from_numpy(_q(m.weight.numpy(), BITS, GROUP)))
    return model


def _logits(ref, model, spec, ours):
    """Logits of seeded sequences: the reference model's, ``model``'s under ``spec`` with our AWQ ``ours``, and
    ``model``'s unquantized."""
    ids = torch.randint(1, 300, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        with quantize_model(model, spec, calibration=Calibration({}, (), "test", ours)):
            got = model(input_ids=ids).logits
        return want, got, model(input_ids=ids).logits


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_awq_model_equals_autoawq_folded_in_float64(kv_heads):
    """Grouped-query attention (o_proj unscaled: v_proj cannot absorb its scale) and multi-head (v_proj -> o_proj
    scaled): the logits of our emulation equal those of the folded float64 AutoAWQ model (seen failing with every
    lone linear scaled, with the layer's inputs from the float model, and with q_proj clipped)."""
    model = _llama(kv_heads)
    before = {n: p.clone() for n, p in model.named_parameters()}
    seqs = torch.randint(1, 300, (4, 24), generator=torch.Generator().manual_seed(3))
    spec = QuantSpec.parse(f"w=int{BITS}/per_group:{GROUP}; awq:clip_tokens=32")
    ours = awq_model(model, seqs, spec, linear_sites(model, spec), progress=False)
    assert len(ours) == 14 and all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    scaled = {n for n, r in ours.items() if r.scale is not None}
    assert any(n.endswith("o_proj") for n in scaled) == (kv_heads == 4)
    assert not any(r.clip is not None for n, r in ours.items() if n.endswith(("q_proj", "k_proj")))
    ref = _reference(model, seqs, 32)
    want, got, plain = _logits(ref, model, spec, ours)
    assert (want - plain).abs().max() > 1e-3  # quantization moved the logits (another ratio anywhere: by ~1e-2)
    # the means are float32 sums (AutoAWQ's), ours per sequence: the scales agree to ~1e-7, the logits to ~1e-7
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("chosen", [("q_proj",), ("down_proj",), ("k_proj", "up_proj")])
def test_part_of_a_group_gets_the_groups_scale_as_autoawq_would_fold_it(chosen):
    """``linears:`` choosing part of a group (q_proj of q/k/v, up_proj of gate/up) or a lone linear whose producer is
    not quantized (down_proj): the scale searched on the whole group's input and judge with the chosen linears
    rounded, folded as AutoAWQ folds it (into the norm or the producer's rows: exact for the float linears); the
    logits equal the folded float64 reference (seen failing with the group cut to its chosen linears: no scale for a
    lone down_proj, q_proj judged alone)."""
    model = _llama(4)
    seqs = torch.randint(1, 300, (4, 24), generator=torch.Generator().manual_seed(3))
    spec = QuantSpec.parse(f"w=int{BITS}/per_group:{GROUP}; awq:clip_tokens=32; linears:" + "+".join(
        f"*.{n}" for n in chosen))
    ours = awq_model(model, seqs, spec, linear_sites(model, spec), progress=False)
    assert sorted(n.rsplit(".", 1)[1] for n in ours) == sorted(chosen * 2)
    assert all(r.scale is not None for r in ours.values())
    ref = _reference(model, seqs, 32, chosen)
    want, got, plain = _logits(ref, model, spec, ours)
    assert (want - plain).abs().max() > 1e-4
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_part_of_a_layers_linears_is_saved_under_its_own_key():
    """Calibrations saved before partial groups were scaled (clipping only) are not read for ``linears:`` subsets;
    whole layers (all linears, or ``layers:``) keep their files."""
    from outlierscope.quant.weights.sequential import _partial_layers

    model = _llama(4)
    for text, partial in [("", False), ("; layers:1", False), ("; linears:*.q_proj", True),
                          ("; linears:self_attn.*", True), ("; linears:*_proj", False)]:
        spec = QuantSpec.parse(f"w=int4/per_group:16; awq{text}")
        assert _partial_layers(model, linear_sites(model, spec)) is partial, text


def test_each_layer_alone_in_one_pass_equals_the_layers_own_calibration():
    """alone=True (sensitivity's only_i cells): each layer's AWQ from one pass equals that of ``layers:i`` (which
    calibrates layer i on the float layers below it; the AutoAWQ comparison above is of the same pass)."""
    model = _llama(2)
    seqs = torch.randint(1, 300, (4, 24), generator=torch.Generator().manual_seed(3))
    spec = QuantSpec.parse(f"w=int{BITS}/per_group:{GROUP}; awq:clip_tokens=32")
    alone = awq_model(model, seqs, spec, linear_sites(model, spec), progress=False, alone=True)
    whole = awq_model(model, seqs, spec, linear_sites(model, spec), progress=False)
    assert any(not torch.equal(alone[n].weight(model.get_submodule(n).weight, spec.part("w")),
                               whole[n].weight(model.get_submodule(n).weight, spec.part("w"))) for n in whole
               if ".layers.0." not in n)  # the float layers' outputs are not the rounded layers'
    assert len(alone) == 14  # two layers
    for i in range(2):
        one = QuantSpec.parse(f"w=int{BITS}/per_group:{GROUP}; awq:clip_tokens=32; layers:{i}")
        own = awq_model(model, seqs, one, linear_sites(model, one), progress=False)
        assert len(own) == 7
        for n, r in own.items():
            w = model.get_submodule(n).weight
            assert torch.equal(alone[n].weight(w, spec.part("w")), r.weight(w, spec.part("w"))), n


def test_an_awq_spec_runs_through_calibration_for_and_the_perplexity_command(tmp_path):
    """calibration_for reads the spec's calibration text (samples x seqlen) and gives AWQ's scales and bounds, equal to
    awq_model's on those sequences; the perplexity command scores the spec from its text (a KLD above 0)."""
    import json

    import pandas as pd

    from outlierscope.cli import main
    from outlierscope.models.loading import load_model
    from outlierscope.quant.weights.calibration import calibration_for
    from outlierscope.quant.weights.sequential import calibration_sequences

    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"the {w} sat on the mat and looked at the {w}" for w in ("cat", "dog", "owl") * 40))
    spec = QuantSpec.parse(f"w=int4/per_group:32; a=int8/per_token; awq:samples=3,seqlen=48; calib:{text}")
    lm = load_model("pair-tiny:transformer")
    cal = calibration_for(lm.model, lm.tokenizer, spec)
    seqs = calibration_sequences(lm.tokenizer, str(text), spec.awq, None)
    assert seqs.shape == (3, 48)
    direct = awq_model(lm.model, seqs, spec, linear_sites(lm.model, spec), progress=False)
    assert set(cal.rounded) == set(direct) and len(direct) > 0
    for name, r in direct.items():
        got = cal.rounded[name]
        assert (r.scale is None) == (got.scale is None) and (r.clip is None) == (got.clip is None), name
        assert r.scale is None or torch.equal(r.scale, got.scale)
        assert r.clip is None or torch.equal(r.clip, got.clip)
    out = tmp_path / "p"
    assert main(["perplexity", "--model", "pair-tiny:transformer", "--text", str(text), "--length", "32",
                 "--quant", str(spec), "--out", str(out)]) == 0
    assert str(spec) in json.loads((out / "perplexity.json").read_text())["cells"]
    assert pd.read_csv(out / "perplexity.csv").set_index("quant").loc[str(spec)]["kld_mean"] > 0


def test_judge_calls_merge_into_batches_with_the_same_outputs():
    """The attention's recorded calls (20 packed sequences: same positions, no mask) merge 16 at a time; its output on
    the merged calls is the output call by call (float64); calls that differ beyond the hidden states stay apart."""
    from outlierscope.quant.weights.awq_model import _outputs, batched

    model = _llama(2)
    at = model.model.layers[0].self_attn
    seqs = torch.randint(1, 300, (20, 24), generator=torch.Generator().manual_seed(5))
    calls = _capture(model, seqs, {"attn": at})["attn"]
    merged = batched(calls, 16)
    assert [c[1]["hidden_states"].shape[0] for c in merged] == [16, 4]
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(_outputs(at, merged)), torch.cat(_outputs(at, calls)), rtol=0, atol=1e-12)
    other = _capture(model, torch.randint(1, 300, (1, 10), generator=torch.Generator().manual_seed(6)), {"a": at})["a"]
    assert batched(calls[:2] + other, 16) == calls[:2] + other  # another length: no merge
