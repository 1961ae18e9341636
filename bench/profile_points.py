"""Peak memory (and throughput) of profiles with many observation points (issue: every activation).

Three configurations of one model, each repetition a fresh process profiling the same tokens:
``two`` (Table 5's two point kinds), ``linear_qkv`` (every nn.Linear input, SmoothQuant's preset, plus q/k/v) and
``every`` (every point: ``layers.*`` and ``lm_head.input``), and ``every`` again at 4x the tokens.
Goal: peak RSS of ``linear_qkv`` within 2x of ``two``; the statistics are bounded, so 4x the tokens adds nothing.
Peak RSS does not depend on the machine's load; tokens/s does (``--rss-only`` leaves it out of the record).
Writes bench/results/profile_points.json (see bench/artifact.py).
Usage: python bench/profile_points.py [--model smollm2-135m] [--tokens 4096] [--reps 3] [--rss-only]
       python bench/profile_points.py --tokens 400000 --reps 1 --rss-only --configs two linear_qkv --record NAME
       (the memory goal at the issue's 0.4M tokens: only the named configurations, no 4x run, bench/results/NAME.json)
"""

from __future__ import annotations

import argparse
import json
import tempfile

from artifact import (  # bench/artifact.py (on sys.path when run as a script)
    begin,
    fresh_process_peak_rss,
    median,
    write,
)

CONFIGS = {
    "two": [],
    "linear_qkv": ["--preset", "smoothquant", "--points", "layers.*.attn.q", "--points", "layers.*.attn.k",
                   "--points", "layers.*.attn.v"],
    "every": ["--points", "layers.*", "--points", "lm_head.input"],
}


def run(model: str, tokens: int, args: list[str]) -> tuple[float, float]:
    """(seconds of the profile, as its record says; peak RSS of the whole process, MB) of one fresh process."""
    with tempfile.TemporaryDirectory() as out:
        code = "import sys; from outlierscope.cli import main; assert main(sys.argv[1:]) == 0"
        rss = fresh_process_peak_rss(code, "profile", "--model", model, "--tokens", str(tokens), *args, "--out", out)
        facts = json.load(open(f"{out}/profile.json"))["models"]
        return next(iter(facts.values()))["seconds"], rss


def main() -> None:
    start = begin()
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rss-only", action="store_true")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=None,
                   help="only these configurations, and no 4x run (default: all three and every point at 4x)")
    p.add_argument("--record", default="profile_points", help="the record's name: bench/results/NAME.json")
    a = p.parse_args()
    plan = [(name, name, a.tokens) for name in a.configs] if a.configs else \
        [(name, name, a.tokens) for name in CONFIGS] + [("every_4x", "every", 4 * a.tokens)]
    raw, derived = {"model": a.model, "tokens": a.tokens, **({} if a.configs else {"tokens_4x": 4 * a.tokens})}, {}
    for key, name, tokens in plan:
        runs = [run(a.model, tokens, CONFIGS[name]) for _ in range(a.reps)]
        raw[f"{key}_peak_rss_mb"] = [r[1] for r in runs]
        derived[f"{key}_peak_rss_mb"] = round(median(raw[f"{key}_peak_rss_mb"]))
        if not a.rss_only:
            raw[f"{key}_s"] = [r[0] for r in runs]
            derived[f"{key}_tok_s"] = round(tokens / median(raw[f"{key}_s"]), 1)
    for name in ("linear_qkv", "every"):
        if f"{name}_peak_rss_mb" in derived and "two_peak_rss_mb" in derived:
            derived[f"rss_{name}_vs_two"] = round(derived[f"{name}_peak_rss_mb"] / derived["two_peak_rss_mb"], 2)
    if "every_4x_peak_rss_mb" in derived:
        derived["rss_growth_every_4x_tokens_mb"] = derived["every_4x_peak_rss_mb"] - derived["every_peak_rss_mb"]
    write(a.record, raw, derived, start=start, notes=f"{a.model}, HellaSwag text, seq_len 256, batch 8; each repetition "
          "a fresh process (peak RSS of the whole process: model, statistics, tables)")


if __name__ == "__main__":
    main()
