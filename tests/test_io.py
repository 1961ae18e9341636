"""outlierscope.io: what a record says of the checkout that made it."""

import subprocess
from types import SimpleNamespace


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
