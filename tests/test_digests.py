"""Nothing read back unchecked (#63): every file outlierscope writes and later reads (run records, sweep and perplexity
cells, shard parts, GPTQ/AWQ calibration caches, training checkpoints) carries a digest of its content, checked on
read. A damaged cache or cell is computed again with one line saying so; a damaged file a command was given is a
one-line error naming it.

The expected digests are computed here with hashlib over the bytes and canonical JSON, not by the code under test."""

import hashlib
import json

import pandas as pd
import pytest

from outlierscope.cli import main
from outlierscope.errors import OutlierscopeError
from outlierscope.io import (
    FRAME,
    SEAL,
    Damaged,
    read_checked,
    read_record,
    write_checked,
    write_record,
)

WORDS = [f"Passage {i}: " + " ".join(f"the {w} went to the {w}s" for w in ("cat", "dog", "fox")[: 1 + i % 3]) * (3 + i)
         for i in range(24)]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "passages.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in WORDS))
    return path


def _damage(path, how: str) -> None:
    data = path.read_bytes()
    if how == "flip":  # one bit in the middle of the file
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1:])
    elif how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(b"")


def test_a_record_is_sealed_with_the_sha256_of_its_canonical_json(tmp_path):
    body = {"settings": {"bits": [16, 4], "model": "m"}, "seconds": 1.5, "name": "é"}
    write_record(tmp_path / "r.json", body)
    raw = json.loads((tmp_path / "r.json").read_text())
    want = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert raw[SEAL] == want and list(raw)[-1] == SEAL
    assert read_record(tmp_path / "r.json", ("settings",)) == body  # the seal is not part of what is read
    raw["seconds"] = 1.6  # a value changed by hand or by a flipped bit that still parses
    (tmp_path / "r.json").write_text(json.dumps(raw))
    with pytest.raises(Damaged, match=r"r\.json: its content does not match its record_sha256"):
        read_record(tmp_path / "r.json")
    (tmp_path / "old.json").write_text(json.dumps(body))  # written before seals: read as it is, unless required
    assert read_record(tmp_path / "old.json") == body
    with pytest.raises(Damaged, match="no record_sha256"):
        read_record(tmp_path / "old.json", sealed_only=True)


@pytest.mark.parametrize("how", ["flip", "truncate", "empty"])
def test_a_checked_file_holds_its_payloads_sha256_and_refuses_damage(tmp_path, how):
    payload = bytes(range(256)) * 40
    write_checked(tmp_path / "f.bin", payload)
    data = (tmp_path / "f.bin").read_bytes()
    assert data == FRAME + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    assert read_checked(tmp_path / "f.bin") == payload
    _damage(tmp_path / "f.bin", how)
    with pytest.raises(Damaged, match=r"f\.bin: "):
        read_checked(tmp_path / "f.bin")


def _ppl(out, text, *extra):
    return main(["perplexity", "--model", "pair-tiny:diff", "--text", str(text), "--bits", "16", "4", "--quant",
                 "kivi-2bit", "--protocol", "gptq", "--length", "64", "--batch-size", "3", "--out", str(out), *extra])


def test_perplexity_cells_damaged_or_swapped_are_computed_again(tmp_path, text, capsys):
    """A flipped, cut or emptied cell, and two cells' .npz swapped, are each computed again with a line saying so;
    the table equals the first run's. compare-perplexity given a swapped cell names it."""
    out = tmp_path / "p"
    assert _ppl(out, text) == 0
    first = (out / "perplexity.csv").read_bytes()
    table = pd.read_csv(out / "perplexity.csv")
    a, b, c = (out / "cells" / f"{cid}.npz" for cid in table["cell"])
    _damage(a, "flip")
    _damage(b, "truncate")
    capsys.readouterr()
    assert _ppl(out, text) == 0
    said = capsys.readouterr().out
    assert said.count("is damaged") == 2 and "1 cells done earlier, 2 to compute" in said
    assert (out / "perplexity.csv").read_bytes() == first
    b_bytes, c_bytes = b.read_bytes(), c.read_bytes()  # swap two cells' values: each file intact, in the wrong place
    b.write_bytes(c_bytes)
    c.write_bytes(b_bytes)
    assert main(["compare-perplexity", str(out), str(out), "--out", str(tmp_path / "cmp")]) == 2
    assert f"{b.name}: its content does not match" in capsys.readouterr().err
    assert _ppl(out, text) == 0
    assert "1 cells done earlier, 2 to compute" in capsys.readouterr().out
    assert (out / "perplexity.csv").read_bytes() == first


