"""outlierscope.io: what a record says of the checkout that made it."""


import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from outlierscope.errors import OutlierscopeError

ROOT = Path(__file__).resolve().parent.parent


def test_the_commit_is_the_checkout_as_the_run_found_it(monkeypatch):
    """Read once per process: files the run writes into the checkout afterwards (docs/ records) do not turn its later
    records into '+changes'."""
    from outlierscope import io

    calls = []

    def fake_run(argv, **kw):
        calls.append(argv)
        if argv[1] == "rev-parse":
            return SimpleNamespace(returncode=0, stdout="abc123\n")
        dirty = sum(1 for a in calls if a[1] == "status") > 1  # the tree is clean at the first look only
        return SimpleNamespace(returncode=0, stdout=" M docs/x/sweep.json\n" if dirty else "")

    io.git_commit.cache_clear()
    monkeypatch.setattr(subprocess, "run", fake_run)
    try:
        assert io.git_commit() == "abc123"
        assert io.git_commit() == "abc123"  # the run's own output since then does not count
        io.git_commit.cache_clear()
        assert io.git_commit() == "abc123+changes"  # a new process would see the changed tree
    finally:
        io.git_commit.cache_clear()


def test_an_output_directory_reads_the_commit_before_its_block_writes(tmp_path, monkeypatch):
    """A record written inside ``output_dir`` after the block's first files (rank-agreement's csv, then its json) has
    the commit as the block found the checkout, not '+changes' for the files the block itself wrote there."""
    from outlierscope import io

    status = []

    def fake_run(argv, **kw):
        if argv[1] == "rev-parse":
            return SimpleNamespace(returncode=0, stdout="abc123\n")
        status.append(len(list(tmp_path.rglob("*.csv"))))  # what the checkout holds when git looks
        return SimpleNamespace(returncode=0, stdout=" M out/a.csv\n" if status[-1] else "")

    io.git_commit.cache_clear()
    monkeypatch.setattr(subprocess, "run", fake_run)
    try:
        with io.output_dir(tmp_path / "out") as out:
            (out / "a.csv").write_text("x\n")
            assert io.git_commit() == "abc123" and status == [0]
    finally:
        io.git_commit.cache_clear()


