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
