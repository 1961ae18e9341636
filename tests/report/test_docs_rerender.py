"""The committed results under docs/ re-render byte-identical from their run files with today's code: every report.md
(from the run's tables and records), every sensitivity.md (from sensitivity.json/.csv and greedy.csv) and every
sweep.csv that has its cells (tabulated again from the per-item cells). A refactoring that changes an output fails here.

docs/reproduction is not re-rendered: it predates profile.json, so its report cannot be rebuilt from its files."""

import shutil
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
REPORTS = sorted(p.parent for p in DOCS.rglob("report.md") if p.parent.name != "reproduction")
SENSITIVITY = sorted(p.parent for p in DOCS.rglob("sensitivity.json"))
SWEEPS = sorted(p.parent for p in DOCS.rglob("sweep.json") if (p.parent / "cells").is_dir())


def _id(p):
    return str(p.relative_to(DOCS))


@pytest.mark.parametrize("run_dir", REPORTS, ids=_id)
def test_report_rerenders(run_dir, tmp_path):
    """report.md byte-identical, and no figure with text cut off at its edge (a ClippedTextWarning is an error)."""
    import warnings

    import matplotlib

    from outlierscope.report.markdown import ClippedTextWarning, write_report

    matplotlib.use("Agg")
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("report.md", "figures"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ClippedTextWarning)
        assert write_report(copy).read_bytes() == (run_dir / "report.md").read_bytes()


@pytest.mark.parametrize("run_dir", SENSITIVITY, ids=_id)
def test_sensitivity_markdown_rerenders(run_dir):
    from outlierscope.report.sensitivity import load_kinds, load_sensitivity, sensitivity_markdown

    text = sensitivity_markdown(*load_sensitivity(run_dir), load_kinds(run_dir))  # kinds: a linear scheme's
    assert text == (run_dir / "sensitivity.md").read_text()


@pytest.mark.parametrize("run_dir", SWEEPS, ids=_id)
def test_sweep_table_from_its_cells(run_dir, tmp_path):
    from outlierscope.runs.sweep import tabulate_sweep

    tabulate_sweep(run_dir, tmp_path / "again")
    assert (tmp_path / "again" / "sweep.csv").read_bytes() == (run_dir / "sweep.csv").read_bytes()


def test_every_kind_is_covered():
    assert len(REPORTS) >= 3 and len(SENSITIVITY) >= 4 and len(SWEEPS) >= 5


@pytest.mark.parametrize("table", ["sensitivity.csv", "greedy.csv"])
def test_a_changed_digit_of_a_sensitivity_table_is_refused(tmp_path, table):
    """load_sensitivity checks each table against its record's digest: one changed digit is a one-line error."""
    from outlierscope.errors import OutlierscopeError
    from outlierscope.report.sensitivity import load_sensitivity

    copy = tmp_path / "run"
    shutil.copytree(SENSITIVITY[0], copy)
    text = (copy / table).read_text()
    at = text.index(".", text.index("\n")) + 1  # the first digit after a decimal point in the data rows
    (copy / table).write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:])
    with pytest.raises(OutlierscopeError, match="does not match the digest its record holds") as e:
        load_sensitivity(copy)
    assert str(copy / table) in str(e.value) and "\n" not in str(e.value)


def test_a_changed_digit_of_a_perplexity_table_is_refused(tmp_path):
    """compare-perplexity reads each run's perplexity.csv against its record's digest."""
    from outlierscope.errors import OutlierscopeError
    from outlierscope.runs.perplexity_compare import compare_perplexity

    runs = {}
    for role in ("transformer", "diff"):
        runs[role] = tmp_path / role
        shutil.copytree(DOCS / "perplexity" / "pair" / role, runs[role])
    csv = runs["diff"] / "perplexity.csv"
    text = csv.read_text()
    at = text.index(".", text.index("\n")) + 1
    csv.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:])
    with pytest.raises(OutlierscopeError, match="does not match the digest its record holds") as e:
        compare_perplexity(runs["transformer"], runs["diff"], tmp_path / "ab")
    assert str(csv) in str(e.value) and not (tmp_path / "ab").exists()
