"""Profiling throughput and memory (issue: hooks and streaming statistics).

1. tokens/s of ``profile_model`` (capture + OutlierStats) vs a plain eager forward and an sdpa forward
   of the same model on the same tokens.
2. Peak RSS of profiling 0.1M vs 1M tokens (each in a fresh subprocess).

Goals: >= 0.5x the eager forward's throughput; peak RSS grows <= 100 MB from 0.1M to 1M tokens.
Each throughput is the median of 3 timed runs (after a warm-up), all in one process, start-up excluded.
Writes bench/results/profile.json (see bench/artifact.py).
Usage: python bench/profile_throughput.py [--model pair-tiny:diff] [--tokens 100000]
"""

from __future__ import annotations

import argparse

from artifact import (  # bench/artifact.py (this folder is on sys.path when run as a script)
    fresh_process_peak_rss,
    median,
    repeat,
    write,
)


def throughput(spec: str, tokens: int, reps: int) -> dict:
    import torch

    from outlierscope.data.text import pack_sequences, shuffled, text_documents
    from outlierscope.models.loading import load_model
    from outlierscope.runs.profile import ProfileSettings, profile_model

    lm = load_model(spec)
    seqs = pack_sequences(lm.tokenizer, shuffled(text_documents("hellaswag"), 0), 256, tokens)

    def forward():
        with torch.no_grad():
            for i in range(0, len(seqs), 8):
                lm.model(input_ids=seqs[i : i + 8], use_cache=False)

    raw = {}
    for impl in ("eager", "sdpa"):
        lm.model.set_attn_implementation(impl)
        raw[f"{impl}_forward_s"] = repeat(forward, reps)
    lm.model.set_attn_implementation("eager")
    settings = ProfileSettings(tokens=tokens, seq_len=256, batch_size=8)
    raw["profile_s"] = repeat(lambda: profile_model(lm, settings=settings, progress=False), reps)
    return {"tokens": int(seqs.numel()), **raw}


def peak_rss(spec: str, tokens: int) -> float:
    return fresh_process_peak_rss(
        "import tempfile; from outlierscope.runs.profile import ProfileSettings, profile;"
        f"profile([{spec!r}], ProfileSettings(tokens={tokens}, seq_len=256), tempfile.mkdtemp(), progress=False)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="pair-tiny:diff")
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-rss", action="store_true")
    a = p.parse_args()
    raw = {"model": a.model, **throughput(a.model, a.tokens, a.reps)}
    tok = raw["tokens"]
    derived = {k.removesuffix("_s") + "_tok_s": round(tok / median(raw[k])) for k in ("eager_forward_s", "sdpa_forward_s", "profile_s")}
    derived["profile_vs_eager"] = round(derived["profile_tok_s"] / derived["eager_forward_tok_s"], 2)
    if not a.skip_rss:
        raw["peak_rss_mb_100k"], raw["peak_rss_mb_1m"] = peak_rss(a.model, 100_000), peak_rss(a.model, 1_000_000)
        derived.update(peak_rss_mb_100k=round(raw["peak_rss_mb_100k"]), peak_rss_mb_1m=round(raw["peak_rss_mb_1m"]),
                       rss_growth_mb=round(raw["peak_rss_mb_1m"] - raw["peak_rss_mb_100k"]))
    write("profile", raw, derived, notes="throughput: batch 8 x 256 tokens of HellaSwag text; RSS: one fresh process each")


if __name__ == "__main__":
    main()
