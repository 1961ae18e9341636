"""What a per-layer study on items (HellaSwag; sensitivity's default metric) costs with the unquantized prefix reused
and one cell at a time (#64: "a 30-layer per-layer study at about half today's forwards").

One process, a model, ``--items`` HellaSwag validation items drawn with seed 0: the one-layer cells ``SPEC; layers:i``
for i = 1 .. L - 1 (the cells sensitivity computes together; ``layers:0`` starts at the bottom either way) scored
one by one with ``evaluate`` (as sensitivity did before) and in one pass with ``evaluate_together`` (each batch's
unquantized trunk shared: a cell starts from the unquantized output of the layer below its own), interleaved, after
one warm-up of each; median of ``--reps``. Also the decoder layers run by each (counted by a pre-hook) and whether
both give the same bytes (every per-item score of every cell; a control: one by one twice). Goal: reused / one by
one <= 0.6. Writes bench/results/prefix_items_cost_<model>.json (see bench/artifact.py).
Usage: python bench/prefix_items_cost.py [--model smollm2-135m] [--spec w8a8] [--items 20] [--reps 3]
"""

from __future__ import annotations

import argparse

from artifact import begin, interleaved, median, write  # bench/artifact.py (on sys.path as a script)


def main() -> None:
    start = begin()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--spec", default="w8a8")
    ap.add_argument("--items", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()

    from outlierscope.eval.evaluate import evaluate, select_items
    from outlierscope.eval.together import evaluate_together
    from outlierscope.hooks.points import decoder_layers
    from outlierscope.models.loading import load_model
    from outlierscope.quant.specs.spec import QuantSpec

    lm = load_model(a.model)
    n_layers = len(decoder_layers(lm.model))
    items = select_items(sample=a.items, seed=0)
    specs = [QuantSpec.parse(f"{a.spec}; layers:{i}") for i in range(1, n_layers)]
    runs: list = []
    handles = [b.register_forward_pre_hook(lambda m, args: runs.append(1)) for b in decoder_layers(lm.model)]

    def cells(together: bool) -> list:
        if together:
            return evaluate_together(lm, specs=specs, items=items, progress=False)
        return [evaluate(lm, quant=spec, items=items, progress=False) for spec in specs]

    layers_run, values = {}, {}
    for name, together in (("reused", True), ("one_by_one", False)):  # warm-up, layers counted, values kept
        runs.clear()
        values[name] = cells(together)
        layers_run[name] = len(runs)
    values["one_by_one again"] = cells(False)

    def same(x: str, y: str) -> bool:
        return all(r.items.equals(s.items) for r, s in zip(values[x], values[y], strict=True))

    raw = interleaved({"reused": lambda: cells(True), "one_by_one": lambda: cells(False)}, a.reps, warmup=False)
    for h in handles:
        h.remove()
    derived = {"median_s": {k: median(v) for k, v in raw.items()},
               "ratio_reused_vs_one_by_one": round(median(raw["reused"]) / median(raw["one_by_one"]), 3),
               "goal_ratio": 0.6, "layers_run": layers_run, "same_bytes": same("reused", "one_by_one"),
               "control_same_bytes": same("one_by_one", "one_by_one again")}
    write(f"prefix_items_cost_{a.model.replace(':', '-')}",
          {"model": a.model, "spec": a.spec, "layers": n_layers, "cells": len(specs), "items": a.items,
           "seconds": raw}, derived, start=start,
          notes="seconds of every one-layer cell of layers 1..L-1 (the unquantized cell not included); layers_run: "
          "decoder-layer forwards of one such set; same_bytes: every per-item score of every cell equal; "
          "control_same_bytes: one by one twice, the same")


if __name__ == "__main__":
    main()
