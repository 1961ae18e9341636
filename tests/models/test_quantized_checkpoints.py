"""Quantized checkpoints as users download them (issue #40): a compressed-tensors W8A8 checkpoint made here with
compressed-tensors' own API (no network), loaded by directory. The reference is compressed-tensors' own quantized
forward: the whole model run by transformers, whose first forward decompresses the packed weights."""

import json
from pathlib import Path

import pytest
import torch

from outlierscope.quant.specs.spec import QuantSpec

ct = pytest.importorskip("compressed_tensors")


def _checkpoint(src: str, out, preset: str = "W8A8", group: int | None = None):
    """A model of the test pair as compressed-tensors' ``preset`` (W8A8: int8 per-channel weights, int8 dynamic
    per-token activations; W4A16: int4 weights in groups of ``group`` inputs), RTN with compressed-tensors' own
    scales (calculate_qparams on each channel's or group's min and max), the LM head ignored, saved compressed."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    from outlierscope.models.loading import load_model

    lm = load_model(src)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group is not None:
        scheme.weights.group_size = group
    w = scheme.weights
    apply_quantization_config(lm.model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for mod in lm.model.modules():
        if hasattr(mod, "weight_scale"):
            weight = mod.weight.data  # (O, I)
            grouped = w.strategy in ("group", "tensor_group")
            gscale = None
            if w.strategy == "tensor_group":  # NVFP4: a float32 per-tensor scale above the E4M3 group scales
                gscale = generate_gparam(weight.amin()[None], weight.amax()[None])
                mod.weight_global_scale.data.copy_(gscale.reshape(mod.weight_global_scale.shape))
            if grouped:
                weight = weight.reshape(weight.shape[0], -1, w.group_size)  # (O, I/G, G)
            lo, hi = weight.amin(-1), weight.amax(-1)  # (O, I/G) or (O,)
            scale, _ = calculate_qparams(lo if grouped else lo[:, None], hi if grouped else hi[:, None], w,
                                         global_scale=gscale)
            mod.weight_scale.data.copy_(scale.reshape(mod.weight_scale.shape))
            mod.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(lm.model)
    compressor.compress_model(lm.model)
    lm.model.save_pretrained(out)
    compressor.update_config(out)
    lm.tokenizer.save_pretrained(out)
    return out


def _w8a8_checkpoint(src: str, out):
    return _checkpoint(src, out)


@pytest.mark.parametrize("role, preset, group, spec, fmt", [
    ("transformer", "W4A16", 16, "w=fint4/per_group:16", "pack-quantized"),
    ("diff", "W8A8", None, "a=fint8/per_token; w=fint8/per_channel", "int-quantized"),
    ("diff", "W4A16", 16, "w=fint4/per_group:16", "pack-quantized"),
    ("transformer", "FP8_DYNAMIC", None, "a=e4m3/per_token; w=e4m3/per_channel", "float-quantized"),
    ("transformer", "NVFP4A16", None, "w=nvfp4", "nvfp4-pack-quantized"),
    ("transformer", "MXFP4A16", None, "w=ct-mxfp4", "mxfp4-pack-quantized"),
    ("pair-tiny:diff", "W8A8", None, "a=fint8/per_token; w=fint8/per_channel", "int-quantized"),  # the bundled pair
    ("pair-tiny:transformer", "W4A16", 32, "w=fint4/per_group:32", "pack-quantized"),
])
def test_checkpoints_of_both_models_equal_their_own_forward_and_the_emulation(role, preset, group, spec, fmt,
                                                                             tiny_pair, tmp_path):
    """W4A16 (packed int4 groups) and the Diff model, of the random test pair and the bundled trained pair: loaded by
    directory, the trunk gives compressed-tensors' own whole-model forward; the spec read from the
    quantization_config is the one written here, and the float model under it gives the same hidden states bit for
    bit."""
    from transformers import AutoModelForCausalLM

    from outlierscope.models.loading import load_model, meta_model
    from outlierscope.quant.apply import quantize_model
    from outlierscope.quant.export import spec_from_config
    from outlierscope.quant.specs.spec import QuantSpec

    src = role if role.startswith("pair-tiny:") else str(tiny_pair[role])  # the bundled pair, or the random test pair
    path = _checkpoint(src, tmp_path / "ckpt", preset, group)
    qconfig = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qconfig["format"] == fmt
    real, plain = load_model(str(path)), load_model(src)
    ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    ref_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    derived = spec_from_config(qconfig, meta_model(real.model.config))
    assert derived == QuantSpec.parse(spec)
    with torch.no_grad():
        trunk = real.model.model(input_ids=ids).last_hidden_state  # (B, T, D)
        if preset.startswith("NVFP4"):  # their forward decompresses to bfloat16, on which a float32 model fails
            _assert_nvfp4_decoded_in_float32(real.model, path)
        elif preset.startswith("MXFP4"):  # E2M1 codes times powers of 2: their bfloat16 decompression is exact
            ref_model.hf_quantizer.compressor.decompress_model(ref_model)
            for p in ref_model.parameters():
                p.data = p.data.float()
            assert torch.equal(trunk, ref_model.model(input_ids=ids).last_hidden_state)
        else:
            assert torch.equal(trunk, ref_model(input_ids=ids, output_hidden_states=True).hidden_states[-1])
        with quantize_model(plain.model, derived):
            assert torch.equal(plain.model.model(input_ids=ids).last_hidden_state, trunk)
        assert not torch.equal(plain.model.model(input_ids=ids).last_hidden_state, trunk)


def _assert_nvfp4_decoded_in_float32(model, path):
    """Every NVFP4 linear's weight is the float32 decode of the checkpoint's tensors, computed here from the bytes
    with float64 arithmetic and explicit float32 roundings: E2M1 nibbles (low nibble first, sign bit 8) times the
    effective scale fp32(e4m3 scale / global scale), rounded to float32 once more (compressed-tensors' order)."""
    from safetensors.torch import load_file

    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    tensors = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    names = [k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")]
    assert len(names) >= 7
    modules = dict(model.named_modules())
    for name in names:
        packed = tensors[f"{name}.weight_packed"].long()  # (O, I / 2)
        nibbles = torch.stack((packed & 0xF, packed >> 4), -1).flatten(1)  # (O, I)
        q = e2m1[nibbles & 7] * torch.where(nibbles & 8 > 0, -1.0, 1.0)
        s = tensors[f"{name}.weight_scale"].double()  # (O, I / 16)
        eff = (s / tensors[f"{name}.weight_global_scale"].double()).float().double()  # fp32(s / gs)
        want = (q.reshape(q.shape[0], -1, 16) * eff[..., None]).float().reshape(q.shape)  # fp32(q * eff)
        got = modules[name].weight
        assert got.dtype == torch.float32 and torch.equal(got, want), name


def test_compressed_tensors_w8a8_loads_by_directory_and_scores(tiny_pair, hs_jsonl, tmp_path):
    """load_model decompresses at load: the trunk alone (as the scorer and the hooks run it) gives the hidden states of
    compressed-tensors' own whole-model forward exactly, with int8 weights dequantized and activations quantized
    (the output differs from the float model's); evaluate scores it."""
    from transformers import AutoModelForCausalLM

    from outlierscope.eval.evaluate import evaluate
    from outlierscope.models.loading import load_model

    path = _w8a8_checkpoint(str(tiny_pair["transformer"]), tmp_path / "w8a8")
    lm = load_model(str(path))
    assert lm.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32  # decompressed
    ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    ref_model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")  # decompressed by its hook
    with torch.no_grad():
        trunk = lm.model.model(input_ids=ids).last_hidden_state  # (B, T, D)
        ref = ref_model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        plain = load_model(str(tiny_pair["transformer"])).model.model(input_ids=ids).last_hidden_state
    assert torch.equal(trunk, ref)
    assert (trunk - plain).abs().max() > 1e-4 * plain.abs().max()
    res = evaluate(lm, data=hs_jsonl, limit=4, batch_size=4, progress=False)
    assert 0 <= res.metrics["acc"] <= 1 and len(res.items) == 4


def test_the_record_states_the_checkpoints_quantization(tiny_pair, tmp_path):
    """provenance (what every run record says of its model) carries the checkpoint's quantization_config: the scheme
    as written here, the ignored LM head; a full-precision model's record has no such key."""
    from outlierscope.models.loading import load_model

    rec = load_model(str(_w8a8_checkpoint(str(tiny_pair["transformer"]), tmp_path / "w8a8"))).provenance()
    q = rec["quantization_config"]
    group = q["config_groups"]["group_0"]
    assert q["quant_method"] == "compressed-tensors" and q["ignore"] == ["lm_head"]
    assert (group["weights"]["num_bits"], group["weights"]["strategy"]) == (8, "channel")
    assert (group["input_activations"]["strategy"], group["input_activations"]["dynamic"]) == ("token", True)
    assert "quantization_config" not in load_model(str(tiny_pair["transformer"])).provenance()


def test_profile_and_sweep_of_a_checkpoint(tiny_pair, hs_jsonl, tiny_corpus, tmp_path):
    """Everything works on it: a profile of every point (the linears' inputs among them) and a sweep with an attention
    recipe on top; both records state its quantization_config."""
    from outlierscope.runs.profile import ProfileSettings, profile
    from outlierscope.runs.sweep import SweepSettings, sweep

    path = str(_w8a8_checkpoint(str(tiny_pair["transformer"]), tmp_path / "w8a8"))
    profile([path], ProfileSettings(tokens=512, text=str(tiny_corpus / "train.jsonl"), seq_len=64,
                                    points=("layers.*.**",)), tmp_path / "prof", progress=False)
    facts = json.loads((tmp_path / "prof" / "profile.json").read_text())["models"]
    assert next(iter(facts.values()))["quantization_config"]["quant_method"] == "compressed-tensors"
    import pandas as pd

    points = set(pd.read_csv(tmp_path / "prof" / "per_layer.csv")["point"])
    assert {"self_attn.q_proj.input", "mlp.down_proj.input", "attn.logits"} <= points
    sweep(SweepSettings(models=(path,), bits=(16,), quant=("k=int4/per_token",), data=str(hs_jsonl), limit=4,
                        batch_size=4), tmp_path / "sw", progress=False, log=lambda *_: None)
    rec = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert rec["model_sources"][path]["quantization_config"]["ignore"] == ["lm_head"]


def test_a_checkpoint_by_hub_id_through_the_stand_in_hub(tiny_pair, tmp_path, monkeypatch):
    """The same checkpoint served by the local stand-in Hub (HF_ENDPOINT on 127.0.0.1) loads by ``ORG/NAME`` and
    computes what it computes loaded by directory; its record names the Hub commit and the quantization_config."""
    from outlierscope.models.loading import load_model
    from tests.models.hub_server import Repo
    from tests.models.test_hub import SHA_MAIN, serving

    path = _w8a8_checkpoint(str(tiny_pair["transformer"]), tmp_path / "w8a8")
    with serving({"org/tiny-w8a8": Repo.from_dir(path, {"main": SHA_MAIN})}, tmp_path, monkeypatch):
        hub, local = load_model("org/tiny-w8a8"), load_model(str(path))
        ids = torch.randint(1, 300, (1, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(hub.model.model(input_ids=ids).last_hidden_state,
                               local.model.model(input_ids=ids).last_hidden_state)
        rec = hub.provenance()
        assert rec["quantization_config"]["quant_method"] == "compressed-tensors" and SHA_MAIN in json.dumps(rec)


@pytest.mark.parametrize("quant, msg", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "checkpoint_format": "marlin"},
     "a GPTQ checkpoint in format 'marlin' with 4 bits is not decoded here"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "an AWQ checkpoint of version 'gemv' with 4 bits is not decoded here"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
     "config.json says gptq, but the safetensors hold no packed weights"),
])
def test_a_checkpoint_whose_loader_is_missing_fails_before_any_work(quant, msg, tiny_pair, hs_jsonl, tmp_path, capsys):
    """Without optimum/gptqmodel installed: a GPTQ/AWQ layout outlierscope does not decode is one line naming the
    packages (and the device their kernels need), a GPTQ config over float weights one line too; both before the
    first model's cells (nothing written)."""
    import importlib.util
    import shutil

    from outlierscope.cli import main

    if importlib.util.find_spec("optimum") and importlib.util.find_spec("gptqmodel"):
        pytest.skip("optimum and gptqmodel are installed here")
    d = tmp_path / "gptq"
    shutil.copytree(tiny_pair["transformer"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = quant
    (d / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    rc = main(["sweep", "--model", str(tiny_pair["diff"]), "--model", str(d), "--bits", "16", "--data", str(hs_jsonl),
               "--limit", "4", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and msg in err[0], err
    assert ("install gptqmodel" in err[0]) == ("not decoded" in msg)
    assert not out.exists()


def test_the_emulation_on_compressed_tensors_grid_is_the_checkpoint(tiny_pair, tmp_path):
    """Emulated vs real: the float model under `w=fint8/per_channel; a=fint8/per_token` (compressed-tensors' full-range
    grid), which is the named w8a8, gives the W8A8 checkpoint's hidden states exactly; w8a8-restricted (absmax / 127)
    does not."""
    from outlierscope.models.loading import load_model
    from outlierscope.quant.apply import quantize_model

    real = load_model(str(_w8a8_checkpoint(str(tiny_pair["transformer"]), tmp_path / "w8a8")))
    plain = load_model(str(tiny_pair["transformer"]))
    ids = torch.randint(1, 300, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = real.model.model(input_ids=ids).last_hidden_state  # (B, T, D)
        with quantize_model(plain.model, "w=fint8/per_channel; a=fint8/per_token"):
            full = plain.model.model(input_ids=ids).last_hidden_state
        with quantize_model(plain.model, "w8a8"):
            named = plain.model.model(input_ids=ids).last_hidden_state
        with quantize_model(plain.model, "w8a8-restricted"):
            restricted = plain.model.model(input_ids=ids).last_hidden_state
    assert torch.equal(full, want) and torch.equal(named, want)
    assert (restricted - want).abs().max() > 1e3 * (full - want).abs().max().clamp_min(1e-12)


def test_compare_quant_reads_the_scheme_and_pairs_items(tiny_pair, hs_jsonl, hellaswag_cached, tmp_path):
    """compare-quant on the W8A8 checkpoint: the scheme read from its quantization_config is compressed-tensors' grid
    (fint8); that emulation scores every item exactly as the checkpoint does (no log-likelihood moves), our
    w8a8-restricted moves them; float vs real equals float vs the exact emulation (computed here from the cells)."""
    import pandas as pd

    from outlierscope.cli import main

    ckpt = _w8a8_checkpoint(str(tiny_pair["transformer"]), tmp_path / "w8a8")
    out = tmp_path / "cmp"
    assert main(["compare-quant", "--real", str(ckpt), "--model", str(tiny_pair["transformer"]), "--limit", "12",
                 "--quant", "w8a8-restricted", "--out", str(out)]) == 0
    t = pd.read_csv(out / "compare.csv").set_index(["a", "b"])
    exact = t.loc[("real", "emulated: a=fint8/per_token; w=fint8/per_channel")]
    assert exact["max_abs_ll_change"] == 0 and exact["acc_norm_pred_differs"] == 0
    assert t.loc[("real", "emulated: a=int8/per_token; w=int8/per_channel")]["max_abs_ll_change"] > 1e-4
    real = pd.read_csv(next((out / "real/cells").glob("*_b16_*.csv")))
    base = pd.read_csv(next(p for p in (out / "emulated/cells").glob("*_b16_*.csv")))
    cols = [c for c in real if c.startswith("score")]
    want = (real[cols] - base[cols]).abs().to_numpy().mean()
    assert t.loc[("float", "real")]["mean_abs_ll_change"] == pytest.approx(want, rel=1e-12) and want > 0
    rec = json.loads((out / "compare.json").read_text())
    assert rec["quantization_config"]["quant_method"] == "compressed-tensors"
    assert rec["specs"] == ["a=fint8/per_token; w=fint8/per_channel", "a=int8/per_token; w=int8/per_channel"]


def _kl_rows(p_logits, q_logits, first: int, n: int) -> list[float]:
    """KL(p || q) at positions first .. first + n - 1 of two (T, V) logit tensors, in float64 from the definition."""
    import numpy as np

    p, q = torch.softmax(p_logits.double(), -1).numpy(), torch.softmax(q_logits.double(), -1).numpy()
    return [float(np.sum(p[i] * (np.log(p[i]) - np.log(q[i])))) for i in range(first, first + n)]


def test_compare_quant_on_text_is_the_kl_between_the_two_models(tiny_pair, tmp_path, capsys):
    """compare-quant --metric text on the W8A8 checkpoint over windows of every virtual shard: each pair's per-token
    KL(a || b) equals KL divergences computed here from each model's own full forward (the checkpoint's, the float
    model's, the float model under each emulation); the exact emulation moves no token against the checkpoint (KLD 0
    everywhere), w8a8-restricted does; a second run recomputes nothing."""
    import numpy as np
    import pandas as pd

    from outlierscope.cli import main
    from outlierscope.eval.perplexity import TokenScores
    from outlierscope.models.loading import load_model
    from outlierscope.quant.apply import quantize_model
    from outlierscope.runs.compare import CompareSettings
    from outlierscope.runs.compare_text import text_windows

    ckpt = _w8a8_checkpoint(str(tiny_pair["transformer"]), tmp_path / "w8a8")
    txt = tmp_path / "t.txt"
    txt.write_text(" ".join(f"the {w} went to the {w}s and back again" for w in ("cat", "dog", "fox") * 30))
    argv = ["compare-quant", "--real", str(ckpt), "--model", str(tiny_pair["transformer"]), "--metric", "text",
            "--text", str(txt), "--length", "24", "--quant", "w8a8-restricted", "--out", str(tmp_path / "cmp")]
    assert main(argv) == 0
    t = pd.read_csv(tmp_path / "cmp" / "compare.csv").set_index("label")
    exact, ours = "a=fint8/per_token; w=fint8/per_channel", "a=int8/per_token; w=int8/per_channel"
    s = CompareSettings(real=str(ckpt), model=str(tiny_pair["transformer"]), metric="text", text=str(txt), length=24,
                        quant=("w8a8-restricted",))
    windows = text_windows(s, log=lambda *a: None)["windows"]  # every model checked here anew
    assert len(windows) >= 20  # more windows than virtual shards: every shard holds one
    real, flt = load_model(str(ckpt)), load_model(str(tiny_pair["transformer"]))
    want = {f"{b} against {a}": [] for b, a in (("real", "float"), (f"emulated: {exact}", "float"),
                                                (f"emulated: {ours}", "float"), (f"emulated: {exact}", "real"),
                                                (f"emulated: {ours}", "real"))}
    for w in windows:
        ids, n = torch.tensor([w.input_ids]), len(w.targets)
        logits = {}
        with torch.no_grad():
            for name, model, spec in (("float", flt, QuantSpec()), ("real", real, QuantSpec()),
                                      (f"emulated: {exact}", flt, QuantSpec.parse(exact)),
                                      (f"emulated: {ours}", flt, QuantSpec.parse(ours))):
                with quantize_model(model.model, spec):  # the toolkit's attention function, as every cell runs it
                    logits[name] = model.model(input_ids=ids).logits[0]  # (T, V)
        for key in want:
            b, a = key.split(" against ")
            want[key] += _kl_rows(logits[a], logits[b], w.first, n)
    for key, values in want.items():
        got = TokenScores.load(tmp_path / "cmp" / "cells" / f"{t.loc[key, 'cell']}.npz").kld
        np.testing.assert_allclose(got, values, rtol=1e-4, atol=1e-9, err_msg=key)
        assert t.loc[key, "kld_mean"] == pytest.approx(np.mean(values), rel=1e-4, abs=1e-12)
    same = f"emulated: {exact} against real"
    assert t.loc[same, "kld_max"] == 0 and t.loc[same, "same_top"] == 1
    assert t.loc[f"emulated: {ours} against real", "kld_mean"] > 1e-6
    rec = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert rec["windows"] == len(windows) and rec["settings"]["metric"] == "text"
    assert (tmp_path / "cmp" / "figures" / "kld_distribution.png").exists()
    capsys.readouterr()
    assert main(argv) == 0 and "0 to compute" in capsys.readouterr().out
    assert main([*argv, "--max-windows", "5"]) == 2  # other settings: refused before any work
    assert "holds a comparison with other settings" in capsys.readouterr().err


@pytest.mark.parametrize("flags, msg", [(["--metric", "text", "--limit", "5"], "--limit must be its default None"),
                                        (["--text", "x.txt"], "--text must be its default 'lambada'"),
                                        (["--metric", "text", "--max-windows", "0"], "--max-windows must be >= 1")])
def test_compare_quant_metric_settings_are_one_line(flags, msg, tiny_pair, tmp_path, capsys):
    from outlierscope.cli import main

    out = tmp_path / "cmp"
    assert main(["compare-quant", "--real", str(tmp_path / "none"), "--model", str(tiny_pair["transformer"]),
                 *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1 and not out.exists()


def _bnb_checkpoint(src: str, out, bits: int):
    """The test pair's Transformer saved by transformers + bitsandbytes on the CPU (8-bit LLM.int8 or 4-bit NF4)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    cfg = BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else \
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(src, quantization_config=cfg, device_map="cpu").save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


@pytest.mark.parametrize("bits, layer", [(8, "Linear8bitLt"), (4, "Linear4bit")])
def test_bitsandbytes_saved_checkpoints_load_and_score(bits, layer, tmp_path):
    """A bitsandbytes-saved model loads by directory with its quantized layers; the trunk gives transformers' own
    forward of the same checkpoint; a profile of the hidden states and an evaluation run on it."""
    from transformers import AutoModelForCausalLM

    from outlierscope.eval.evaluate import evaluate
    from outlierscope.models.loading import load_model, resolve_spec

    src = str(resolve_spec("pair-tiny:transformer"))  # bitsandbytes' CPU 4-bit kernel needs wider layers than 32
    path = _bnb_checkpoint(src, tmp_path / f"bnb{bits}", bits)
    lm = load_model(str(path))
    assert type(lm.model.model.layers[0].mlp.down_proj).__name__ == layer
    ids = torch.randint(1, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", attn_implementation="eager")
    with torch.no_grad():
        plain = load_model(src).model.model(input_ids=ids).last_hidden_state
        trunk = lm.model.model(input_ids=ids).last_hidden_state
        assert torch.equal(trunk, ref.model(input_ids=ids).last_hidden_state)
    assert (trunk - plain).abs().max() > 1e-4 * plain.abs().max()  # quantized
    assert lm.provenance()["quantization_config"]["quant_method"] == "bitsandbytes"
    res = evaluate(lm, limit=4, batch_size=4, progress=False)
    assert len(res.items) == 4


def test_a_bitsandbytes_config_over_float_weights_is_one_line(tiny_pair, tmp_path, capsys):
    """A config.json asking bitsandbytes for load_in_8bit over full-precision weights (a defect: a traceback in the
    first forward, as transformers takes them for quantized ones) is refused in one line before any work."""
    import shutil

    from outlierscope.cli import main

    path = tmp_path / "float-8bit"
    shutil.copytree(tiny_pair["transformer"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    (path / "config.json").write_text(json.dumps(cfg))
    assert main(["sweep", "--model", str(path), "--bits", "16", "--limit", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "full-precision ones" in err and len(err.splitlines()) == 1 and not (tmp_path / "o").exists()


def test_sensitivity_and_the_lmeval_adapter_on_a_checkpoint(tiny_pair, hellaswag_cached, tmp_path):
    """Sensitivity of an attention recipe on top of the W8A8 checkpoint (its record states the quantization_config),
    and lm-eval's run through the adapter on the checkpoint: its log-likelihoods are evaluate()'s item by item."""
    import numpy as np

    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from outlierscope.eval.evaluate import evaluate
    from outlierscope.lmeval.adapter import OutlierscopeLM
    from outlierscope.lmeval.tasks import write_task_yamls
    from outlierscope.models.loading import load_model
    from outlierscope.runs.sensitivity import SensitivitySettings, sensitivity

    path = str(_w8a8_checkpoint(str(tiny_pair["transformer"]), tmp_path / "w8a8"))
    rec = sensitivity(SensitivitySettings(model=path, quant="k=int4/per_token", limit=4, batch_size=8, profile_tokens=256,
                                          all_but=False), tmp_path / "sens", progress=False, log=lambda *_: None)
    assert rec["model_source"]["quantization_config"]["quant_method"] == "compressed-tensors"
    tasks = write_task_yamls(tmp_path / "tasks", ["hellaswag"])
    res = lm_eval.simple_evaluate(model=OutlierscopeLM(path, bits=16, device="cpu", batch_size=4), tasks=tasks, limit=6,
                                  log_samples=True,
                                  task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False))
    theirs = np.array([[float(r[0]) for r in s["filtered_resps"]] for s in res["samples"][tasks[0]]])  # (N, C)
    mine = evaluate(load_model(path), limit=6, batch_size=4, progress=False)
    # lm-eval batches otherwise: float32 rounding can move an activation across an int8 step of the checkpoint's own
    # per-token quantization (a few 1e-4 nats on ~100), never a prediction
    np.testing.assert_allclose(theirs, mine.items[mine.score_columns].to_numpy(), rtol=1e-5, atol=0)
    assert (theirs.argmax(1) == mine.items["pred"].to_numpy()).all()


def test_compare_quant_checks_everything_before_the_real_sweep(tiny_pair, hellaswag_cached, tmp_path, capsys):
    """A float model the checkpoint did not come from (the 64-wide GPTQ fixtures' source against the 192-wide pair's
    W8A8 checkpoint) and earlier results with other settings: one line, exit 2, before any cell (nothing written);
    --force replaces the tables and reuses the cells."""
    import shutil

    from outlierscope.cli import main

    ckpt = _w8a8_checkpoint(str(tiny_pair["transformer"]), tmp_path / "w8a8")
    other = Path(shutil.copytree(Path(__file__).parent / "packed" / "float", tmp_path / "other"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_pair["transformer"]) / f, other / f)
    out = tmp_path / "cmp"
    capsys.readouterr()  # the checkpoint's making printed progress
    assert main(["compare-quant", "--real", str(ckpt), "--model", str(other), "--limit", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--model must be the float model" in err and "in the checkpoint" in err and err.count("\n") == 1
    assert not out.exists()
    argv = ["compare-quant", "--real", str(ckpt), "--model", str(tiny_pair["transformer"]), "--out", str(out)]
    assert main([*argv, "--limit", "2", "--quant", "w=fint4/per_group:7"]) == 2  # an emulation that does not fit
    assert "not a multiple of the group size 7" in capsys.readouterr().err and not out.exists()
    assert main([*argv, "--limit", "2"]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in (out / "real" / "cells").iterdir()}
    assert main([*argv, "--limit", "3"]) == 2  # other settings: refused before the real sweep reruns anything
    assert "holds a sweep with other settings" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in (out / "real" / "cells").iterdir()} == before
    assert main([*argv, "--limit", "3", "--force"]) == 0