def test_a_damaged_part_is_computed_again_and_merge_refuses_one(tmp_path, text, capsys):
    """A shard's part flipped in its own directory is computed again by the rerun (the assembled table equals one
    process's); `merge` of a shard holding a truncated part is a one-line error naming it, nothing copied."""
    assert _ppl(tmp_path / "one", text) == 0
    whole = (tmp_path / "one" / "perplexity.csv").read_bytes()
    split = tmp_path / "split"
    assert _ppl(split, text, "--shard", "0/2") == 0
    part = sorted((split / "cells").glob("*.part-*"))[0]
    _damage(part, "flip")
    capsys.readouterr()
    assert _ppl(split, text, "--shard", "0/2") == 0
    assert f"{part}: its content does not match its digest" in capsys.readouterr().out
    assert _ppl(tmp_path / "s1", text, "--shard", "1/2") == 0
    _damage(sorted((tmp_path / "s1" / "cells").glob("*.part-*"))[0], "truncate")
    assert main(["merge", str(split), str(tmp_path / "s1"), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "its content does not match its digest" in err and "rerun that shard" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "m").exists()
    assert _ppl(split, text, "--shard", "1/2") == 0  # the shard's parts beside the first's: assembled
    assert (split / "perplexity.csv").read_bytes() == whole


@pytest.mark.parametrize("how", ["flip", "truncate", "empty"])
def test_sweep_cells_damaged_are_computed_again(tmp_path, tiny_pair, hs_jsonl, capsys, how):
    """A sweep cell's per-item table flipped, cut or emptied is computed again with one line; sweep.csv equals the
    first run's. A cell json changed by hand is damaged too."""
    argv = ["sweep", "--model", str(tiny_pair["diff"]), "--data", str(hs_jsonl), "--bits", "16", "4", "--limit", "6",
            "--batch-size", "4", "--out", str(tmp_path / "s")]
    assert main(argv) == 0
    first = (tmp_path / "s" / "sweep.csv").read_bytes()
    items = sorted((tmp_path / "s" / "cells").glob("*_b4_*.csv"))[0]
    _damage(items, how)
    capsys.readouterr()
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert said.count("is damaged") == 1 and items.name in said
    assert (tmp_path / "s" / "sweep.csv").read_bytes() == first
    meta = items.with_suffix(".json")
    rec = json.loads(meta.read_text())
    rec["metrics"]["acc"] = 100.0
    meta.write_text(json.dumps(rec))
    assert main(argv) == 0 and "is damaged" in capsys.readouterr().out
    assert (tmp_path / "s" / "sweep.csv").read_bytes() == first


def test_a_damaged_gptq_cache_is_calibrated_again(tmp_path):
    """GPTQ's per-layer cache with one flipped byte is not used: a warning, the layers calibrated again, and the
    rounded weights equal a calibration without any cache."""
    import warnings

    import torch

    from outlierscope.models.loading import load_model
    from outlierscope.quant.linears.sites import linear_sites
    from outlierscope.quant.specs.spec import QuantSpec
    from outlierscope.quant.weights.gptq_model import calibration_sequences, gptq_model

    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"the {w} sat on the mat and looked at the {w}" for w in ("cat", "dog", "owl") * 40))
    spec = QuantSpec.parse(f"w=int4/per_group:32; gptq:samples=3,seqlen=48; calib:{calib}")
    lm = load_model("pair-tiny:transformer")
    seqs = calibration_sequences(lm.tokenizer, str(calib), spec.gptq, None)
    sites = linear_sites(lm.model, spec)
    plain = gptq_model(lm.model, seqs, spec, sites, progress=False)
    cache = tmp_path / "cal"
    gptq_model(lm.model, seqs, spec, sites, progress=False, checkpoint_dir=cache)
    (f,) = cache.glob("gptq-*.pt")
    _damage(f, "flip")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = gptq_model(lm.model, seqs, spec, sites, progress=False, checkpoint_dir=cache)
    assert any("does not match its digest" in str(w.message) and "calibrating those layers again" in str(w.message)
               for w in seen)
    for name, r in plain.items():
        assert torch.equal(r.weight(torch.float32), again[name].weight(torch.float32))
    read_checked(f)  # rewritten whole


def test_a_damaged_profile_shard_is_a_one_line_error_at_merge(tmp_path, capsys):
    base = ["profile", "--model", "pair-tiny:diff", "--tokens", "256", "--seq-len", "64"]
    for i in (0, 1):
        assert main([*base, "--shard", f"{i}/2", "--out", str(tmp_path / f"s{i}")]) == 0
    (part,) = (tmp_path / "s1").glob("profile.shard-*.pt")
    _damage(part, "truncate")
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert part.name in err and "run that shard again" in err and len(err.strip().splitlines()) == 1


def test_a_changed_training_checkpoint_is_refused_on_resume(tmp_path):
    import torch

    from outlierscope.train.checkpoint import load_state, save_state

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_state(tmp_path, {"m": model}, {"m": opt}, {"m": sched}, 3, 1.0, {"m": "x"})
    assert load_state(tmp_path, {"m": model}, {"m": opt}, {"m": sched}, {})[0] == 3
    _damage(tmp_path / "state" / "m.pt", "flip")
    with pytest.raises(OutlierscopeError, match=r"m\.pt: its content does not match"):
        load_state(tmp_path, {"m": model}, {"m": opt}, {"m": sched}, {})

