"""A model inspected once (#65): inspect_model's record holds what the directory says (checked here against the files
read by the test), and a run reads config.json, transformers' config and the tokenizer once each, handing the record
to the checks, the windows, the loader and the records."""

import hashlib
import json
import pathlib

import pytest
import transformers

from outlierscope.errors import ParamError
from outlierscope.models.loading import PRETRAINED_DIR, inspect_model, load_model

SPEC = "pair-tiny:diff"


def test_record_holds_what_the_directory_says():
    path = PRETRAINED_DIR / "pair-tiny" / "diff"
    rec = inspect_model(SPEC)
    assert rec.path == path and rec.spec == SPEC and rec.source.kind == "preset"
    assert rec.config_json == json.loads((path / "config.json").read_text())
    assert rec.layers == rec.config_json["num_hidden_layers"] and rec.quantization is None and not rec.packed
    files = sorted(path.glob("*.safetensors"))
    digest = hashlib.sha256()
    for f in files:  # sha256 over the files' bytes in name order
        digest.update(f.read_bytes())
    assert rec.weights_sha256 == digest.hexdigest()
    tok = hashlib.sha256()
    names = [n for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json") if (path / n).is_file()]
    for n in names:
        tok.update(n.encode() + b"\0" + (path / n).read_bytes())
    assert rec.tokenizer_files["files_sha256"] == tok.hexdigest() and rec.tokenizer_files["files"][:len(names)] == names
    assert rec.tokenizer_files["tokens"] == len(rec.tokenizer)
    from safetensors import safe_open

    with safe_open(str(files[0]), "pt") as st:
        assert rec.shapes == {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}


class Reads:
    """Counts what a run reads of a model: config.json's text, transformers' config and tokenizer loads."""

    def __init__(self, monkeypatch):
        self.config_json = self.config = self.tokenizer = 0
        read_text, config, tokenizer = pathlib.Path.read_text, transformers.AutoConfig.from_pretrained, \
            transformers.AutoTokenizer.from_pretrained

        def text(p, *a, **k):
            self.config_json += p.name == "config.json"
            return read_text(p, *a, **k)

        def cfg(*a, **k):
            self.config += 1
            return config(*a, **k)

        def tok(*a, **k):
            self.tokenizer += 1
            return tokenizer(*a, **k)

        monkeypatch.setattr(pathlib.Path, "read_text", text)
        monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", cfg)
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tok)

    def once(self):
        return (self.config_json, self.config, self.tokenizer) == (1, 1, 1)


def test_load_model_reads_the_model_once(monkeypatch):
    reads = Reads(monkeypatch)
    lm = load_model(SPEC)
    assert reads.once(), vars(reads)
    assert lm.record is not None and lm.tokenizer is lm.record.tokenizer
    assert lm.weights_sha256() == lm.record.weights_sha256


def test_a_given_record_is_not_read_again(monkeypatch):
    rec = inspect_model(SPEC)
    reads = Reads(monkeypatch)
    lm = load_model(SPEC, record=rec)
    assert (reads.config_json, reads.config, reads.tokenizer) == (0, 0, 0)
    assert lm.tokenizer is rec.tokenizer and rec.config._attn_implementation != "bogus"  # the record's config unchanged
    with pytest.raises(ParamError, match="record must be the record of pair-tiny:transformer"):
        load_model("pair-tiny:transformer", record=rec)


def test_perplexity_run_reads_the_model_once(tmp_path, monkeypatch):
    from outlierscope.runs.perplexity import PerplexitySettings, perplexity

    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"the fox {i} ran to the den" for i in range(60)))
    reads = Reads(monkeypatch)
    perplexity(PerplexitySettings(model=SPEC, text=str(text), bits=(16,), quant=("w=int4/per_group:32",), length=64,
                                  protocol="gptq", noise="float64"), tmp_path / "p", log=lambda *a: None)
    assert reads.once(), vars(reads)  # the noise reference (float64) loads the weights again, not the config


def test_sensitivity_on_text_reads_the_model_once(tmp_path, monkeypatch):
    from outlierscope.runs.sensitivity import SensitivitySettings, sensitivity

    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"the fox {i} ran to the den" for i in range(60)))
    reads = Reads(monkeypatch)
    sensitivity(SensitivitySettings(model=SPEC, quant="k=int4/per_token", metric="kld", text=str(text), length=64,
                                    all_but=False, kinds=False, attn_error=False,
                                    profile_tokens=256), tmp_path / "s", progress=False, log=lambda *a: None)
    assert reads.once(), vars(reads)


def test_sweep_with_text_reads_each_model_once(hs_jsonl, tmp_path, monkeypatch):
    """A sweep's checks, its item cells and its text cells (--kld-text: a perplexity run per model) share one record."""
    from outlierscope.runs.sweep import SweepSettings, sweep

    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"the fox {i} ran to the den" for i in range(60)))
    reads = Reads(monkeypatch)
    sweep(SweepSettings(models=(SPEC,), data=str(hs_jsonl), limit=3, bits=(16,), quant=("k=int4/per_token",),
                        kld_text=str(text), kld_length=48, kld_max_windows=5), tmp_path / "s", progress=False,
          log=lambda *a: None)
    assert reads.once(), vars(reads)
