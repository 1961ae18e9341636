"""What an attention recipe costs against the paper's logits cell (issue: low-bit attention as kernels do it).

One process, SmolLM2-135M, the first 100 HellaSwag validation items (lm-eval scoring, ``evaluate``): per repetition,
the paper's 4-bit per_tensor logits cell and then every recipe cell (the order interleaved, so a change of the
machine's load reaches all of them alike), after one warm-up of each on 8 items. Goal: every recipe cell <= 1.5x the
logits cell (median of the repetitions). Both kinds score each (context, choice) as its own sequence (a per_tensor
scale must not see the other choices), so the ratio is the cost of the emulation itself.
Writes bench/results/recipe_cost.json (see bench/artifact.py).
Usage: python bench/recipe_cost.py [--reps 3] [--items 100] [--model smollm2-135m]
"""

from __future__ import annotations

from artifact import (  # bench/artifact.py (this folder is on sys.path when run as a script)
    begin,
    cost_args,
    median,
    time_cells,
    write,
)

RECIPES = ("sage1", "sage2-int4", "fa3-fp8", "fa3-fp8-hadamard", "kivi-2bit", "kivi-4bit", "mxfp4-attn",
           "mxfp8-attn", "nvfp4-attn")


def main() -> None:
    start = begin()
    a = cost_args(__doc__.splitlines()[0])

    from outlierscope.data.hellaswag import load_hellaswag
    from outlierscope.models.loading import load_model
    from outlierscope.quant.specs.spec import QuantSpec, build_spec

    lm = load_model(a.model)
    items = load_hellaswag()[: a.items]
    specs = {"logits int4 per_tensor": build_spec(4, "int", "per_tensor", None),
             **{r: QuantSpec.parse(r) for r in RECIPES}}
    raw = time_cells(lm, specs, items, a.reps)
    base = median(raw["logits int4 per_tensor"])
    ratio = {name: round(median(t) / base, 3) for name, t in raw.items()}
    derived = {"median_s": {name: round(median(t), 2) for name, t in raw.items()}, "ratio_vs_logits": ratio,
               "max_ratio": max(v for k, v in ratio.items() if k in RECIPES), "goal_max_ratio": 1.5}
    write("recipe_cost", {"model": a.model, "items": len(items), "seconds": raw}, derived, start=start,
          notes="seconds per cell (evaluate on the items, start-up and model load excluded); median of the repetitions; "
          "ratio = recipe cell / the paper's 4-bit per_tensor logits cell")


if __name__ == "__main__":
    main()
