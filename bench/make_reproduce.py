"""The wall time of `make reproduce` on this machine (#64: goal 25 minutes on 2 cores), from a clean clone.

Clones this repository's HEAD into ``--clone`` (beside the repository by default), runs ``make reproduce`` there
(install into the clone's .venv, data, the pair's Table 5 and Figure 8 on all 10,042 HellaSwag items, SmolLM2-135M at
``REAL_ARGS``) under a wall clock, then reads the two runs' ``reproduce.json`` (their stages' wall times, machine and
commit) and compares the pair's tables with the committed ones (docs/reproduction/table5.csv and sweep.csv, matched by
cell id: the largest difference of each column and metric). ``--from DIR --make-seconds S``: collect a ``make reproduce`` already run in the clean clone DIR instead.
One repetition (a run takes half an hour); the machine must be otherwise idle (its load is recorded).
Writes bench/results/make_reproduce.json (see bench/artifact.py).
Each run's processes and threads per process (``make reproduce`` starts ``NPROC`` processes of one thread under
torchrun since 2026-12-07: ``launch``). ``--make-args 'REPRODUCE_ARGS=--fused' --tag fused``: the same with make
variables given (here the pair's run with its quantizers compiled, the same bytes), into
bench/results/make_reproduce_fused.json.
Usage: python bench/make_reproduce.py [--clone DIR] [--make-args 'VAR=VALUE ...' --tag TAG] | [--from DIR --make-seconds S]
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from artifact import ROOT, begin, write  # bench/artifact.py (on sys.path as a script)

RUNS = {"pair": "runs/reproduce", "smollm2-135m": "runs/reproduce-smollm2-135m"}


def _run(clone: Path, make_args: list[str]) -> float:
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    t0 = time.time()
    subprocess.run(["make", "reproduce", *make_args], cwd=clone, check=True)
    return round(time.time() - t0, 1)


def _collect(clone: Path) -> dict:
    """Each run's reproduce.json (checked by its digest) and how far the pair's tables are from the committed ones
    (docs/reproduction, made on another day and maybe another processor: float32 last bits may differ)."""
    import numpy as np
    import pandas as pd

    from outlierscope.io import read_record, vouched

    runs = {name: read_record(clone / rel / "reproduce.json", ("timings", "settings", "machine", "git_commit"),
                              "reproduce record", sealed_only=True) for name, rel in RUNS.items()}
    docs = ROOT / "docs" / "reproduction"
    committed = read_record(docs / "tables.json", ("files",), "tables record", sealed_only=True)
    pair = clone / RUNS["pair"]
    profile = read_record(pair / "profile" / "profile.json", ("files",), "profile record", sealed_only=True)
    sweep = read_record(pair / "sweep" / "sweep.json", ("cells", "files"), "sweep record", sealed_only=True)
    t5 = pd.read_csv(vouched(profile, pair / "profile", "table5.csv", "profile"))
    t5_doc = pd.read_csv(vouched(committed, docs, "table5.csv"))
    cols = ["top1", "top2", "top3", "top10", "top100", "median", "count"]
    assert (t5[["model", "point"]].values == t5_doc[["model", "point"]].values).all()
    sw = pd.read_csv(vouched(sweep, pair / "sweep", "sweep.csv", "sweep")).merge(
        pd.read_csv(vouched(committed, docs, "sweep.csv")), on=["model", "bits", "metric", "cell"], suffixes=("", "_doc"))
    diff = (sw["value"] - sw["value_doc"]).abs()
    cells_s = {f"{c['model']} {c['label']}": c["seconds"] for c in sweep["cells"]}
    rel = {c: float(np.max(np.abs(t5[c] - t5_doc[c]) / np.abs(t5_doc[c]))) for c in cols}
    return {"runs": runs, "pair_sweep_cells_s": cells_s, "vs_docs_reproduction": {
        "table5_max_relative_difference": rel, "table5_largest_relative_difference": max(rel.values()),
        "sweep_rows_matched": len(sw),
        "sweep_max_abs_difference": {m: float(diff[sw["metric"] == m].max()) for m in sorted(set(sw["metric"]))}}}


def main() -> None:
    start = begin()  # with --from: replaced below (the load when that make began was not measured here)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clone", type=Path, default=ROOT.parent / "outlierscope-make-reproduce")
    ap.add_argument("--from", dest="src", type=Path, help="a clean clone where `make reproduce` already ran")
    ap.add_argument("--make-seconds", type=float, help="with --from: that make's wall time")
    ap.add_argument("--make-args", default="", help="make variables, e.g. 'REPRODUCE_ARGS=--fused' (needs --tag)")
    ap.add_argument("--tag", help="write make_reproduce_TAG.json (a variant beside the default record)")
    a = ap.parse_args()
    if (a.src is None) != (a.make_seconds is None):
        ap.error("--from and --make-seconds go together")
    make_args = a.make_args.split()
    if (make_args and not a.tag) or any("=" not in m for m in make_args):
        ap.error("--make-args takes make variables VAR=VALUE and goes with --tag (its record is not the default's)")
    clone = a.src or a.clone
    make_s = a.make_seconds if a.src else _run(clone, make_args)
    if a.src:
        start = {"load_average_1m_at_start": None}
    got = _collect(clone)
    commits = {name: r["git_commit"] for name, r in got["runs"].items()}
    stages = {name: r["timings"] for name, r in got["runs"].items()}
    runs_s = sum(t["total_s"] for t in stages.values())
    launch = {name: {"processes": r.get("processes", 1), "threads": r["machine"]["torch_threads"]}
              for name, r in got["runs"].items()}  # reproduce.json without the key: one process
    derived = {"make_reproduce_min": round(make_s / 60, 1), "runs_min": round(runs_s / 60, 1), "goal_min": 25,
               "launch": launch,
               "stages_s": stages, "run_commits": commits, **{k: v for k, v in got.items() if k != "runs"}}
    write("make_reproduce" + (f"_{a.tag}" if a.tag else ""), {"make_seconds": make_s, "clone": str(clone),
                             "make_args": make_args,
                             "settings": {n: r["settings"] for n, r in got["runs"].items()},
                             "machines": {n: r["machine"] for n, r in got["runs"].items()}}, derived, start=start,
          notes="one repetition (half an hour); make_reproduce_min: the whole target (install, data, both runs), "
          "runs_min: the two runs' own wall times (reproduce.json); run_commits: the clean clone's commit; "
          "load_average_1m_at_start None: collected with --from (the load when that make began not measured)")


if __name__ == "__main__":
    main()
