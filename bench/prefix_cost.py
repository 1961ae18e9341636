"""What a per-layer KLD study costs with and without the unquantized prefix reused (#64: "a 30-layer per-layer study at
about half today's forwards").

One process, a model, the first ``--windows`` perplexity windows (LAMBADA, gptq protocol, ``--length`` tokens): one
``score_windows`` of every one-layer spec ``SPEC; layers:i`` (i over all decoder layers, as sensitivity's text cells),
with the prefix reused (the default) and with it off (every side runs every layer: ``prefix_start`` patched to 0),
interleaved, after one warm-up of each; median of ``--reps``. Also the decoder layers run by each (counted by a
pre-hook), and whether both give the same bytes (every per-token value; a control: the whole run twice). Goal: reused / whole <= 0.6.
Writes bench/results/prefix_cost.json (see bench/artifact.py).
Usage: python bench/prefix_cost.py [--model smollm2-135m] [--spec w8a8] [--windows 2] [--length 512] [--reps 3]
"""

from __future__ import annotations

import argparse

from artifact import begin, interleaved, median, write  # bench/artifact.py (on sys.path as a script)


def main() -> None:
    start = begin()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--spec", default="w8a8")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()

    import numpy as np

    import outlierscope.eval.perplexity as perplexity
    from outlierscope.data.running_text import load_text
    from outlierscope.eval.windows import protocol_windows
    from outlierscope.hooks.points import decoder_layers
    from outlierscope.models.loading import load_model
    from outlierscope.quant.specs.spec import QuantSpec

    lm = load_model(a.model)
    n_layers = len(decoder_layers(lm.model))
    windows = protocol_windows("gptq", lm.tokenizer, load_text().docs[: 40 * a.windows], a.length)[: a.windows]
    specs = [QuantSpec.parse(f"{a.spec}; layers:{i}") for i in range(n_layers)]
    reuse = perplexity.prefix_start
    runs: list = []
    handles = [b.register_forward_pre_hook(lambda m, args: runs.append(1)) for b in decoder_layers(lm.model)]

    def cell(prefix: bool):
        perplexity.prefix_start = reuse if prefix else (lambda spec: 0)
        try:
            return perplexity.score_windows(lm.model, windows, specs, batch_size=len(windows))
        finally:
            perplexity.prefix_start = reuse

    layers_run, values = {}, {}
    for name, prefix in (("reused", True), ("whole", False)):  # warm-up, layers counted, values kept
        runs.clear()
        values[name] = cell(prefix)
        layers_run[name] = len(runs)
    values["whole again"] = cell(False)

    def same(a: str, b: str) -> bool:
        return all(np.array_equal(getattr(x, k), getattr(y, k)) for x, y in zip(values[a], values[b], strict=True)
                   for k in ("nll", "nll_base", "kld", "p_diff", "same_top"))

    raw = interleaved({"reused": lambda: cell(True), "whole": lambda: cell(False)}, a.reps, warmup=False)
    for h in handles:
        h.remove()
    derived = {"median_s": {k: median(v) for k, v in raw.items()},
               "ratio_reused_vs_whole": round(median(raw["reused"]) / median(raw["whole"]), 3), "goal_ratio": 0.6,
               "layers_run": layers_run, "same_bytes": same("reused", "whole"),
               "control_same_bytes": same("whole", "whole again")}
    write(f"prefix_cost_{a.model.replace(':', '-')}", {"model": a.model, "spec": a.spec, "layers": n_layers,
                                                       "windows": a.windows, "length": a.length, "seconds": raw},
          derived, start=start, notes="seconds of one score_windows of every one-layer spec (the base included); "
          "layers_run: decoder-layer forwards of one such call; same_bytes: every per-token value equal; "
          "control_same_bytes: two whole runs, the same")


if __name__ == "__main__":
    main()
