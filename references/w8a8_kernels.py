"""outlierscope's ``w8a8`` emulation against real int8 kernels on a real model (issue #38's proof, not a timing).

SmolLM2-135M, HellaSwag, ``--sample`` items drawn with seed 0 (lm-eval scoring, ``evaluate``). Every decoder-layer
``nn.Linear`` (q/k/v/o, gate/up/down; the LM head stays float) quantized by:

- ``ours``: ``evaluate(quant="w8a8")``: int8 per-token activations and per-channel weights, absmax / 127, fake-quantized
  (dequantized codes multiplied in the model's float dtype);
- ``kernel_127``: each linear's output replaced (a forward hook, in a context manager) by torchao's integer kernel
  ``int_scaled_matmul`` (int8 x int8 with int32 accumulation, then the scales) on the codes of the same 127 grid,
  computed here from the layer's input and weight;
- ``torchao``: a float32 copy of the model under torchao's ``Int8DynamicActivationInt8WeightConfig`` (its own
  quantization: absmax / 127.5, codes -128..127, its int8 matmul);
- ``kernel_127_5``: the hook of ``kernel_127`` on the 127.5 grid (torchao's);
- ``unquantized``: the float model, for the size of what quantization itself moves.

Each in float32 (``_32``) and, for ours and the kernels, float64 (``_64``: the model in float64; the kernel's integer
sum is exact, its scales float64). In float64 the emulation and the kernel compute the same numbers up to float64
rounding, so their predictions must agree item by item. In float32 a quantized SmolLM2 is sensitive to the last bit:
a product rounded otherwise moves an activation across a rounding boundary of the int8 grid, and the next layers carry
the step on; the record shows float32 against float64 of the same emulation moving the scores as much as the
emulation against the kernel does. Writes references/results/w8a8_kernels.json (bench/artifact.py): per pair of scorings
the prediction differences (acc, acc_norm), the max and mean |change| of a choice's log-likelihood and, per differing
item, the margin in the first scoring between the two choices picked.
Usage: python references/w8a8_kernels.py [--sample 200] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # bench/artifact.py writes the record with the run's context
from artifact import begin, write  # noqa: E402

PAIRS = (("ours_64", "kernel_127_64"), ("ours_32", "kernel_127_32"), ("ours_32", "ours_64"),
         ("kernel_127_5_64", "kernel_127_5_32"), ("torchao_32", "kernel_127_5_32"), ("torchao_32", "kernel_127_5_64"),
         ("ours_32", "torchao_32"), ("unquantized_32", "ours_32"))


def _codes(t: torch.Tensor, grid: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, K) float -> int8 codes on the grid (scale = row absmax / grid) and the (rows, 1) scales, in t's dtype."""
    s = t.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(t.dtype).tiny) / grid  # (rows, 1)
    return torch.round(t / s).clamp(-128, 127).to(torch.int8), s


@contextlib.contextmanager
def int8_kernel_linears(model: nn.Module, grid: float):
    """Every decoder-layer linear computed by torchao's ``int_scaled_matmul`` on per-token / per-channel codes."""
    from torchao.kernel.intmm import int_scaled_matmul

    def hook(mod, args, out):
        x = args[0]
        xq, xs = _codes(x.reshape(-1, x.shape[-1]), grid)  # (M, K), (M, 1) in the model's dtype
        wq, ws = mod._w8  # (N, K), (1, N)
        y = int_scaled_matmul(xq, wq.T.contiguous(), xs.contiguous()) * ws  # (M, N)
        y = y + mod.bias if mod.bias is not None else y
        return y.reshape(*x.shape[:-1], -1).to(out.dtype)  # (..., N)

    handles, mods = [], [m for m in model.model.layers.modules() if isinstance(m, nn.Linear)]
    try:
        for m in mods:
            wq, ws = _codes(m.weight.detach(), grid)
            m._w8 = (wq, ws.reshape(1, -1))
            handles.append(m.register_forward_hook(hook))
        yield model
    finally:
        for h in handles:
            h.remove()
        for m in mods:
            m.__dict__.pop("_w8", None)


