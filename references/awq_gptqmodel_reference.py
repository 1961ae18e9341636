"""GPT-QModel's own AWQ searches on a small model: the reference tests/quant/test_awq.py compares outlierscope's AWQ
primitives with (AutoAWQ's arithmetic, which GPT-QModel 7.6's ``AWQProcessor`` carries).

Runs in GPT-QModel's venv (``make gptq-venv``), imports nothing of outlierscope. On the float model of
tests/models/packed (a seeded random Llama, hidden 64, MLP 192; loaded in float64) it

1. records layer 0's MLP input and down_proj's input over 4 seeded random sequences of 32 tokens;
2. for the symmetric grids (4 bits, groups of 32; 3 bits, groups of 16) and the zero-point grid (4 bits, groups of
   32; AutoAWQ's default), calls GPT-QModel's own functions:
   ``_compute_awq_weight_mean`` and ``AWQProcessor._compute_best_scale`` for gate/up judged by the MLP's output and
   for down_proj judged by its own, with duo scaling and the 20-point grid, its previous-subset hint unset (in a whole
   run GPT-QModel multiplies ``w_mean`` by the mean |W| of the layer's previous subset, a rule of its own that
   AutoAWQ does not have: our scales are AutoAWQ's); ``AWQProcessor._compute_best_clip`` for
   gate/up/down on their inputs;
3. writes the inputs, the chosen scales, the losses and the clipping bounds to ``--out`` (safetensors), with the
   versions and this command in its metadata.

Why float64: ``_compute_best_scale`` keeps the original weights as ``weight.detach().to(torch.float32).cpu()``, which
for float32 weights on a CPU is the weight itself (no copy): each ratio then scales and rounds the weights the ratio
before left rounded, and the search ends with them rounded. In float64 that copy is real (float16 values: exact in
float32), and the search runs as on a GPU, in float64 arithmetic that outlierscope's float64 path repeats.

Usage: GPTQMODEL_CPU_WORKERS=2 .venv-gptq/bin/python references/awq_gptqmodel_reference.py \
           --out tests/quant/fixtures/awq_gptqmodel.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

FLOAT = Path(__file__).resolve().parents[1] / "tests" / "models" / "packed" / "float"
GRIDS = ((4, 32, True), (3, 16, True), (4, 32, False))  # (bits, group size, symmetric); False: AutoAWQ's zero point


def processor(bits: int, group: int, sym: bool):
    """An AWQProcessor with only what its scale and clip searches read (its constructor wants a whole run)."""
    from gptqmodel.looper.awq_processor import AWQProcessor

    p = object.__new__(AWQProcessor)
    p.qcfg = SimpleNamespace(bits=bits, group_size=group, sym=sym, scale_search_chunked_activations=True)
    p.duo_scaling = True
    p._scale_context = threading.local()
    p._scale_context.prev_scale = None
    p._quant_batch_size = None
    p.max_chunk_memory = 1024 * 1024 * 1024
    p._get_root_rotary = lambda: None
    p.gptq_model = SimpleNamespace()  # no awq_preserve_explicit_position_embeddings: a plain linear or MLP
    return p


def main() -> None:
    import torch
    from gptqmodel.looper.awq_processor import _compute_awq_weight_mean
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    a = argparse.ArgumentParser()
    a.add_argument("--out", required=True)
    args = a.parse_args()
    model = AutoModelForCausalLM.from_pretrained(FLOAT).to(torch.float64).eval()
    mlp = model.model.layers[0].mlp
    got = {}
    hooks = [mlp.register_forward_pre_hook(lambda m, x: got.setdefault("mlp", []).append(x[0])),
             mlp.down_proj.register_forward_pre_hook(lambda m, x: got.setdefault("down", []).append(x[0]))]
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _ in range(4):
            model(input_ids=torch.randint(1, 6144, (1, 32), generator=g))
    for h in hooks:
        h.remove()
    x_mlp, x_down = torch.cat(got["mlp"]), torch.cat(got["down"])  # (4, 32, 64), (4, 32, 192)
    out = {"x_mlp": x_mlp.contiguous(), "x_down": x_down.contiguous()}
    with torch.inference_mode():
        for bits, group, sym in GRIDS:
            p, key = processor(bits, group, sym), f"w{bits}g{group}" + ("" if sym else "zp")
            for tag, layers, judge, x in (("mlp", [mlp.gate_proj, mlp.up_proj], mlp, x_mlp),
                                          ("down", [mlp.down_proj], mlp.down_proj, x_down)):
                w_mean = _compute_awq_weight_mean(layers, group)
                flat = x.abs().view(-1, x.shape[-1])
                x_mean = (flat.to(torch.float32).sum(0) / flat.shape[0]).to(x.dtype)  # _search_best_scale's step 2
                ref = [judge(x)]
                scales, loss = p._compute_best_scale(x, w_mean, x_mean, judge, layers, ref, {})
                out[f"{key}.{tag}.scale"] = scales.contiguous()
                out[f"{key}.{tag}.loss"] = torch.tensor([loss], dtype=torch.float64)
            for name, x in (("gate_proj", x_mlp), ("up_proj", x_mlp), ("down_proj", x_down)):
                w = getattr(mlp, name).weight.detach()
                out[f"{key}.{name}.clip"] = p._compute_best_clip(w, x).reshape(w.shape[0], -1).contiguous()
    meta = {"command": " ".join(["references/awq_gptqmodel_reference.py", *sys.argv[1:]]),
            "versions": json.dumps({k: version(k) for k in ("gptqmodel", "torch", "transformers")}),
            "settings": json.dumps({"dtype": "float64", "grids": GRIDS, "duo_scaling": True, "n_grid": 20, "sequences": "4 x 32, seed 2"})}
    save_file(out, args.out, metadata=meta)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
