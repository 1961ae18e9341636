"""Where a profile's time goes (#64: Table 5's points at 0.57x the sdpa forward on SmolLM2, goal 0.9x).

One process, a model, the same shapes as bench/cost.py's profile cell (``--windows`` sequences of ``--length`` tokens
of HellaSwag text, batches of ``--batch``): per repetition (interleaved, after a warm-up of each) the sdpa forward,
the forward through outlierscope's attention function (16 bits, the logits materialised but not observed), and
``profile_model`` with its defaults; then torch.profiler's top self-CPU entries of one profile.
Writes bench/results/profile_where_MODEL.json (see bench/artifact.py).
Usage: python bench/profile_where.py [--model smollm2-135m] [--windows 4] [--length 512] [--batch 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import contextlib

from artifact import begin, interleaved, median, write  # bench/artifact.py (on sys.path as a script)


def main() -> None:
    start = begin()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()

    import torch
    from torch.profiler import profile as torch_profile

    from outlierscope.data.text import pack_sequences, shuffled, text_documents
    from outlierscope.models.loading import load_model
    from outlierscope.quant.apply import quantize_model
    from outlierscope.runs.profile import ProfileSettings, profile_model

    lm = load_model(a.model, attn_implementation="sdpa")  # the base: transformers' sdpa (load_model's default is eager)
    seqs = pack_sequences(lm.tokenizer, shuffled(text_documents("hellaswag"), 0), a.length, a.windows * a.length)

    def forward(ours: bool):
        with torch.no_grad(), quantize_model(lm.model, "none") if ours else contextlib.nullcontext():
            for i in range(0, len(seqs), a.batch):
                lm.model(input_ids=seqs[i:i + a.batch], use_cache=False)

    settings = ProfileSettings(tokens=int(seqs.numel()), seq_len=a.length, batch_size=a.batch)
    cells = {"forward sdpa": lambda: forward(False), "forward ours 16-bit": lambda: forward(True),
             "profile": lambda: profile_model(lm, settings=settings, progress=False)}
    raw = interleaved(cells, a.reps, decimals=3)
    with torch_profile() as p:
        cells["profile"]()
    top = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12).splitlines()
    med = {k: median(v) for k, v in raw.items()}
    derived = {"median_s": med, "profile_vs_sdpa_forward": round(med["forward sdpa"] / med["profile"], 3),
               "ours_vs_sdpa_forward": round(med["forward sdpa"] / med["forward ours 16-bit"], 3),
               "profile_top_entries": top}
    write(f"profile_where_{a.model.replace(':', '-')}", {"model": a.model, "tokens": int(seqs.numel()),
                                                          "seconds": raw}, derived, start=start,
          notes="tokens/s ratios (as many tokens, the same shapes); profile_top_entries: one profile, torch.profiler")


if __name__ == "__main__":
    main()
