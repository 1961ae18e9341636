"""Machine-readable records of benchmark runs: every number quoted in bench/README.md comes from one.

A record holds the command, the code version (git commit, and whether the tree had changes), the machine
(CPU model, cores, GPU if any, load average when the run started), library versions, the raw timings of
every repetition and the derived figures. Timings under a minute are repeated (median of >= 3).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("BENCH_RESULTS") or ROOT / "bench" / "results")  # BENCH_RESULTS: a trial run elsewhere
RECORD_DIRS = ("bench/results/", "references/results/")  # records: writing one is no change of the code that measures


def begin() -> dict:
    """What a record says of its bench's start: the 1-minute load average then (another job's load, not the bench's
    own). The first line of every bench's ``main``; its result goes to :func:`write` as ``start``."""
    return {"load_average_1m_at_start": round(os.getloadavg()[0], 2)}


def machine(start: dict) -> dict:
    """The machine, with ``start`` (:func:`begin`; records written before 2026-12-02 03:10 UTC hold the load average
    at their end under the same key: their bench's own load)."""
    from outlierscope.io import machine as base

    return {**base(), **start, "platform": platform.platform()}


def _git() -> dict:
    """The commit, and whether tracked files other than the records (bench/results/, references/results/) differ from
    it (a record written by the run before this one is no change of the code that measured)."""
    import subprocess

    from outlierscope.io import git_commit

    commit = (git_commit() or "").removesuffix("+changes")
    try:
        st = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                            text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        st = []
    changed = [line[3:] for line in st if not line[3:].startswith(RECORD_DIRS)]
    return {"commit": commit, "dirty": bool(changed), **({"changed": changed} if changed else {})}


def repeat(fn, reps: int = 3) -> list[float]:
    """Seconds of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def fresh_process_peak_rss(code: str, *argv: str) -> float:
    """Run Python ``code`` (with ``argv``) in a fresh process; its peak resident memory in MiB. A failing ``code``
    raises (``CalledProcessError``). :func:`outlierscope.io.peak_rss_mb`: VmHWM, not ``ru_maxrss``, which a child keeps
    from its parent when that is larger (a bench that has loaded a model would read its own peak back)."""
    import subprocess

    probe = "\nfrom outlierscope.io import peak_rss_mb as _peak\nprint('PEAK_RSS_MB', _peak())"
    r = subprocess.run([sys.executable, "-c", code + probe, *argv], capture_output=True, text=True, check=True)
    return float(next(line.split()[1] for line in r.stdout.splitlines() if line.startswith("PEAK_RSS_MB")))


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def write(name: str, raw: dict, derived: dict, start: dict, notes: str = "", folder: Path | None = None) -> Path:
    """Write ``{folder}/{name}.json`` (default ``bench/results``; references/'s proofs: ``references/results``) with
    the run's context (``start``: :func:`begin` at the bench's start); returns its path."""
    from outlierscope.io import versions, write_record

    record = {"name": name, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "git": _git(), "machine": machine(start),
              "versions": versions(), "raw": raw, "derived": derived, "notes": notes}
    path = (folder or RESULTS) / f"{name}.json"
    write_record(path, record)  # sealed: read back, a changed number is found
    print(json.dumps(record, indent=2))
    return path


def cost_args(description: str):
    """The arguments of a cell-cost bench (recipe_cost, linear_cost): --reps, --items, --model."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--items", type=int, default=100)
    ap.add_argument("--model", default="smollm2-135m")
    return ap.parse_args()


def interleaved(cells: dict, reps: int, warmup: bool = True, decimals: int = 2) -> dict[str, list[float]]:
    """Seconds of each named zero-argument callable, per repetition every one in turn (interleaved, so a change of the
    machine's load reaches all of them alike), after one warm-up call of each unless ``warmup`` is False (the caller
    warmed them up itself)."""
    if warmup:
        for fn in cells.values():
            fn()
    raw = {name: [] for name in cells}
    for rep in range(reps):
        for name, fn in cells.items():
            t0 = time.perf_counter()
            fn()
            raw[name].append(round(time.perf_counter() - t0, decimals))
            print(f"rep {rep} {name}: {raw[name][-1]:.{max(decimals - 1, 1)}f} s", flush=True)
    return raw


def time_cells(lm, specs: dict, items: list, reps: int) -> dict[str, list[float]]:
    """Seconds of ``evaluate`` per named spec on ``items``, after one warm-up of each on 8 items (:func:`interleaved`)."""
    from outlierscope.eval.evaluate import evaluate

    for spec in specs.values():  # warm-up
        evaluate(lm, quant=spec, items=items[:8], progress=False)
    cells = {name: (lambda spec=spec: evaluate(lm, quant=spec, items=items, progress=False)) for name, spec in specs.items()}
    return interleaved(cells, reps, warmup=False)
