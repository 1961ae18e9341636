"""GPTQ and AWQ checkpoints without GPT-QModel's kernels (outlierscope.models.packed), issue #40.

The references come from outside the decoder: checkpoints GPT-QModel made itself on a CPU (references/gptq_fixtures.py,
run in its own venv; committed under tests/models/packed/ with GPT-QModel's own dequantized weights and the last
hidden state transformers computes with GPT-QModel's kernels), and the bit layouts packed here bit by bit in
Python integers from the formats' description."""

import json
import shutil
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "packed"
VARIANTS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and p.name != "float")
TOKENIZER = Path(__file__).resolve().parents[2] / "outlierscope" / "pretrained" / "pair-tiny" / "transformer"


def _checkpoint(variant: str, tmp_path) -> Path:
    """The committed checkpoint with the bundled pair's tokenizer beside it (GPT-QModel's runs used the same)."""
    d = Path(shutil.copytree(FIXTURES / variant, tmp_path / variant))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, d / f)
    (d / "reference.safetensors").unlink(missing_ok=True)
    return d


def _pack_bitwise(codes: list[list[int]], bits: int) -> torch.Tensor:
    """Columns of codes packed down each column into int32 words, lowest bits first, as one bit stream."""
    cols = []
    for col in codes:
        stream = sum(c << (bits * i) for i, c in enumerate(col))
        nwords = len(col) * bits // 32
        words = [(stream >> (32 * w)) & 0xFFFFFFFF for w in range(nwords)]
        cols.append([w - (1 << 32) if w >= 1 << 31 else w for w in words])  # int32 two's complement
    return torch.tensor(cols, dtype=torch.int32).t().contiguous()  # (words, columns)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_unpack_codes_reads_a_bitwise_packing(bits):
    """Along either dim, codes of every width come back from words packed bit by bit in Python (3 bits: runs of
    three words holding 32 codes, some straddling two words); 96 codes per column spans several words."""
    from outlierscope.models.packed import unpack_codes

    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (5, 96), generator=g)  # (columns, codes)
    words = _pack_bitwise(codes.tolist(), bits)  # (96 * bits / 32, 5)
    assert torch.equal(unpack_codes(words, bits, 0), codes.t().to(torch.int32))
    assert torch.equal(unpack_codes(words.t().contiguous(), bits, 1), codes.to(torch.int32))


