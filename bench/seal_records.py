"""Seal the committed records that lack a seal or their tables' digests, changing no value in them.

Every JSON record under docs/, bench/results/ and references/results/ gets ``record_sha256`` (outlierscope.io); a run
record without ``files`` first gets the sha256 of the tables beside it that its kind of run writes (what the run's
writer lists today). A directory of tables without any record (docs/reproduction, written before run records) gets
``tables.json``: the digests of its tables and report as committed. What a seal vouches for is the content as it
stands: read back later, a changed byte is found. Sealed records with ``files`` are left alone; prints what changed.

    python bench/seal_records.py [--check]    # --check: change nothing, exit 1 if anything would be sealed
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from outlierscope.io import SEAL, file_digests, write_record  # noqa: E402

FOLDERS = ("docs", "bench/results", "references/results")
# a run record's file name -> the files beside it that its run writes (glob patterns)
RUN_TABLES = {
    "profile.json": ("*.csv", "table5.md", "act_scales*.pt"),
    "sweep.json": ("sweep.csv", "attn_error.csv", "linear_error.csv", "gold_ll.csv", "text.csv"),
    "sensitivity.json": ("sensitivity.csv", "kinds.csv", "greedy.csv", "sensitivity.md", "attn_error.csv"),
    "perplexity.json": ("perplexity.csv", "perplexity.md"),
    "compare.json": ("compare.csv", "compare.md"),
    "rank_agreement.json": ("rank_agreement.csv", "rank_agreement.md"),
    "export.json": ("recipe.yaml", "quantization_config.json"),
    "reproduce.json": ("report.md", "profile/profile.json", "sweep/sweep.json"),
}
TABLES_ONLY = {"docs/reproduction": ("*.csv", "table5.md", "report.md")}  # no record of their run
ARTIFACTS = ("quantization_config.json",)  # files for other tools (a checkpoint's config), vouched for by a record


def records(root: Path) -> list[Path]:
    """Every JSON record under :data:`FOLDERS` (cells included; artifacts for other tools not)."""
    return sorted(p for folder in FOLDERS for p in (root / folder).rglob("*.json") if p.name not in ARTIFACTS)


def tables_of(path: Path) -> list[str]:
    """The names of the files beside a run record that its kind of run writes (those present)."""
    names = {str(p.relative_to(path.parent)) for pattern in RUN_TABLES[path.name] for p in path.parent.glob(pattern)}
    return sorted(names)


def sealed_form(path: Path) -> dict | None:
    """The record ``path`` sealed (with its tables' digests where it is a run record without them), or None when
    it is sealed and complete already."""
    obj = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(obj, dict):
        raise SystemExit(f"{path}: a JSON {type(obj).__name__}, not a record")
    cell = path.parent.name == "cells"
    run = path.name in RUN_TABLES and not cell
    if SEAL in obj and (not (run or cell) or "files" in obj):
        return None
    body = {k: v for k, v in obj.items() if k != SEAL}
    if "files" not in body and (run or cell):
        body["files"] = file_digests(path.parent, tables_of(path) if run else cell_tables(path))
    return body


def cell_tables(path: Path) -> list[str]:
    """A cell's per-item table and side tables (``{name}.csv``, ``{name}.*.csv``), or its values (``{name}.npz``)."""
    own = [p.name for p in (path.with_suffix(".csv"), path.with_suffix(".npz")) if p.exists()]
    return own + sorted(p.name for p in path.parent.glob(f"{path.stem}.*.csv"))


def unchanged(before: dict, after: dict) -> bool:
    """Whether ``after`` holds every value of ``before`` as it was (only ``files`` and the seal added)."""
    kept = {k: v for k, v in after.items() if k != SEAL and (k != "files" or "files" in before)}
    return kept == {k: v for k, v in before.items() if k != SEAL}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a record would be sealed")
    a = ap.parse_args()
    todo = []
    for path in records(ROOT):
        body = sealed_form(path)
        if body is not None:
            todo.append((path, body))
    for folder, patterns in TABLES_ONLY.items():
        d = ROOT / folder
        if not (d / "tables.json").exists():
            names = sorted(str(p.relative_to(d)) for pattern in patterns for p in d.glob(pattern))
            todo.append((d / "tables.json", {"note": "the tables of a reproduce run written before run records, "
                                             "sealed as committed", "files": file_digests(d, names)}))
    for path, body in todo:
        print(f"{'would seal' if a.check else 'sealed'} {path.relative_to(ROOT)}")
        if a.check:
            continue
        before = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
        write_record(path, body)
        assert before is None or unchanged(before, json.loads(path.read_text(encoding="utf-8"))), path
    return 1 if a.check and todo else 0


if __name__ == "__main__":
    sys.exit(main())
