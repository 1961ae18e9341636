import json

import pytest

from outlierscope.cli import main
from outlierscope.errors import OutlierscopeError
from outlierscope.train.corpus import iter_documents
from outlierscope.train.loop import TrainArgs, train


def _args(cdir, out, **kw):
    base = dict(preset="pair-test", corpus=(str(cdir / "train.jsonl"),), val_corpus=(str(cdir / "val.jsonl"),),
                tokens=2048, out=str(out), eval_every=8, val_tokens=1024, threads=1)
    base.update(kw)
    return TrainArgs(**base)


@pytest.fixture(scope="module")
def full_run(tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "full"
    res = train(_args(tiny_corpus, out))
    return out, res


def test_end_to_end(full_run):
    out, res = full_run
    assert res["step"] == res["steps"] == 16 and res["reason"] == "finished"
    for role in ("transformer", "diff"):
        assert (out / role / "model.safetensors").exists() and (out / role / "tokenizer.json").exists()
        card = (out / role / "README.md").read_text()
        assert "status | finished" in card and "reached the lower validation loss" in card
    log = (out / "train_log.csv").read_text().splitlines()
    assert log[0] == "role,step,tokens,loss,lr,tokens_per_s,wall_s,val_loss"
    assert sum(1 for line in log if line.startswith("diff,") and not line.endswith(",")) >= 2  # val losses logged
    run = json.loads((out / "run.json").read_text())
    assert run["train_pool_tokens"] == 16 * 4 * 33  # exactly one epoch of packed sequences
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "diff")
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0


def test_resume_is_bit_exact(full_run, tiny_corpus, tmp_path):
    full, _ = full_run
    out = tmp_path / "split"
    first = train(_args(tiny_corpus, out, stop_at_step=7))
    assert first["step"] == 7 and "IN PROGRESS" in (out / "diff" / "README.md").read_text()
    second = train(_args(tiny_corpus, out, resume=True))
    assert second["step"] == 16
    for role in ("transformer", "diff"):
        assert (out / role / "model.safetensors").read_bytes() == (full / role / "model.safetensors").read_bytes()


def test_same_data_both_models_differ_only_in_attention(full_run):
    from safetensors.torch import load_file

    out, _ = full_run
    t = load_file(out / "transformer" / "model.safetensors")
    d = load_file(out / "diff" / "model.safetensors")
    assert set(d) - set(t) and all("lambda" in k for k in set(d) - set(t)) and set(t) <= set(d)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(tokens=10), "--tokens must be at least one batch"),
        (dict(corpus=("/nope.jsonl",)), "corpus file not found"),
        (dict(resume=True), "holds no training run"),
        (dict(preset="pair-tny"), "did you mean pair-tiny"),
    ],
)
def test_errors(tiny_corpus, tmp_path, kw, msg):
    out = tmp_path / "o"
    with pytest.raises((OutlierscopeError, ValueError), match=msg):
        train(_args(tiny_corpus, out, **kw))
    assert not out.exists()


def test_existing_out_needs_resume(tiny_corpus, tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "x").write_text("keep me")
    with pytest.raises(OutlierscopeError, match="not empty; pass --resume"):
        train(_args(tiny_corpus, tmp_path / "o"))
    assert (tmp_path / "o" / "x").read_text() == "keep me"


def test_bad_corpus_line_writes_nothing(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"title": "no text"}\n')
    out = tmp_path / "o"
    with pytest.raises(OutlierscopeError, match="line 2: expected an object with a string field 'text'"):
        train(TrainArgs(preset="pair-test", corpus=(str(tmp_path / "c.jsonl"),), tokens=2048, out=str(out)))
    assert not out.exists()


def test_empty_corpus(tmp_path):
    (tmp_path / "c.txt").write_text("")
    with pytest.raises(OutlierscopeError, match="is empty"):
        list(iter_documents([tmp_path / "c.txt"]))


@pytest.mark.parametrize("suffix", [".txt", ".jsonl.gz", ".jsonl.xz"])
def test_corpus_formats(tmp_path, suffix):
    import gzip
    import lzma

    if suffix == ".txt":
        (tmp_path / "a.txt").write_text("First doc line.\nsame doc.\n\nSecond doc.\n")
        assert list(iter_documents([tmp_path / "a.txt"])) == ["First doc line.\nsame doc.", "Second doc."]
        return
    opener = gzip.open if suffix.endswith("gz") else lzma.open
    with opener(tmp_path / f"a{suffix}", "wt") as f:
        f.write('{"text": "one"}\n\n{"text": "two"}\n')
    assert list(iter_documents([tmp_path / f"a{suffix}"])) == ["one", "two"]


def test_cli_error_exit(tiny_corpus, tmp_path, capsys):
    rc = main(["train", "--preset", "pair-test", "--corpus", str(tiny_corpus / "train.jsonl"), "--tokens", "5",
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--tokens must be at least one batch" in err
