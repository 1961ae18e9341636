"""Put a profile of every observation point under docs/activations/NAME: the tables the report reads (channels
only for the keys, down_proj inputs and hidden states; every other table whole, except histograms.csv (3,700 bins
per point: tens of MB; the medians are in per_layer.csv) and massive.csv (every single exceedance, summarized in
massive_recurrence.csv)), profile.json, then report.md and its figures.

Usage: python docs/activations/assemble.py RUN_DIR NAME   (RUN_DIR: `outlierscope profile ... --out RUN_DIR`)
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pandas as pd

from outlierscope.io import write_csv
from outlierscope.report.markdown import write_report

HERE = Path(__file__).resolve().parent
KEEP_CHANNELS = ("attn.k", "mlp.down_proj.input", "hidden")
SKIP = {"massive.csv", "channels.csv", "positions.csv", "histograms.csv", "report.md"}


def main(run: str, name: str) -> None:
    src, dst = Path(run), HERE / name
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in SKIP and not f.name.startswith(("profile.shard", "act_scales")) \
                and f.suffix in (".csv", ".json", ".md"):
            shutil.copy(f, dst / f.name)
    for table, keep in (("channels", KEEP_CHANNELS), ("positions", ("hidden", "attn.k"))):
        df = pd.read_csv(src / f"{table}.csv")
        write_csv(dst / f"{table}.csv", df[df["point"].isin(keep)])
    print(write_report(dst))


if __name__ == "__main__":
    main(*sys.argv[1:])
