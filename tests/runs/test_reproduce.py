"""reproduce: profile, sweep over several tasks, figures and report in one directory, with its settings and timings."""

import json

import pandas as pd
import pytest

from outlierscope.cli import main
from outlierscope.data.hellaswag import hellaswag_path
from outlierscope.data.tasks import get_task


def test_reproduce_with_tasks(tiny_pair, tmp_path, capsys):
    import matplotlib

    matplotlib.use("Agg")
    if not hellaswag_path().exists() or not get_task("copa").cached:
        pytest.skip("data not cached (make test fetches it)")
    out = tmp_path / "rep"
    assert main(["reproduce", "--model", str(tiny_pair["transformer"]), "--model", str(tiny_pair["diff"]), "--task", "copa",
                 "--task", "hellaswag", "--limit", "6", "--tokens", "1024", "--seq-len", "64", "--out", str(out)]) == 0
    rec = json.loads((out / "reproduce.json").read_text())
    assert rec["settings"]["tasks"] == ["copa", "hellaswag"] and rec["timings"]["total_s"] > 0
    sw = pd.read_csv(out / "sweep" / "sweep.csv")
    assert list(dict.fromkeys(sw["task"])) == ["copa", "hellaswag"] and sw["n_items"].eq(6).all()
    assert (out / "profile" / "table5.csv").exists()
    report = (out / "report.md").read_text()
    assert "COPA, HellaSwag (Figure 8)" in report and "Time per model and task" in report
    assert {"figure8_acc.png", "figure8_acc_norm.png", "table5_bars.png"} <= {p.name for p in (out / "figures").iterdir()}
    assert main(["reproduce", "--task", "copaa", "--out", str(tmp_path / "x")]) == 2
    assert "did you mean copa" in capsys.readouterr().err


def test_reproduce_check_runs_nothing(tmp_path, capsys):
    """--check (make reproduce's step before torchrun): the settings, models and tasks checked, nothing written; a bad
    model or task fails there with its one line."""
    if not hellaswag_path().exists():
        pytest.skip("data not cached (make test fetches it)")
    out = tmp_path / "rep"
    assert main(["reproduce", "--check", "--model", "pair-tiny:diff", "--limit", "6", "--tokens", "1024", "--seq-len", "64",
                 "--out", str(out)]) == 0
    assert "checked: pair-tiny:diff; hellaswag" in capsys.readouterr().out and not out.exists()
    assert main(["reproduce", "--check", "--model", "pair-tiny:dif", "--out", str(out)]) == 2
    assert "did you mean pair-tiny:diff" in capsys.readouterr().err and not out.exists()


def test_check_reads_the_text_the_sweep_will_read(tmp_path, capsys, monkeypatch):
    """--check reads --text as the sweep's cells will (a Latin-1 file: one line naming it, exit 2), before any profile;
    so does the run itself."""
    from outlierscope.runs import profile as prof

    text = tmp_path / "latin1.txt"
    text.write_bytes("Caf\xe9 au lait, cr\xe8me br\xfbl\xe9e.\n".encode("latin-1") * 200)
    out = tmp_path / "r"
    monkeypatch.setattr(prof, "profile", lambda *a, **k: pytest.fail("the profile ran before the text was read"))
    for extra in (["--check"], []):
        assert main(["reproduce", *extra, "--model", "pair-tiny:diff", "--limit", "6", "--tokens", "1024",
                     "--text", str(text), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(text) in err and "UTF-8" in err
    assert not out.exists()
