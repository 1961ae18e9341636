"""What a linear-layer scheme costs against the unquantized cell (issue #38: W8A8 and its mitigations).

One process, SmolLM2-135M, the first 100 HellaSwag validation items (lm-eval scoring, ``evaluate``, the default
batch of 32 sequences): per repetition the unquantized cell, then every scheme cell (the order interleaved, so a
change of the machine's load reaches all of them alike), after one warm-up of each on 8 items. Goal: the ``w8a8``
cell <= 1.5x the unquantized cell (median of the repetitions). Token-local schemes (w8a8, w4a8, ...) share each
context's prefix as the unquantized cell does; per-sequence ones (nvfp4, llm-int8) score every (context, choice) as
its own sequence, so their ratio also holds that layout's cost. Memory: the process's peak RSS after the unquantized
cells and after all cells (the weights are fake-quantized at each forward from the untouched originals, one linear at
a time, so the peak should not grow by a copy of the weights: SmolLM2's are 538 MB in float32).
Writes bench/results/linear_cost.json (see bench/artifact.py).
Usage: python bench/linear_cost.py [--reps 3] [--items 100] [--model smollm2-135m]
"""

from __future__ import annotations

import resource

from artifact import (  # bench/artifact.py (this folder is on sys.path when run as a script)
    begin,
    cost_args,
    median,
    time_cells,
    write,
)

SCHEMES = ("w8a8", "a=int8/per_token; w=int4/per_group:64", "fp8-dynamic", "w4a4-rotated", "nvfp4", "llm-int8")  # W4A8 at
# group 64: SmolLM2's 576 inputs are no multiple of the named w4a8's 128


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    start = begin()
    a = cost_args(__doc__.splitlines()[0])

    from outlierscope.data.hellaswag import load_hellaswag
    from outlierscope.eval.evaluate import evaluate
    from outlierscope.models.loading import load_model
    from outlierscope.quant.specs.spec import QuantSpec

    lm = load_model(a.model)
    items = load_hellaswag()[: a.items]
    specs = {"unquantized": None, **{r: QuantSpec.parse(r) for r in SCHEMES}}
    evaluate(lm, quant=None, items=items, progress=False)  # the unquantized cell's peak, before any scheme ran
    rss_base = _peak_rss_mb()
    raw = time_cells(lm, specs, items, a.reps)
    base = median(raw["unquantized"])
    ratio = {name: round(median(t) / base, 3) for name, t in raw.items()}
    derived = {"median_s": {name: round(median(t), 2) for name, t in raw.items()}, "ratio_vs_unquantized": ratio,
               "w8a8_ratio": ratio["w8a8"], "goal_w8a8_ratio": 1.5,
               "peak_rss_mb_after_unquantized": round(rss_base, 1), "peak_rss_mb_after_all": round(_peak_rss_mb(), 1)}
    write("linear_cost", {"model": a.model, "items": len(items), "seconds": raw}, derived, start=start,
          notes="seconds per cell (evaluate on the items, start-up and model load excluded); median of the repetitions; "
          "ratio = scheme cell / the unquantized cell; peak RSS of the process (ru_maxrss)")


if __name__ == "__main__":
    main()
