"""Compare two profile runs table by table (issue: profile at the speed of a forward — outputs unchanged except moments).

For every CSV both runs wrote: byte-identical or not; for a table that differs, per column the rows that differ and
the largest relative difference; for histograms.csv the share of values that moved bin; for moment tables the
largest |mean difference| / std. Writes bench/results/NAME.json (see bench/artifact.py); the record's notes should
say how the runs were made (commits, command, threads).
Usage: python bench/compare_profiles.py OLD_DIR NEW_DIR --record NAME --notes "..."
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from artifact import begin, write  # bench/artifact.py (this folder is on sys.path when run as a script)


def compare_table(a: pd.DataFrame, b: pd.DataFrame) -> dict:
    if list(a.columns) != list(b.columns) or a.shape != b.shape:
        return {"same_shape": False}
    cols = {}
    for c in a.columns:
        if a[c].equals(b[c]):
            continue
        if a[c].dtype.kind in "fi" and b[c].dtype.kind in "fi":
            x, y = a[c].to_numpy(float), b[c].to_numpy(float)
            with np.errstate(divide="ignore", invalid="ignore"):
                rel = np.abs(x - y) / np.abs(x)
            cols[c] = {"rows": int((x != y).sum()), "max_rel": float(np.nanmax(np.where(x == y, 0, rel)))}
        else:
            cols[c] = {"rows": int((a[c] != b[c]).sum()), "max_rel": None}
    return {"same_shape": True, "differing_columns": cols}


def main() -> None:
    start = begin()
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--record", required=True)
    p.add_argument("--notes", default="")
    a = p.parse_args()
    old, new = Path(a.old), Path(a.new)
    raw, derived = {}, {"identical": [], "different": []}
    for f in sorted(old.glob("*.csv")):
        g = new / f.name
        if not g.exists():
            continue
        same = f.read_bytes() == g.read_bytes()
        derived["identical" if same else "different"].append(f.stem)
        if not same:
            ta, tb = pd.read_csv(f), pd.read_csv(g)
            raw[f.stem] = compare_table(ta, tb)
            if f.stem == "histograms":
                moved = (ta["count"] - tb["count"]).abs().sum() / 2
                derived["histogram_share_moved"] = float(moved / ta["count"].sum())
            if {"mean", "std"} <= set(ta.columns):
                derived[f"{f.stem}_max_mean_diff_over_std"] = float((np.abs(ta["mean"] - tb["mean"]) / ta["std"]).max())
    write(a.record, raw, derived, start=start, notes=a.notes)


if __name__ == "__main__":
    main()
