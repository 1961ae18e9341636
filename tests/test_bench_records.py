"""Every benchmark table in bench/README.md is generated from a committed record with its full context."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _tables():
    spec = importlib.util.spec_from_file_location("bench_tables", BENCH / "tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_tables_equal_the_records():
    tables = _tables()
    text = (BENCH / "README.md").read_text()
    names = re.findall(r"<!-- bench:(\w+) -->", text)
    assert set(names) == set(tables.TABLES)  # every table is generated, every generator is used
    assert tables.rewrite(text) == text, "bench/README.md differs from bench/results: run `python bench/tables.py`"


@pytest.mark.parametrize("stem", ["profile", "quant"])
def test_records_carry_their_context(stem):
    rec = json.loads((BENCH / "results" / f"{stem}.json").read_text())
    assert {"command", "date", "git", "machine", "versions", "raw", "derived"} <= set(rec)
    assert len(rec["git"]["commit"]) == 40 and rec["machine"]["cores"] and rec["versions"]["torch"]
    timings = [v for k, v in rec["raw"].items() if k.endswith("_s") and isinstance(v, list)]
    assert timings and all(len(v) >= 3 for v in timings)  # repeated: a median of >= 3
