"""Objects stored as tensors and plain containers: rebuilt with their sharing, only from the classes allowed; a file
that holds anything else (a pickle that would run code) is refused where outlierscope reads one back."""

import io
import pickle
from pathlib import Path

import pytest
import torch

from outlierscope.state import from_plain, to_plain


class Leaf:
    def __init__(self, t):
        self.t, self.tags = t, frozenset({3, 1})


class Tree:
    def __init__(self):
        self.a = Leaf(torch.arange(4))
        self.by_name = {"a": self.a, "b": Leaf(torch.ones(2, dtype=torch.float64))}
        self.pair, self.rows = (1, "x"), [0.5, None, True]


def _through_torch(data):
    buf = io.BytesIO()
    torch.save(data, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # plain containers load without any allowed class


def test_round_trip_keeps_values_types_and_sharing():
    tree = Tree()
    back = from_plain(_through_torch(to_plain(tree, (Tree, Leaf))), (Tree, Leaf))
    assert type(back) is Tree and type(back.a) is Leaf
    assert back.by_name["a"] is back.a and back.by_name["b"] is not back.a  # one object stays one object
    assert torch.equal(back.a.t, torch.arange(4)) and back.by_name["b"].t.dtype == torch.float64
    assert back.a.tags == frozenset({1, 3}) and back.pair == (1, "x") and back.rows == [0.5, None, True]


def test_unknown_classes_are_refused_both_ways():
    with pytest.raises(TypeError, match="cannot store a Leaf"):
        to_plain(Tree(), (Tree,))
    data = to_plain(Tree(), (Tree, Leaf))
    with pytest.raises(ValueError, match="stored object of class 'Leaf'"):
        from_plain(data, (Tree,))


class _RunsCode:
    """Unpickled, this touches a file: what a planted pickle in a colleague's run directory could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _plant(path: Path, marker: Path, **fields) -> None:
    """Replace the checked file ``path`` with one whose payload (digest valid) pickles :class:`_RunsCode`."""
    from outlierscope.io import write_checked

    buf = io.BytesIO()
    torch.save({**fields, "stats": {"x": _RunsCode(marker)}}, buf)
    write_checked(path, buf.getvalue())


def test_planted_pickle_is_live(tmp_path):
    """The payload the refusal tests plant does run code when unpickled: the tests below could fail."""
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(_RunsCode(marker), buf)
    buf.seek(0)
    torch.load(buf, weights_only=False)
    assert marker.exists()


def test_profile_merge_refuses_a_planted_pickle(tmp_path, tiny_corpus):
    from outlierscope.cli import main

    out, marker = tmp_path / "p", tmp_path / "ran"
    args = ["profile", "--model", "pair-tiny:transformer", "--text", str(tiny_corpus / "val.jsonl"), "--tokens", "300",
            "--out", str(out)]
    for i in range(2):
        assert main([*args, "--shard", f"{i}/2"]) == 0
    part = out / "profile.shard-1-of-2.pt"
    _plant(part, marker, settings={}, facts={})
    with pytest.raises(Exception) as e:
        from outlierscope.runs.profile import merge_profile

        merge_profile([out])
    assert not marker.exists()
    assert "holds Python objects other than tensors and plain containers" in str(e.value)
    assert str(part) in str(e.value) and "\n" not in str(e.value)
    assert not (out / "profile.json").exists()


def test_shard_file_holds_plain_state_that_merges(tmp_path, tiny_corpus):
    """Two shards stored as plain state merge into the tables of one process."""
    from outlierscope.cli import main

    args = ["profile", "--model", "pair-tiny:diff", "--text", str(tiny_corpus / "val.jsonl"), "--tokens", "300"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    for i in range(2):
        assert main([*args, "--out", str(tmp_path / "two"), "--shard", f"{i}/2"]) == 0
    raw = (tmp_path / "two" / "profile.shard-0-of-2.pt").read_bytes()
    payload = raw.partition(b"\n")[2]
    torch.load(io.BytesIO(payload), weights_only=True)  # no class outside torch's allowlist
    assert main(["merge", str(tmp_path / "two")]) == 0
    for f in sorted((tmp_path / "one").glob("*.csv")):
        assert (tmp_path / "two" / f.name).read_bytes() == f.read_bytes(), f.name


def test_training_resume_refuses_a_planted_pickle(tmp_path, tiny_corpus):
    """A resume state whose role file (its digest and the checkpoint's seal made to match) pickles code."""
    from outlierscope.errors import OutlierscopeError
    from outlierscope.io import file_digests, read_record, write_record
    from outlierscope.train.loop import TrainArgs, train

    out, marker = tmp_path / "run", tmp_path / "ran"
    args = dict(preset="pair-test", corpus=(str(tiny_corpus / "train.jsonl"),), tokens=2048, out=str(out),
                eval_every=8, val_tokens=0, threads=1)
    train(TrainArgs(**args, stop_at_step=2))
    state = out / "state"
    with open(state / "diff.pt", "wb") as f:
        pickle.dump({"model": _RunsCode(marker)}, f)
    meta = read_record(state / "meta.json", sealed_only=True)
    write_record(state / "meta.json", {**meta, "files": file_digests(state, meta["files"])})
    with pytest.raises(OutlierscopeError, match="holds Python objects other than tensors") as e:
        train(TrainArgs(**args, resume=True))
    assert not marker.exists() and "\n" not in str(e.value)


def test_profile_merge_refuses_a_renamed_shard_file(tmp_path, tiny_corpus):
    """Shard 0's file under shard 1's name (its data would count twice): a one-line error naming the file."""
    from outlierscope.cli import main
    from outlierscope.errors import OutlierscopeError
    from outlierscope.runs.profile import merge_profile

    out = tmp_path / "p"
    for i in range(2):
        assert main(["profile", "--model", "pair-tiny:transformer", "--text", str(tiny_corpus / "val.jsonl"),
                     "--tokens", "300", "--out", str(out), "--shard", f"{i}/2"]) == 0
    part = out / "profile.shard-1-of-2.pt"
    part.write_bytes((out / "profile.shard-0-of-2.pt").read_bytes())
    with pytest.raises(OutlierscopeError, match="holds shard 0/2 of a profile, not 1/2") as e:
        merge_profile([out])
    assert str(part) in str(e.value) and not (out / "profile.json").exists()