def _torchao_copy(model: nn.Module) -> nn.Module:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    ref = copy.deepcopy(model)
    quantize_(ref, Int8DynamicActivationInt8WeightConfig(),
              filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn.startswith("model.layers."))
    return ref


def _differences(a, b, chars: np.ndarray) -> dict:
    """Prediction differences of scoring ``b`` against ``a`` and, per differing item, the margin in ``a`` between
    the two choices the scorings picked (log-likelihood, per character of the choice for acc_norm as lm-eval; a
    near-tie is a margin near float32 rounding). ``chars``: (items, choices) each continuation's length."""
    cols = a.score_columns
    sa, sb = a.items[cols].to_numpy(), b.items[cols].to_numpy()  # (items, choices) summed log-likelihoods
    out = {"max_abs_loglik_change": float(np.abs(sa - sb).max()), "mean_abs_loglik_change": float(np.abs(sa - sb).mean())}
    for metric, col in (("acc", "pred"), ("acc_norm", "pred_norm")):
        pa, pb = a.items[col].to_numpy(), b.items[col].to_numpy()
        idx = np.flatnonzero(pa != pb)
        norm = sa / chars if metric == "acc_norm" else sa
        out[metric] = {"differing": int(len(idx)), "items": [
            {"index": int(a.items["index"].iloc[i]), "choices": [int(pa[i]), int(pb[i])],
             "margin_in_reference": float(abs(norm[i, pa[i]] - norm[i, pb[i]]))} for i in idx]}
    return out


def main() -> None:
    start = begin()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample", type=int, default=200)
    ap.add_argument("--model", default="smollm2-135m")
    a = ap.parse_args()

    from outlierscope.eval.evaluate import evaluate, select_items
    from outlierscope.models.loading import load_model

    torch.manual_seed(0)
    lm = load_model(a.model)
    items = select_items(sample=a.sample, seed=0)
    run = lambda model, quant=None: evaluate(model, lm.tokenizer, quant=quant, items=items, progress=False)  # noqa: E731
    res = {"unquantized_32": run(lm.model), "ours_32": run(lm.model, "w8a8"), "torchao_32": run(_torchao_copy(lm.model))}
    for dtype, tag in ((torch.float32, "32"), (torch.float64, "64")):
        lm.model.to(dtype)
        if tag == "64":
            res["ours_64"] = run(lm.model, "w8a8")
        for grid, name in ((127.0, "kernel_127"), (127.5, "kernel_127_5")):
            with torch.no_grad(), int8_kernel_linears(lm.model, grid):
                res[f"{name}_{tag}"] = run(lm.model)
    chars = np.array([it.doc().choice_chars for it in items], dtype=np.float64)  # (items, 4) lm-eval's acc_norm lengths
    pairs = {f"{x}_vs_{y}": _differences(res[x], res[y], chars) for x, y in PAIRS}
    for k, v in pairs.items():
        print(k, {m: v[m]["differing"] for m in ("acc", "acc_norm")}, f"max |dLL| {v['max_abs_loglik_change']:.3g}",
              f"mean {v['mean_abs_loglik_change']:.3g}", flush=True)
    derived = {"metrics": {k: {m: round(r.metrics[m], 4) for m in ("acc", "acc_norm")} for k, r in res.items()},
               **{k: {m: v[m]["differing"] for m in ("acc", "acc_norm")} for k, v in pairs.items()}}
    write("w8a8_kernels", {"model": a.model, "items": len(items), "sample_seed": 0, "pairs": pairs}, derived,
          start=start, notes="a comparison, not a timing: one run; each scoring is deterministic on a given machine",
          folder=ROOT / "references" / "results")


if __name__ == "__main__":
    main()
