"""Data parallelism: N processes under torchrun (gloo) against 1, on the same items, same results.

``--command sweep`` (default) runs ``outlierscope sweep --model pair-tiny:diff --bits 16 4 --limit 400``;
``--command sensitivity`` runs ``outlierscope sensitivity --model smollm2-135m --quant kivi-2bit --limit 32
--no-all-but --no-attn-error --profile-tokens 1000`` (its 30 one-layer cells, the unquantized cell and the greedy's
tries, each split over the processes: a study's shape; 32 items are 4 forwards of 8 items, 2 per process, so the
scoring dominates the start-up). Each
runs as one process and under ``torchrun --nproc-per-node N``, every process with one thread (``OMP_NUM_THREADS=1``:
torchrun's default, and what byte-identity needs, since BLAS sums a product in another order with another number
of threads), each timed as a whole process (start-up, loading, scoring, gather, writing), and the bench checks that
the data files (csv) are byte-identical. On a 2-core machine this measures how the work divides over 2 processes of
one core each.

Usage: python bench/parallel.py [--command sweep|sensitivity] [--limit N] [--procs 2] [--reps 3] [--model M]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# command -> (default model, default items, its other arguments)
COMMANDS = {"sweep": ("pair-tiny:diff", 400, ["--bits", "16", "4"]),
            "sensitivity": ("smollm2-135m", 32, ["--quant", "kivi-2bit", "--no-all-but", "--no-attn-error",
                                                "--profile-tokens", "1000"])}


def run(args: list[str], procs: int, out: Path) -> float:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"] if procs > 1 \
        else [sys.executable]
    t0 = time.perf_counter()
    subprocess.run([*launch, "-m", "outlierscope", *args, "--out", str(out)], cwd=ROOT, check=True,
                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> int:
    from artifact import begin, median, write

    start = begin()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--command", choices=tuple(COMMANDS), default="sweep")
    p.add_argument("--limit", type=int, help="items (default: sweep 400, sensitivity 32)")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--model", help="default: sweep pair-tiny:diff, sensitivity smollm2-135m")
    p.add_argument("--reps", type=int, default=3, help="timed runs of each side, alternating (median quoted)")
    a = p.parse_args()
    model, limit, rest = COMMANDS[a.command]
    a.model, a.limit = a.model or model, a.limit or limit
    args = [a.command, "--model", a.model, *rest, "--limit", str(a.limit)]
    t1, tn, same = [], [], True
    for _ in range(a.reps):  # fresh output directories: every run computes every cell
        with tempfile.TemporaryDirectory() as tmp:
            one, many = Path(tmp) / "one", Path(tmp) / "many"
            t1.append(round(run(args, 1, one), 2))
            tn.append(round(run(args, a.procs, many), 2))
            files = sorted(str(f.relative_to(one)) for f in one.rglob("*.csv"))
            same &= all((one / f).read_bytes() == (many / f).read_bytes() for f in files)
    raw = {"command": "outlierscope " + " ".join(args), "procs": a.procs, "one_process_s": t1, "processes_s": tn,
           "compared_files": files}
    m1, mn = median(t1), median(tn)
    cells = sum(1 for f in files if f.startswith("cells/"))
    raw["cells"] = cells
    derived = {"one_process_s": round(m1, 1), "processes_s": round(mn, 1), "speedup": round(m1 / mn, 2),
               "identical_files": same, "procs": a.procs, "items": a.limit, "cells": cells,
               # one thread's seconds per (cell, item), start-up included: what a reader scales to another study
               "one_process_s_per_cell_item": round(m1 / (cells * a.limit), 4)}
    write(f"parallel_{a.command}_{a.procs}", raw, derived, start=start,
          notes=f"whole processes of one thread each (OMP_NUM_THREADS=1), {a.reps} runs of each side alternating, "
                "medians")
    return 0 if same else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
