import json

import pytest
import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.models.loading import load_model, resolve_spec
from outlierscope.models.presets import PairConfig
from outlierscope.train.tokenizer import train_bpe


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny HF directory (config.json + safetensors + tokenizer.json) made here, no downloads."""
    d = tmp_path_factory.mktemp("hf") / "tiny-llama"
    cfg = PairConfig.from_name("pair-test")
    cfg.build("transformer").save_pretrained(d)
    tok = train_bpe(["hello world, the history of the world is long."] * 50, vocab_size=cfg.vocab_size)
    tok.save_pretrained(d)
    return d


def test_load_directory(model_dir):
    lm = load_model(str(model_dir))
    assert lm.model_type == "llama" and not lm.model.training
    assert lm.tokenizer("hello world").input_ids
    import hashlib

    assert lm.weights_sha256() == hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
    with torch.no_grad():
        out = lm.model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, 512)


@pytest.mark.parametrize(
    "spec,msg",
    [
        ("/nonexistent/model", "model directory not found: /nonexistent/model"),
        ("pair-tny:diff", "did you mean pair-tiny:diff"),
        ("pair-tiny:dif", "did you mean pair-tiny:diff"),
        ("pair-base:diff", "no bundled weights for pair-base:diff"),
        ("gpt2", r"is neither a directory, a Hub id \(ORG/NAME\[@REVISION\]\), a fetchable model .smollm2-135m. nor a preset"),
    ],
)
def test_spec_errors(spec, msg):
    with pytest.raises(OutlierscopeError, match=msg):
        resolve_spec(spec)


def test_dir_without_config(tmp_path):
    with pytest.raises(OutlierscopeError, match="has no config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
    with pytest.raises(OutlierscopeError, match="unsupported architecture"):
        load_model(str(tmp_path))


def test_not_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(OutlierscopeError, match="not a causal LM"):
        load_model(str(tmp_path))


def test_broken_tokenizer(model_dir, tmp_path):
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(model_dir, d)
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(OutlierscopeError, match="tokenizer cannot be loaded"):
        load_model(str(d))


def test_no_weights(model_dir, tmp_path):
    import shutil

    d = tmp_path / "noweights"
    shutil.copytree(model_dir, d)
    (d / "model.safetensors").unlink()
    with pytest.raises(OutlierscopeError, match="has no weights"):
        load_model(str(d))


@pytest.mark.parametrize("model_type,extra", [("bert", {}), ("t5", {"is_encoder_decoder": True})])
def test_encoder_models_are_refused(tmp_path, model_type, extra):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **extra}))
    with pytest.raises(OutlierscopeError, match=f"model_type '{model_type}' is not a causal language model"):
        load_model(str(tmp_path))


def _copy_with(model_dir, tmp_path, edit):
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "edited"
    shutil.copytree(model_dir, d)
    weights = load_file(d / "model.safetensors")
    edit(weights)
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    return d


def test_missing_tensor_is_refused(model_dir, tmp_path):
    d = _copy_with(model_dir, tmp_path, lambda w: w.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(OutlierscopeError, match=r"lack 1 tensor\(s\) the model needs \(model.layers.0.mlp.up_proj.weight\)"):
        load_model(str(d))


def test_shape_mismatch_says_what(model_dir, tmp_path):
    def shrink(w):
        w["model.norm.weight"] = w["model.norm.weight"][:3].clone()

    d = _copy_with(model_dir, tmp_path, shrink)
    with pytest.raises(OutlierscopeError) as e:
        load_model(str(d))
    assert "tensor model.norm.weight has shape (3,) in the checkpoint but the config expects (" in str(e.value)


def test_loading_leaves_logging_as_it_was(model_dir):
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_info()
    try:
        load_model(str(model_dir))
        assert hf_logging.get_verbosity() == hf_logging.INFO
    finally:
        hf_logging.set_verbosity(before)


def test_generate_bad_prompts(capsys):
    from outlierscope.cli import main

    assert main(["generate", "pair-tiny:transformer", ""]) == 2
    assert capsys.readouterr().err == "outlierscope: error: prompt must be a non-empty string, got ''\n"
    long = "the history of the city " * 200  # far over the 256-token context
    assert main(["generate", "pair-tiny:transformer", long, "--max-new-tokens", "5", "--temperature", "0"]) == 0
    cap = capsys.readouterr()
    assert cap.err.startswith("outlierscope: warning: prompt of ") and "cut to its last 251" in cap.err
    assert main(["generate", "pair-tiny:transformer", "x", "--max-new-tokens", "300"]) == 2
    assert "--max-new-tokens must be less than the model's context of 256 tokens, got 300" in capsys.readouterr().err


def test_device_and_dtype_resolution():
    from outlierscope.errors import ParamError
    from outlierscope.models.loading import check_placement, resolve_device, resolve_dtype

    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ParamError, match="device must be one of auto, cpu, cuda, cuda:N, got 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(OutlierscopeError, match="device cuda:1 requested but .* sees no CUDA GPU; use device 'cpu'"):
            resolve_device("cuda:1")
    assert resolve_dtype("auto", "cpu", "bfloat16") == "float32"  # the CPU computes in float32
    assert resolve_dtype("auto", "cuda", "bfloat16") == "bfloat16"  # a bf16 checkpoint stays bf16 on a GPU
    assert resolve_dtype("auto", "cuda:0", "float32") == "float32"
    assert resolve_dtype("auto", "cuda", None) == "float32"
    assert resolve_dtype("float16", "cpu", "bfloat16") == "float16"
    with pytest.raises(ParamError, match="device_map must be auto, balanced"):
        check_placement("auto", "auto", "everywhere", None)
    with pytest.raises(ParamError, match="attn_block must be a positive number of query rows"):
        check_placement("auto", "auto", None, 0)
    with pytest.raises(ParamError, match="device must be one of"):
        check_placement("gpu", "auto", None, None)


def test_load_model_records_device_and_dtype(model_dir):
    lm = load_model(str(model_dir), device="cpu", dtype="auto")
    assert (lm.device, lm.dtype) == ("cpu", "float32")
    lm16 = load_model(str(model_dir), device="cpu", dtype="bfloat16")
    assert lm16.dtype == "bfloat16"


def test_tokenizer_past_vocab_is_refused_at_load(model_dir, tmp_path):
    """A tokenizer with ids beyond the embedding's rows: refused when loading, not as an IndexError in a forward."""
    import shutil

    d = tmp_path / "big-tok"
    shutil.copytree(model_dir, d)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_tokens([f"<extra{i}>" for i in range(600)])  # ids past the 512 rows
    tok.save_pretrained(d)
    with pytest.raises(OutlierscopeError, match=r"the tokenizer has ids up to \d+ but the model's embedding has 512 rows"):
        load_model(str(d))


