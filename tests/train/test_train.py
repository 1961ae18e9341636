import json
import re

import pytest

from outlierscope.cli import main
from outlierscope.data.corpus import iter_documents
from outlierscope.errors import OutlierscopeError
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
    assert log[0] == "role,step,tokens,loss,lr,tokens_per_s,wall_s,val_loss,data_sha256"
    assert sum(1 for line in log if line.startswith("diff,") and line.split(",")[7]) >= 2  # val losses logged
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
    a, b = ({(r["role"], r["step"]): r["data_sha256"] for r in _log_rows(d)} for d in (out, full))
    common = a.keys() & b.keys()
    assert ("diff", "16") in common and all(a[k] == b[k] for k in common)  # the resumed run was fed the same data


def _log_rows(out):
    import csv

    with open(out / "train_log.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_same_data_both_models_differ_only_in_attention(full_run):
    from safetensors.torch import load_file

    out, _ = full_run
    rows = _log_rows(out)
    by_step = {}
    for r in rows:
        by_step.setdefault(int(r["step"]), {})[r["role"]] = r["data_sha256"]
    assert len(by_step) >= 2 and all(len(v) == 2 for v in by_step.values())
    assert all(v["transformer"] == v["diff"] and len(v["diff"]) == 16 for v in by_step.values())  # identical inputs
    assert len({v["diff"] for v in by_step.values()}) == len(by_step)  # and the digest moves with the data
    t = load_file(out / "transformer" / "model.safetensors")
    d = load_file(out / "diff" / "model.safetensors")
    assert set(d) - set(t) and all("lambda" in k for k in set(d) - set(t)) and set(t) <= set(d)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(tokens=10), "tokens must be at least one batch"),
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
    with pytest.raises(OutlierscopeError, match="exists and is not empty; resume the run in it or choose a new output directory"):
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


def _same_windows(a, b):
    """Steps logged in both runs whose rows average the same steps (a row sums the losses since the last row)."""
    prev = lambda log, s: max((t for t in log if t < s), default=0)  # noqa: E731
    return {s for s in a.keys() & b.keys() if prev(a, s) == prev(b, s)}


def _log_losses(out, role):
    import csv

    with open(out / "train_log.csv", newline="") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f) if r["role"] == role}


@pytest.fixture(scope="module")
def bf16_run(tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "bf16"
    res = train(_args(tiny_corpus, out, precision="bf16"))
    return out, res


def test_bf16_autocast_same_data_close_losses(full_run, bf16_run):
    """The autocast path (what --device cuda runs) sees the same batches as fp32: its logged losses track fp32's."""
    (full, _), (out, res) = full_run, bf16_run
    assert res["step"] == 16
    assert json.loads((out / "run.json").read_text())["precision"] == "bf16"
    assert "bf16 autocast for the forward pass" in (out / "diff" / "README.md").read_text()
    for role in ("transformer", "diff"):
        fp32, bf16 = _log_losses(full, role), _log_losses(out, role)
        assert fp32.keys() == bf16.keys()
        for step in fp32:
            assert abs(fp32[step] - bf16[step]) < 0.05, (role, step, fp32[step], bf16[step])
    from safetensors.torch import load_file

    a, b = load_file(full / "diff" / "model.safetensors"), load_file(out / "diff" / "model.safetensors")
    assert all(b[k].dtype.is_floating_point and b[k].dtype == a[k].dtype for k in a)  # weights stay fp32
    assert any(not (a[k] == b[k]).all() for k in a)  # and bf16 really changed the arithmetic


def test_bf16_resume_is_bit_exact(bf16_run, tiny_corpus, tmp_path):
    full, _ = bf16_run
    out = tmp_path / "split"
    train(_args(tiny_corpus, out, precision="bf16", stop_at_step=5))
    with pytest.raises(OutlierscopeError, match="precision must be bf16, the precision .* was trained with, got 'fp32'"):
        train(_args(tiny_corpus, out, resume=True))
    train(_args(tiny_corpus, out, precision="bf16", resume=True))
    for role in ("transformer", "diff"):
        assert (out / role / "model.safetensors").read_bytes() == (full / role / "model.safetensors").read_bytes()


def test_bad_precision(tiny_corpus, tmp_path):
    with pytest.raises(OutlierscopeError, match="^precision must be one of auto, fp32, bf16, got 'fp8'$"):
        train(_args(tiny_corpus, tmp_path / "o", precision="fp8"))
    assert not (tmp_path / "o").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device (run bench/gpu_check.sh on one)")
def test_cuda_bf16_tracks_cpu(full_run, tiny_corpus, tmp_path):
    """--device cuda: bf16 autocast on the GPU, the same data order; losses track the CPU fp32 run, resume works."""
    full, _ = full_run
    out = tmp_path / "cuda"
    res = train(_args(tiny_corpus, out, device="cuda", stop_at_step=9))
    assert res["step"] == 9
    res = train(_args(tiny_corpus, out, device="cuda", resume=True))
    assert res["step"] == 16 and json.loads((out / "run.json").read_text())["precision"] == "bf16"
    card = (out / "diff" / "README.md").read_text()
    assert "status | finished" in card and "bf16 autocast" in card
    for role in ("transformer", "diff"):
        cpu, gpu = _log_losses(full, role), _log_losses(out, role)
        assert gpu.keys() == cpu.keys() | {9}  # the run stopped at step 9 logs that step too (seen on an H200)
        same = _same_windows(cpu, gpu)  # step 10's row averages steps 9-10 on the CPU, step 10 alone here
        assert 10 not in same and {8, 16} <= same
        for step in same:
            assert abs(cpu[step] - gpu[step]) < 0.05, (role, step, cpu[step], gpu[step])
    from outlierscope.models.loading import load_model

    lm = load_model(str(out / "diff"))  # the GPU-trained checkpoint loads and runs on the CPU
    assert lm.model.config.model_type == "diffllama"


@pytest.mark.parametrize("text,msg", [
    ("   \n\n\t\n", "holds no text, only blank lines"),
    ("two words", "add text, or choose a preset with a smaller batch"),
])
def test_useless_corpus_leaves_nothing(tmp_path, text, msg):
    (tmp_path / "c.txt").write_text(text)
    out = tmp_path / "o"
    args = TrainArgs(preset="pair-test", corpus=(str(tmp_path / "c.txt"),), tokens=2048, out=str(out))
    with pytest.raises(OutlierscopeError, match=re.escape(msg)):
        train(args)
    assert not out.exists()  # neither a rerun nor --resume is blocked
    with pytest.raises(OutlierscopeError, match="holds no training run"):
        train(TrainArgs(**{**args.__dict__, "resume": True}))
