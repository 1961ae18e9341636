"""Profiling throughput and memory (issues: hooks and streaming statistics; profile at the speed of a forward).

Per model (the bundled pair's Diff model and SmolLM2-135M):
1. tokens/s of ``profile_model`` (capture + OutlierStats, Table 5's two point kinds; compiled statistics, the default,
   and ``compile=False``) vs a plain eager forward and an sdpa forward of the same model on the same tokens;
2. tokens/s of a profile with every point (``layers.*`` and ``lm_head.input``) on fewer tokens;
3. peak RSS of the default profile and of the every-point profile (each a fresh process), and for the pair the
   default profile at 0.1M and 1M tokens (growth).

Goals: the default profile >= 0.7x the eager forward on both models; RSS grows <= 100 MB from 0.1M to 1M tokens.
Each throughput is the median of 3 timed runs (after a warm-up that also compiles), in one process, start-up excluded.
Writes bench/results/profile.json (see bench/artifact.py).
Usage: python bench/profile_throughput.py [--reps 3] [--skip-rss] [--models pair smollm2]
"""

from __future__ import annotations

import argparse

from artifact import (  # bench/artifact.py (this folder is on sys.path when run as a script)
    begin,
    fresh_process_peak_rss,
    median,
    repeat,
    write,
)

# name -> (model spec, tokens for the forward and default profile timings, tokens for the every-point profile)
MODELS = {"pair": ("pair-tiny:diff", 100_000, 16_384), "smollm2": ("smollm2-135m", 8_192, 4_096)}
EVERY = ("layers.*", "lm_head.input")


def throughput(spec: str, tokens: int, every_tokens: int, reps: int) -> dict:
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

    raw = {"tokens": int(seqs.numel())}
    for impl in ("eager", "sdpa"):
        lm.model.set_attn_implementation(impl)
        raw[f"{impl}_forward_s"] = repeat(forward, reps)
    lm.model.set_attn_implementation("eager")
    runs = {"profile": ProfileSettings(tokens=tokens, seq_len=256, batch_size=8),
            "profile_uncompiled": ProfileSettings(tokens=tokens, seq_len=256, batch_size=8, compile=False),
            "every_point": ProfileSettings(tokens=every_tokens, seq_len=256, batch_size=8, points=EVERY)}
    for name, settings in runs.items():
        raw[f"{name}_s"] = repeat(lambda s=settings: profile_model(lm, settings=s, progress=False), reps)
    raw["every_point_tokens"] = len(pack_sequences(lm.tokenizer, shuffled(text_documents("hellaswag"), 0), 256,
                                                   every_tokens)) * 256
    return raw


def peak_rss(spec: str, tokens: int, points: tuple[str, ...] | None = None) -> float:
    pts = f", points={points!r}" if points else ""
    return fresh_process_peak_rss(
        "import tempfile; from outlierscope.runs.profile import ProfileSettings, profile;"
        f"profile([{spec!r}], ProfileSettings(tokens={tokens}, seq_len=256{pts}), tempfile.mkdtemp(), progress=False)")


def derive(name: str, raw: dict) -> dict:
    tok = {k: raw["tokens"] / median(raw[f"{k}_s"]) for k in ("eager_forward", "sdpa_forward", "profile", "profile_uncompiled")}
    tok["every_point"] = raw["every_point_tokens"] / median(raw["every_point_s"])
    d = {f"{name}_{k}_tok_s": round(v) for k, v in tok.items()}
    d[f"{name}_profile_vs_eager"] = round(tok["profile"] / tok["eager_forward"], 2)
    d[f"{name}_uncompiled_vs_eager"] = round(tok["profile_uncompiled"] / tok["eager_forward"], 2)
    d[f"{name}_every_point_vs_eager"] = round(tok["every_point"] / tok["eager_forward"], 2)
    for k in ("peak_rss_mb", "every_point_peak_rss_mb", "peak_rss_mb_100k", "peak_rss_mb_1m"):
        if k in raw:
            d[f"{name}_{k}"] = round(raw[k])
    if "peak_rss_mb_1m" in raw:
        d[f"{name}_rss_growth_mb"] = round(raw["peak_rss_mb_1m"] - raw["peak_rss_mb_100k"])
    return d


def main() -> None:
    start = begin()
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-rss", action="store_true")
    a = p.parse_args()
    raw, derived = {}, {}
    for name in a.models:
        spec, tokens, every_tokens = MODELS[name]
        r = {"model": spec, **throughput(spec, tokens, every_tokens, a.reps)}
        if not a.skip_rss:
            r["peak_rss_mb"] = peak_rss(spec, tokens)
            r["every_point_peak_rss_mb"] = peak_rss(spec, every_tokens, EVERY)
            if name == "pair":
                r["peak_rss_mb_100k"], r["peak_rss_mb_1m"] = r["peak_rss_mb"], peak_rss(spec, 1_000_000)
        raw[name] = r
        derived.update(derive(name, r))
    write("profile", raw, derived, start=start, notes="batch 8 x 256 tokens of HellaSwag text; every point: layers.* and "
          "lm_head.input on every_point_tokens; RSS: one fresh process each (the pair's peak_rss_mb is its 0.1M run)")


if __name__ == "__main__":
    main()