@pytest.mark.parametrize("name", ["max_position_embeddings", "n_positions", "max_target_positions", "max_sequence_length",
                                  "seq_length", "n_ctx"])
def test_context_length_names(name):
    """Each known config name gives the context; a config with none is refused (not a guessed 2,048)."""
    from types import SimpleNamespace

    from outlierscope.models.loading import context_length, resolve_seq_len

    model = SimpleNamespace(config=SimpleNamespace(**{name: 448}))
    assert context_length(model) == 448
    with pytest.raises(OutlierscopeError, match="at most the model's context of 448"):
        resolve_seq_len(model, 449)
    with pytest.raises(OutlierscopeError, match="states no context length"):
        context_length(SimpleNamespace(config=SimpleNamespace(hidden_size=8)))


def test_whisper_style_context_is_read():
    """Whisper's decoder states its context as max_target_positions (448), not max_position_embeddings."""
    from transformers import WhisperConfig

    from outlierscope.models.loading import context_length

    class M:
        config = WhisperConfig(max_target_positions=448)

    assert context_length(M()) == 448


def test_evaluate_refuses_a_masked_lm():
    import transformers as tf

    from outlierscope import evaluate

    tok = load_model("pair-tiny:diff").tokenizer
    bert = tf.BertForMaskedLM(tf.BertConfig(vocab_size=6144, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                            intermediate_size=32)).eval()
    with pytest.raises(OutlierscopeError, match="BertForMaskedLM is not a causal language model"):
        evaluate(bert, tok, items=[], progress=False)
    decoder = tf.BertLMHeadModel(tf.BertConfig(vocab_size=6144, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                               intermediate_size=32, is_decoder=True)).eval()
    from outlierscope.models.loading import check_causal

    check_causal(decoder)  # a BERT used as a decoder is causal: accepted


