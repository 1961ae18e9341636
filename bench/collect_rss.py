"""Peak RSS of finished profile runs (the ``peak_rss_mb`` of each run's profile.json) into one record.

For runs too long to repeat inside a bench script (the issue's 0.4M tokens: 30-70 minutes each on 2 cores), each made
by its own ``outlierscope profile`` command (the record's notes name them): one repetition each.
Usage: python bench/collect_rss.py --record NAME --notes "..." two=RUN_DIR every=RUN_DIR [linear_qkv=RUN_DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from artifact import begin, write  # bench/artifact.py (this folder is on sys.path when run as a script)


def main() -> None:
    start = begin()
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+", help="CONFIG=RUN_DIR (two, linear_qkv, every)")
    p.add_argument("--record", required=True)
    p.add_argument("--notes", default="")
    a = p.parse_args()
    raw: dict = {}
    for item in a.runs:
        key, _, run = item.partition("=")
        rec = json.loads((Path(run) / "profile.json").read_text())
        (model, facts), = rec["models"].items()
        raw.setdefault("model", model)
        raw.setdefault("tokens", facts["tokens"])
        if (model, facts["tokens"]) != (raw["model"], raw["tokens"]):
            raise SystemExit(f"{run}: {model} on {facts['tokens']} tokens, expected {raw['model']} on {raw['tokens']}")
        raw[f"{key}_peak_rss_mb"] = [facts["peak_rss_mb"]]
        raw[f"{key}_commit"] = rec.get("git_commit")
        raw[f"{key}_tokens_per_s"] = facts.get("tokens_per_s")
    derived = {f"{k}_peak_rss_mb": round(raw[f"{k}_peak_rss_mb"][0]) for k in ("two", "linear_qkv", "every")
               if f"{k}_peak_rss_mb" in raw}
    for k in ("linear_qkv", "every"):
        if f"{k}_peak_rss_mb" in derived:
            derived[f"rss_{k}_vs_two"] = round(derived[f"{k}_peak_rss_mb"] / derived["two_peak_rss_mb"], 2)
    write(a.record, raw, derived, start=start, notes=a.notes)


if __name__ == "__main__":
    main()
