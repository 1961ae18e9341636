"""GPT-QModel 7.6's own GPTQ on SmolLM2-135M's real layers: the reference tests/quant/test_gptq.py compares
outlierscope's ``gptq_quantize`` with bit for bit, on bfloat16-valued weights and real calibration activations.

Runs in GPT-QModel's venv (``make gptq-venv``), imports nothing of outlierscope. It

1. loads SmolLM2-135M (``--model``: the directory ``outlierscope models fetch smollm2-135m`` made; float32, its
   weights bfloat16 values) with transformers, and runs the calibration token ids ``--ids`` (a torch (N, T) int64
   file: outlierscope's own GPTQ calibration, 128 sequences of 512 tokens of LAMBADA's last passages, written by the
   command below) through it, keeping the input of q/k/v_proj (``input_layernorm``'s output) of each layer of
   ``--layers``;
2. rounds q/k/v_proj's weights to bfloat16 values (a bfloat16 checkpoint's; the GGUF-dequantized weights of the
   fetched model are not) after the inputs are recorded, and for each setting of ``SETTINGS`` and each of them builds GPT-QModel's ``GPTQ`` task on the linear
   (``quantizer.configure(perchannel=True)``, as its GPTQProcessor does), feeds it every sequence's input with
   ``add_batch`` (GPT-QModel's own Hessian accumulation) and runs its ``quantize(blocksize=128)``;
3. writes to ``--out`` (safetensors) each layer's Hessian as GPT-QModel finalized it (identical for q, k, v and
   every setting: checked), and in the metadata the sha256 of each result's quantized weight Q (float32, (out, in)),
   scales, zero points and g_idx, with the settings, versions and this command. Digests, not tensors: the
   fixture stays small (the Hessians are what the test cannot recompute bit for bit on another processor).

Usage:
    .venv/bin/python -c "import torch; from outlierscope.models.loading import load_model; \
from outlierscope.quant.gptq import GPTQConfig; from outlierscope.quant.sequential import calibration_sequences; \
lm = load_model('smollm2-135m'); torch.save(calibration_sequences(lm.tokenizer, None, GPTQConfig(), None), \
'/tmp/smollm2_calib_ids.pt')"
    GPTQMODEL_CPU_WORKERS=2 .venv-gptq/bin/python bench/gptq_smollm2_reference.py \
        --model ~/.cache/outlierscope/models/smollm2-135m --ids /tmp/smollm2_calib_ids.pt \
        --out tests/quant/fixtures/gptq_gptqmodel_smollm2.safetensors
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from importlib.metadata import version

# name -> QuantizeConfig arguments (damp 0.01 everywhere: outlierscope's default; GPT-QModel's own is 0.05)
SETTINGS = {
    "w4g64-sym-gar": dict(bits=4, group_size=64, sym=True, act_group_aware=True),
    "w4g64-sym": dict(bits=4, group_size=64, sym=True, act_group_aware=False),
    "w4g64-zp": dict(bits=4, group_size=64, sym=False, act_group_aware=False),
    "w4g64-sym-desc": dict(bits=4, group_size=64, sym=True, desc_act=True, act_group_aware=False),
    "w4g64-sym-static": dict(bits=4, group_size=64, sym=True, static_groups=True, act_group_aware=False),
    "w4g64-sym-desc-static": dict(bits=4, group_size=64, sym=True, desc_act=True, static_groups=True,
                                  act_group_aware=False),
    "w3g64-sym-gar": dict(bits=3, group_size=64, sym=True, act_group_aware=True),
    "w3g64-zp-desc": dict(bits=3, group_size=64, sym=False, desc_act=True, act_group_aware=False),
}
LINEARS = ("q_proj", "k_proj", "v_proj")


def sha(t) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def layer_inputs(model, ids, layers: list[int]) -> dict[int, list]:
    """Each sequence's q/k/v input (input_layernorm's output, (1, T, D)) of each layer of ``layers``."""
    import torch

    got = {i: [] for i in layers}
    hooks = [model.model.layers[i].input_layernorm.register_forward_hook(
        lambda m, a, out, i=i: got[i].append(out.detach().clone())) for i in layers]
    try:
        with torch.no_grad():
            for row in ids:
                model(input_ids=row[None], attention_mask=torch.ones_like(row[None]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return got


def run_gptq(linear, xs, args: dict):
    """GPT-QModel's GPTQ of ``linear`` on inputs ``xs``: (its finalized Hessian, Q, scale, zero, g_idx)."""
    import torch
    from gptqmodel import QuantizeConfig
    from gptqmodel.quantization.gptq import GPTQ

    with torch.no_grad():  # bfloat16 values, as a bfloat16 checkpoint holds (SmolLM2's GGUF-dequantized ones are not)
        linear.weight.copy_(linear.weight.to(torch.bfloat16).float())
    task = GPTQ(linear, QuantizeConfig(damp_percent=0.01, damp_auto_increment=0.0015, **args))
    task.quantizer.configure(perchannel=True)
    for x in xs:
        task.add_batch(x, None)
    task.finalize_hessian()
    h = task.H.clone()
    q, scale, zero, g_idx, _, _, damp, _ = task.quantize(blocksize=128)
    assert damp == 0.01, f"GPT-QModel raised the damping to {damp}: the Hessian was not positive definite"
    return h, q, scale, zero, g_idx


def main() -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="SmolLM2-135M's HF directory")
    ap.add_argument("--ids", required=True, help="the calibration token ids, a torch (N, T) int64 file")
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 15])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    ids = torch.load(a.ids)
    inputs = layer_inputs(model, ids, a.layers)
    tensors, digests = {}, {}
    for i in a.layers:
        attn = model.model.layers[i].self_attn
        for key, args in SETTINGS.items():
            for name in LINEARS:
                h, q, scale, zero, g_idx = run_gptq(getattr(attn, name), inputs[i], args)
                if f"layer{i}.hessian" not in tensors:
                    tensors[f"layer{i}.hessian"] = h.contiguous()
                assert torch.equal(tensors[f"layer{i}.hessian"], h), (i, key, name)  # one Hessian per layer
                digests[f"layer{i}.{name}.{key}"] = {"weight": sha(q.float()), "scale": sha(scale.float()),
                                                     "zero": sha(zero.float()), "g_idx": sha(g_idx.int())}
                print(f"layer {i} {name} {key}: done", flush=True)
    meta = {"command": " ".join(["bench/gptq_smollm2_reference.py", *sys.argv[1:]]),
            "versions": json.dumps({k: version(k) for k in ("gptqmodel", "torch", "transformers")}),
            "settings": json.dumps({"damp": 0.01, "block": 128, "quantize_config": SETTINGS}),
            "calibration": json.dumps({"shape": list(ids.shape), "ids_sha256": sha(ids)}),
            "digests": json.dumps(digests)}
    save_file(tensors, a.out, metadata=meta)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