def test_results_under_docs_do_not_mark_a_checkout_changed(tmp_path):
    """A real git checkout: a changed record under docs/ (a study's own output) leaves it clean; a changed file of
    code, tracked or staged, marks it '+changes'; a new untracked file does not."""
    import shutil

    import pytest

    from outlierscope.io import tree_state

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "HOME": str(tmp_path), "PATH": __import__("os").environ["PATH"]}

    def git(*argv):
        return subprocess.run(["git", *argv], cwd=tmp_path, env=env, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "sweep.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "first")
    head = git("rev-parse", "HEAD").strip()
    assert tree_state(tmp_path) == head
    (tmp_path / "docs" / "sweep.json").write_text('{"cells": []}')
    (tmp_path / "new.py").write_text("")
    assert tree_state(tmp_path) == head == tree_state(tmp_path / "docs")  # from inside the checkout alike
    (tmp_path / "code.py").write_text("x = 2\n")
    assert tree_state(tmp_path) == head + "+changes" == tree_state(tmp_path / "docs")


def _legacy_cell(cells, name="m_b16_0123456789"):
    """A cell as outlierscope wrote it before seals: its per-item csv and a record without files or seal."""
    import json

    import pandas as pd

    cells.mkdir(parents=True)
    pd.DataFrame({"index": [0, 1], "label": [1, 0], "score0": [-1.5, -2.25], "score1": [-0.5, -3.0],
                  "tokens0": [3, 4], "tokens1": [2, 5], "pred": [1, 0], "pred_norm": [1, 0]}).to_csv(
        cells / f"{name}.csv", index=False)
    (cells / f"{name}.json").write_text(json.dumps({"settings": {"n_items": 2}, "metrics": {"acc": 1.0},
                                                     "seconds": 1.0, "cell": {"k": 1}}))
    return name


def _seal_records():
    import importlib.util

    spec = importlib.util.spec_from_file_location("seal_records", ROOT / "bench" / "seal_records.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_records_written_before_seals_are_sealed_and_then_checked(tmp_path, monkeypatch):
    """bench/seal_records.py: a legacy cell gets its csv's sha256 (computed here with hashlib) and a seal, a legacy run
    record its tables' digests and a seal, no value changed; afterwards a changed byte of the csv is found on read
    (before: read silently), a second run changes nothing, and a record that was complete already is not touched."""
    import hashlib
    import json

    from outlierscope.eval.evaluate import EvalResult
    from outlierscope.io import Damaged, write_record

    mod = _seal_records()
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    monkeypatch.setattr(mod, "TABLES_ONLY", {})
    monkeypatch.setattr("sys.argv", ["seal_records.py"])
    run = tmp_path / "docs" / "run"
    name = _legacy_cell(run / "cells")
    (run / "sweep.json").write_text(json.dumps({"settings": {"a": 1}}))
    (run / "sweep.csv").write_text("model,bits\nx,4\n")
    write_record(run / "compare.json", {"b": 2, "files": {}})
    before = (run / "compare.json").read_bytes()
    csv = run / "cells" / f"{name}.csv"
    good, flipped = csv.read_bytes(), csv.read_bytes().replace(b"-2.25", b"-2.26")
    csv.write_bytes(flipped)
    assert EvalResult.load(run / "cells", name).items["score0"][1] == -2.26  # unsealed: read as it is
    csv.write_bytes(good)
    assert mod.main() == 0
    rec = json.loads((run / "cells" / f"{name}.json").read_text())
    assert rec["files"] == {csv.name: hashlib.sha256(good).hexdigest()} and "record_sha256" in rec
    assert rec["settings"] == {"n_items": 2} and rec["cell"] == {"k": 1}
    sweep = json.loads((run / "sweep.json").read_text())
    assert sweep["settings"] == {"a": 1} and "record_sha256" in sweep
    assert sweep["files"] == {"sweep.csv": hashlib.sha256(b"model,bits\nx,4\n").hexdigest()}
    assert (run / "compare.json").read_bytes() == before
    assert mod.main() == 0 and [r for r in mod.records(tmp_path) if mod.sealed_form(r) is not None] == []
    assert EvalResult.load(run / "cells", name).extra["cell"] == {"k": 1}
    csv.write_bytes(flipped)
    with pytest.raises(Damaged, match="does not match the digest"):
        EvalResult.load(run / "cells", name)


def _canonical_sha256(obj) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_every_committed_record_is_sealed_and_verifies():
    """Every record under docs/, bench/results/ and references/results/ carries a seal that matches its content
    (recomputed here: sha256 of its canonical JSON), every file a record lists has that sha256, and every table
    committed under docs/ is listed by a record beside it or above it (a changed digit of any is found on read)."""
    import hashlib
    import json

    mod = _seal_records()
    listed, bad = set(), []
    for path in mod.records(ROOT):
        rec = json.loads(path.read_text())
        body = {k: v for k, v in rec.items() if k != "record_sha256"}
        if rec.get("record_sha256") != _canonical_sha256(body):
            bad.append(f"{path.relative_to(ROOT)}: seal")
        run = path.name in mod.RUN_TABLES or path.parent.name == "cells" or path.name == "tables.json"
        if run and not isinstance(rec.get("files"), dict):
            bad.append(f"{path.relative_to(ROOT)}: no files")
        for name, digest in (rec.get("files") or {}).items() if run else ():
            f = path.parent / name
            listed.add(f.resolve())
            if not f.is_file() or hashlib.sha256(f.read_bytes()).hexdigest() != digest:
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert len(list(mod.records(ROOT))) > 600 and not bad, (len(bad), bad[:5])
    tables = [p for p in (ROOT / "docs").rglob("*.csv") if p.resolve() not in listed]
    assert not tables, (len(tables), [str(p.relative_to(ROOT)) for p in tables[:5]])


def test_rank_agreement_on_a_missing_directory_says_so(tmp_path, capsys):
    from outlierscope.io import read_record

    with pytest.raises(OutlierscopeError, match="the directory does not exist") as e:
        read_record(tmp_path / "nowhere" / "sweep.json", what="sweep record")
    assert "permission" not in str(e.value)
