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
    assert len(lm.weights_sha256()) == 64
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
        ("gpt2", "neither a directory nor a preset role"),
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
