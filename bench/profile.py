"""Profiling throughput and memory (issue: hooks and streaming statistics).

1. tokens/s of ``profile_model`` (capture + OutlierStats) vs a plain eager forward and an sdpa forward
   of the same model on the same tokens.
2. Peak RSS of profiling 0.1M vs 1M tokens (each in a fresh subprocess).

Goals: >= 0.5x the eager forward's throughput; peak RSS grows <= 100 MB from 0.1M to 1M tokens.
Usage: python bench/profile.py [--model pair-tiny:diff] [--tokens 100000]
"""

from __future__ import annotations

import sys

# this folder holds profile.py, which would shadow the standard library's `profile` (imported by torch)
sys.path[:] = [x for x in sys.path if not x.rstrip("/").endswith("bench")]

import argparse
import json
import subprocess
import sys
import time


def throughput(spec: str, tokens: int) -> dict:
    import torch

    from outlierscope.data.text import pack_sequences, shuffled, text_documents
    from outlierscope.models.loading import load_model
    from outlierscope.runs.profile import ProfileSettings, profile_model

    lm = load_model(spec)
    seqs = pack_sequences(lm.tokenizer, shuffled(text_documents("hellaswag"), 0), 256, tokens)
    out = {}
    for impl in ("eager", "sdpa"):
        lm.model.set_attn_implementation(impl)
        t0 = time.time()
        with torch.no_grad():
            for i in range(0, len(seqs), 8):
                lm.model(input_ids=seqs[i : i + 8], use_cache=False)
        out[f"{impl}_forward_tok_s"] = round(seqs.numel() / (time.time() - t0))
    lm.model.set_attn_implementation("eager")
    _, facts = profile_model(lm, ProfileSettings(tokens=tokens, seq_len=256, batch_size=8), progress=False)
    out["profile_tok_s"] = round(facts["tokens_per_s"])
    out["profile_vs_eager"] = round(out["profile_tok_s"] / out["eager_forward_tok_s"], 2)
    return out


def peak_rss(spec: str, tokens: int) -> float:
    code = (
        "import resource, tempfile; from outlierscope.runs.profile import ProfileSettings, profile;"
        f"profile([{spec!r}], ProfileSettings(tokens={tokens}, seq_len=256), tempfile.mkdtemp(), progress=False);"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="pair-tiny:diff")
    p.add_argument("--tokens", type=int, default=100_000)
    p.add_argument("--skip-rss", action="store_true")
    a = p.parse_args()
    res = {"model": a.model, "tokens": a.tokens, **throughput(a.model, a.tokens)}
    if not a.skip_rss:
        small, big = peak_rss(a.model, 100_000), peak_rss(a.model, 1_000_000)
        res.update(peak_rss_mb_100k=round(small), peak_rss_mb_1m=round(big), rss_growth_mb=round(big - small))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