def test_awq_weight_from_a_hand_packed_layer():
    """AWQ gemm: 8 codes per word along the output dim in the order 0, 2, 4, 6, 1, 3, 5, 7 (word field k holds
    column 8w + order[k]); W = (q - z) * s per group of inputs, computed here in float64."""
    from outlierscope.models.packed import awq_weight

    order, fin, fout, group = [0, 2, 4, 6, 1, 3, 5, 7], 64, 24, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (fin, fout), generator=g)  # (in, out)
    z = torch.randint(0, 16, (fin // group, fout), generator=g)  # (groups, out)
    s = (torch.rand(fin // group, fout, generator=g) / 50 + 1e-3).half()  # (groups, out)

    def pack(rows):
        out = []
        for r in rows.tolist():
            words = [sum(r[8 * w + order[k]] << (4 * k) for k in range(8)) for w in range(fout // 8)]
            out.append([w - (1 << 32) if w >= 1 << 31 else w for w in words])
        return torch.tensor(out, dtype=torch.int32)

    want = torch.empty(fout, fin, dtype=torch.float64)
    for i in range(fin):
        for o in range(fout):
            want[o, i] = (q[i, o] - z[i // group, o]).item() * s[i // group, o].double().item()
    got = awq_weight(pack(q), pack(z), s, 4, group)
    assert got.dtype == torch.float32 and torch.equal(got.double(), want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gptqmodels_checkpoints_decode_to_its_own_weights(variant, tmp_path):
    """Loaded by directory: every packed linear holds GPT-QModel's own dequantized weight (float16, bit for bit:
    act-order g_idx, v1 zero points, 3-bit streams, AWQ's column order), and the last hidden state is what
    transformers computes with GPT-QModel's CPU kernels (float16/bfloat16 activations there: within 1%)."""
    from safetensors.torch import load_file

    from outlierscope.models.loading import load_model

    ref = load_file(FIXTURES / variant / "reference.safetensors")
    lm = load_model(str(_checkpoint(variant, tmp_path)), device="cpu")
    weights = {k[len("weight."):]: v for k, v in ref.items() if k.startswith("weight.")}
    assert len(weights) == 14 and lm.decoded["modules"] == 14
    for name, w in weights.items():
        mine = lm.model.get_submodule(name).weight
        assert mine.dtype == torch.float32 and torch.equal(mine.half(), w), name
    with torch.no_grad():
        h = lm.model(ref["input_ids"], output_hidden_states=True).hidden_states[-1]  # (B, T, D)
    err = ((h - ref["last_hidden"]).abs().max() / ref["last_hidden"].abs().max()).item()
    assert err < 1e-2, err


def test_the_record_states_the_checkpoint_and_how_it_was_read(tmp_path):
    """provenance: the quantization_config as GPT-QModel wrote it (bits, group, act order) and that outlierscope
    decoded the packed weights (which forward that is)."""
    from outlierscope.models.loading import load_model

    rec = load_model(str(_checkpoint("gptq-w4g32-asym-actorder", tmp_path))).provenance()
    q = rec["quantization_config"]
    assert (q["quant_method"], q["bits"], q["group_size"], q["desc_act"], q["sym"]) == ("gptq", 4, 32, True, False)
    assert rec["packed_weights"]["method"] == "gptq" and rec["packed_weights"]["modules"] == 14
    assert "float matmul" in rec["packed_weights"]["forward"]


def test_profile_sweep_sensitivity_and_lmeval_on_gptq_and_awq(hs_jsonl, hellaswag_cached, tiny_corpus, tmp_path):
    """Everything runs on them: a profile of every point, a sweep with an attention recipe on top, sensitivity, and
    lm-eval through the adapter (its log-likelihoods evaluate()'s); the records state the quantization_config."""
    import numpy as np
    import pandas as pd

    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from outlierscope.eval.evaluate import evaluate
    from outlierscope.lmeval.adapter import OutlierscopeLM
    from outlierscope.lmeval.tasks import write_task_yamls
    from outlierscope.models.loading import load_model
    from outlierscope.runs.profile import ProfileSettings, profile
    from outlierscope.runs.sensitivity import SensitivitySettings, sensitivity
    from outlierscope.runs.sweep import SweepSettings, sweep

    gptq, awq = (str(_checkpoint(v, tmp_path)) for v in ("gptq-w4g32-asym-actorder", "awq-w4g32-zp"))
    profile([gptq, awq], ProfileSettings(tokens=256, text=str(tiny_corpus / "train.jsonl"), seq_len=64,
                                         points=("layers.*.**",)), tmp_path / "prof", progress=False)
    facts = json.loads((tmp_path / "prof" / "profile.json").read_text())["models"]
    assert sorted(f["quantization_config"]["quant_method"] for f in facts.values()) == ["awq", "gptq"]
    assert sorted(f["packed_weights"]["method"] for f in facts.values()) == ["awq", "gptq"]  # as the README says
    assert {"self_attn.q_proj.input", "mlp.down_proj.input", "attn.logits"} <= set(
        pd.read_csv(tmp_path / "prof" / "per_layer.csv")["point"])
    said = []
    sweep(SweepSettings(models=(gptq,), bits=(16,), quant=("k=int4/per_token",), data=str(hs_jsonl), limit=4,
                        batch_size=4), tmp_path / "sw", progress=False, log=said.append)
    rec = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert rec["model_sources"][gptq]["packed_weights"]["method"] == "gptq"
    # a GPTQ checkpoint's 16-bit cell is no emulation on top of it, not an unquantized model: table and console
    labels = set(pd.read_csv(tmp_path / "sw" / "sweep.csv").query("bits == 16")["label"])
    assert labels == {"16 (no emulation; saved gptq)"}, labels
    assert not any("unquantized" in line for line in said) and any("saved gptq" in line for line in said), said
    rec = sensitivity(SensitivitySettings(model=awq, quant="k=int4/per_token", limit=4, batch_size=8, profile_tokens=256,
                                          all_but=False), tmp_path / "sens", progress=False, log=lambda *_: None)
    assert rec["model_source"]["quantization_config"]["quant_method"] == "awq"
    tasks = write_task_yamls(tmp_path / "tasks", ["hellaswag"])
    res = lm_eval.simple_evaluate(model=OutlierscopeLM(gptq, bits=16, device="cpu", batch_size=4), tasks=tasks, limit=6,
                                  log_samples=True,
                                  task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False))
    theirs = np.array([[float(r[0]) for r in s["filtered_resps"]] for s in res["samples"][tasks[0]]])  # (N, C)
    mine = evaluate(load_model(gptq), limit=6, batch_size=4, progress=False)
    np.testing.assert_allclose(theirs, mine.items[mine.score_columns].to_numpy(), rtol=1e-5, atol=0)


def test_a_gptq_checkpoint_by_hub_id_through_the_stand_in_hub(tmp_path, monkeypatch):
    """Served by the local stand-in Hub (HF_ENDPOINT on 127.0.0.1): loads by ``ORG/NAME`` and computes what the
    directory computes; the record names the Hub commit, the quantization_config and the decoding."""
    from outlierscope.models.loading import load_model
    from tests.models.hub_server import Repo
    from tests.models.test_hub import SHA_MAIN, serving

    path = _checkpoint("gptq-w3g32-sym", tmp_path)
    with serving({"org/tiny-gptq": Repo.from_dir(path, {"main": SHA_MAIN})}, tmp_path, monkeypatch):
        hub, local = load_model("org/tiny-gptq"), load_model(str(path))
        ids = torch.randint(1, 6144, (1, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.equal(hub.model.model(input_ids=ids).last_hidden_state,
                               local.model.model(input_ids=ids).last_hidden_state)
        rec = hub.provenance()
        assert rec["quantization_config"]["bits"] == 3 and rec["packed_weights"]["method"] == "gptq"
        assert SHA_MAIN in json.dumps(rec)


@pytest.mark.parametrize("variant, spec", [
    ("gptq-w4g32-asym-actorder", "w=asym4/per_group:32"),
    ("gptq-w3g32-sym", "w=fint3/per_group:32"),
    ("gptq-w8g64-sym", "w=fint8/per_group:64"),
    ("awq-w4g32-zp", "w=asym4/per_group:32"),
])
def test_the_emulated_scheme_read_from_gptq_and_awq_configs(variant, spec):
    """Bits, groups and grid (GPTQ's symmetric scale 2 absmax / (2^b - 1) is fintB's) as GPT-QModel wrote them; every
    decoder linear packed, the LM head not: no scope items. A checkpoint that packs only the MLP: linears: items."""
    from transformers import AutoConfig

    from outlierscope.models.loading import meta_model
    from outlierscope.models.packed import packed_modules
    from outlierscope.quant.export import spec_from_packed_config

    config = AutoConfig.from_pretrained(FIXTURES / "float")
    qconfig = json.loads((FIXTURES / variant / "config.json").read_text())["quantization_config"]
    names = packed_modules(FIXTURES / variant)
    assert str(spec_from_packed_config(qconfig, meta_model(config), names)) == spec
    mlp = [n for n in names if ".mlp." in n]
    want = f"{spec}; linears:mlp.down_proj,mlp.gate_proj,mlp.up_proj"
    assert str(spec_from_packed_config(qconfig, meta_model(config), mlp)) == want


def _rtn_gptq_checkpoint(src: Path, out: Path, bits: int = 3, group: int = 32) -> Path:
    """GPTQ's v1 layout packed here bit by bit from round-to-nearest codes of ``src``'s float weights (sym: scale
    2 absmax / (2^b - 1) per group of inputs, zero 2^(b-1), stored minus one): a GPTQ checkpoint without GPTQ's
    error correction."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(src / "model.safetensors")
    top = 2 ** bits - 1
    for key in [k for k in tensors if k.endswith("_proj.weight")]:
        w = tensors.pop(key).double()  # (out, in)
        g = w.reshape(w.shape[0], -1, group)  # (out, in / G, G)
        scale = (2 * g.abs().amax(-1) / top)  # (out, in / G)
        codes = (torch.round(g / scale[..., None]) + 2 ** (bits - 1)).clamp(0, top).reshape(w.shape).long()  # (out, in)
        prefix = key[: -len(".weight")]
        tensors[prefix + ".qweight"] = _pack_bitwise(codes.tolist(), bits)  # (in * b / 32, out)
        zeros = torch.full((scale.shape[1], w.shape[0]), 2 ** (bits - 1) - 1)  # (groups, out), v1: zero - 1
        tensors[prefix + ".qzeros"] = _pack_bitwise(zeros.tolist(), bits).t().contiguous()  # (groups, out * b / 32)
        tensors[prefix + ".scales"] = scale.t().half().contiguous()  # (groups, out)
        tensors[prefix + ".g_idx"] = (torch.arange(w.shape[1]) // group).int()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": True,
                                  "desc_act": False, "checkpoint_format": "gptq"}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_compare_quant_on_gptq_shows_its_error_correction(hellaswag_cached, tmp_path):
    """compare-quant reads a GPTQ checkpoint's scheme itself (8 bits, groups of 64). Against its RTN emulation on
    the float weights it came from, a GPTQ-layout checkpoint of RTN codes (packed here) moves the log-likelihoods
    only by its float16 scales and the ties at each group's absmax; GPT-QModel's own GPTQ checkpoint of the same
    scheme (error-corrected codes) moves them far more. The record names GPTQ's error correction."""
    import pandas as pd

    from outlierscope.cli import main

    float_dir = _checkpoint("float", tmp_path)
    rtn = _rtn_gptq_checkpoint(float_dir, tmp_path / "rtn", bits=8, group=64)
    change = {}
    for name, real in (("rtn", rtn), ("gptq", _checkpoint("gptq-w8g64-sym", tmp_path))):
        out = tmp_path / f"cmp-{name}"
        assert main(["compare-quant", "--real", str(real), "--model", str(float_dir), "--limit", "12",
                     "--out", str(out)]) == 0
        t = pd.read_csv(out / "compare.csv").set_index(["a", "b"])
        change[name] = t.loc[("real", "emulated: w=fint8/per_group:64")][["mean_abs_ll_change", "max_abs_ll_change"]].tolist()
        rec = json.loads((out / "compare.json").read_text())
        assert rec["specs"] == ["w=fint8/per_group:64"] and "GPTQ rounds the input columns" in rec["differences"][0]
    # RTN codes: float16 scales and ties at a group's absmax only; GPTQ's codes: about ten times the change here
    assert change["rtn"][0] < 0.25 * change["gptq"][0] and change["rtn"][1] < 0.25 * change["gptq"][1], change


def test_compare_quant_records_what_a_calibrated_emulation_read(hellaswag_cached, tmp_path):
    """An emulation that calibrates (GPTQ on a given text) is recorded in compare.json with the text's sha256 and the
    very token ids it read, on items and on running text."""
    import hashlib

    from outlierscope.cli import main
    from outlierscope.models.loading import load_model
    from outlierscope.quant.specs.spec import QuantSpec
    from outlierscope.quant.weights.sequential import calibration_sequences

    float_dir = _checkpoint("float", tmp_path)
    real = _rtn_gptq_checkpoint(float_dir, tmp_path / "rtn", bits=8, group=64)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"the {w} sat on the mat and looked at the {w}" for w in ("cat", "dog", "owl") * 40))
    spec = QuantSpec.parse(f"w=fint8/per_group:64; gptq:samples=2,seqlen=32; calib:{text}")
    seqs = calibration_sequences(load_model(str(float_dir)).tokenizer, str(text), spec.gptq, None)  # (2, 32)
    want = {str(spec): {"source": str(text), "sha256": hashlib.sha256(text.read_bytes()).hexdigest(),
                        "samples": 2, "seqlen": 32, "tokens": 64,
                        "tokens_sha256": hashlib.sha256(seqs.numpy().tobytes()).hexdigest()}}
    for metric in ("items", "text"):
        out = tmp_path / f"cmp-{metric}"
        on = ["--limit", "4"] if metric == "items" else ["--text", str(text), "--length", "32", "--max-windows", "2"]
        assert main(["compare-quant", "--real", str(real), "--model", str(float_dir), "--quant", str(spec),
                     "--metric", metric, *on, "--out", str(out)]) == 0
        assert json.loads((out / "compare.json").read_text())["calibration"] == want, metric


def _rewrite(d: Path, drop: str | None = None, reshape: str | None = None) -> None:
    """The checkpoint's tensors saved again without ``drop`` / with ``reshape`` cut to its first half of rows."""
    from safetensors.torch import load_file, save_file

    t = load_file(d / "model.safetensors")
    if drop:
        del t[drop]
    if reshape:
        t[reshape] = t[reshape][: t[reshape].shape[0] // 2].contiguous()
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})


def _set_config(d: Path, **quant) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(quant)
    (d / "config.json").write_text(json.dumps(cfg))


L0 = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("variant, change, msg", [
    ("awq-w4g32-zp", lambda d: _set_config(d, group_size=64), r"qzeros has shape \(\d+, \d+\), but 4 bits and group_size 64"),
    ("awq-w4g32-zp", lambda d: _set_config(d, group_size=48), "group_size 48 over the model's"),
    ("gptq-w4g32-asym-actorder", lambda d: _set_config(d, group_size=64), "the quantization_config .bits, group_size. and"),
    ("gptq-w4g32-asym-actorder", lambda d: _rewrite(d, drop=f"{L0}.qzeros"), f"{L0}.qzeros is missing"),
    ("awq-w4g32-zp", lambda d: _rewrite(d, drop=f"{L0}.scales"), f"{L0}.scales is missing"),
    ("gptq-w3g32-sym", lambda d: _rewrite(d, reshape=f"{L0}.qweight"), f"{L0}.qweight has shape"),
])
def test_a_packed_checkpoint_that_disagrees_with_its_config_is_one_line(variant, change, msg, tmp_path):
    """A missing tensor, a cut qweight, a group_size that disagrees with the packed tensors (AWQ's 64 or 48 over 32
    decoded wrong weights silently): one line from check_model, before anything loads."""
    from outlierscope.errors import OutlierscopeError
    from outlierscope.models.loading import check_model

    d = _checkpoint(variant, tmp_path)
    change(d)
    with pytest.raises(OutlierscopeError, match=msg) as e:
        check_model(str(d))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("what, msg", [
    ("cut", "not a readable safetensors file"),
    ("string", "quantization_config is a str, expected an object"),
    ("unknown", "quant_method 'gptqq' is not one transformers loads.*did you mean gptq"),
])
def test_a_broken_checkpoint_is_one_line_before_loading(what, msg, tmp_path):
    """A cut safetensors file, a quantization_config written as a string, an unknown quant_method (it loaded the
    float weights silently): one line from check_model."""
    from outlierscope.errors import OutlierscopeError
    from outlierscope.models.loading import check_model

    d = _checkpoint("gptq-w8g64-sym", tmp_path)
    if what == "cut":
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    else:
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"] = json.dumps(cfg["quantization_config"]) if what == "string" else \
            {**cfg["quantization_config"], "quant_method": "gptqq"}
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(OutlierscopeError, match=msg) as e:
        check_model(str(d))
    assert "\n" not in str(e.value)