def test_a_directory_that_is_not_a_model_does_not_hide_a_named_model(tmp_path, monkeypatch):
    """An output directory named like a preset or fetchable model (``sweep --out smollm2-135m/hellaswag`` makes
    ``smollm2-135m/`` before the model loads) is not taken for the model; a real model directory still wins."""
    from outlierscope.models import fetch as mf
    from outlierscope.models.loading import PRETRAINED_DIR, resolve_model

    monkeypatch.chdir(tmp_path)
    (tmp_path / "pair-tiny:diff" / "hellaswag").mkdir(parents=True)
    assert resolve_spec("pair-tiny:diff") == PRETRAINED_DIR / "pair-tiny" / "diff"
    name = next(iter(mf.FETCHABLE))
    (tmp_path / name / "cells").mkdir(parents=True)
    monkeypatch.setattr("outlierscope.models.resolve.is_fetched", lambda n: False)
    with pytest.raises(OutlierscopeError, match=f"model {name} is not fetched yet"):  # not: "has no config.json"
        resolve_spec(name)
    monkeypatch.setattr("outlierscope.models.resolve.is_fetched", lambda n: True)
    assert resolve_model(name).kind == "fetched"
    (tmp_path / "pair-tiny:diff" / "config.json").write_text("{}")  # now a model directory: it wins, as before
    assert resolve_model("pair-tiny:diff").kind == "directory"
    (tmp_path / "plain").mkdir()
    with pytest.raises(OutlierscopeError, match="has no config.json"):  # a path that names no model: as before
        resolve_spec("plain")


@pytest.mark.parametrize("content, msg", [(b"", "is empty: not a GGUF model file"),
                                          (b"hello, not a model\n", "does not start with GGUF's magic bytes")])
def test_a_file_named_gguf_that_is_not_one(tmp_path, content, msg, capsys):
    """An empty file or text named .gguf: one line naming the problem (it was the GGUF reader's traceback), from the
    library, the CLI and as a second model of a sweep (checked before any cell)."""
    from outlierscope.cli import main
    from outlierscope.models.loading import check_model

    f = tmp_path / "x.gguf"
    f.write_bytes(content)
    with pytest.raises(OutlierscopeError, match=msg):
        check_model(str(f))
    assert main(["sweep", "--model", "pair-tiny:diff", "--model", str(f), "--bits", "16", "--limit", "2", "--out",
                 str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err and not (tmp_path / "o").exists()


def test_auto_map_with_a_known_model_type_and_a_missing_module(tmp_path):
    """auto_map to code that is not there: without trust_remote_code transformers' own class runs, with a warning
    that the shipped code does not; with it, the missing file is named (it said 'unsupported architecture')."""
    import json
    import shutil

    from outlierscope.models.loading import PRETRAINED_DIR, check_model

    d = tmp_path / "m"
    shutil.copytree(PRETRAINED_DIR / "pair-tiny" / "transformer", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="which is not run: transformers' own llama is used"):
        check_model(str(d))
    with pytest.raises(OutlierscopeError, match="auto_map names configuration_x.py, modeling_x.py, which are not in"):
        check_model(str(d), trust_remote_code=True)
    cfg["model_type"] = "notamodel"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(OutlierscopeError, match="needs the Python code shipped with the model"):
        check_model(str(d))


@pytest.mark.parametrize("broken", ["missing", "mismatch", "tokenizer"])
def test_a_broken_second_model_is_named_before_the_first_ones_cells(model_dir, tmp_path, broken, monkeypatch, capsys):
    """A missing tensor, a shape mismatch or a tokenizer past the vocab, found from the file headers and the
    tokenizer by check_model (no weights read), so a sweep's second model fails before the first one's cells."""
    import shutil

    from outlierscope.cli import main
    from outlierscope.models.loading import check_model

    if broken == "missing":
        d = _copy_with(model_dir, tmp_path, lambda w: w.pop("model.layers.0.mlp.up_proj.weight"))
        msg = "lack 1 tensor(s) the model needs (model.layers.0.mlp.up_proj.weight)"
    elif broken == "mismatch":
        d = _copy_with(model_dir, tmp_path, lambda w: w.__setitem__("model.norm.weight", w["model.norm.weight"][:3].clone()))
        msg = "tensor model.norm.weight has shape (3,) in the checkpoint but the config expects ("
    else:
        from transformers import AutoTokenizer

        d = tmp_path / "big-tok"
        shutil.copytree(model_dir, d)
        tok = AutoTokenizer.from_pretrained(model_dir)
        tok.add_tokens([f"<extra{i}>" for i in range(600)])
        tok.save_pretrained(d)
        msg = "but the model's embedding has 512 rows"
    with pytest.raises(OutlierscopeError) as e:
        check_model(str(d))
    assert msg in str(e.value)
    import outlierscope.eval.evaluate as ev

    def no_cell(*a, **k):
        raise AssertionError("a cell ran before the second model was checked")

    monkeypatch.setattr(ev, "evaluate", no_cell)
    assert main(["sweep", "--model", str(model_dir), "--model", str(d), "--bits", "16", "--limit", "2", "--out",
                 str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err
