"""GPT-QModel 7.6's own GPTQ on SmolLM2-135M's real layers: the reference tests/quant/test_gptq.py compares
outlierscope's ``gptq_quantize`` with bit for bit, on bfloat16-valued weights and real calibration activations.

Runs in GPT-QModel's venv (``make gptq-venv``), imports nothing of outlierscope. It

1. loads SmolLM2-135M (``--model``: the directory ``outlierscope models fetch smollm2-135m`` made; float32, its
   weights bfloat16 values) with transformers, and runs the calibration token ids ``--ids`` (a torch (N, T) int64
   file: outlierscope's own GPTQ calibration, 128 sequences of 512 tokens of LAMBADA's last passages, written by the
   command below) through it, keeping the input of q/k/v_proj (``input_layernorm``'s output) of each layer of
   ``--layers``, and of layer 0 also o_proj's and gate/up_proj's (``GROUPS``; down_proj's 1536 x 1536 Hessian has a
   fixture of its own, ``--down`` below);
2. rounds those linears' weights to bfloat16 values (a bfloat16 checkpoint's; the GGUF-dequantized weights of the
   fetched model are not) after the inputs are recorded, and for each setting of ``SETTINGS`` and each of them builds GPT-QModel's ``GPTQ`` task on the linear
   (``quantizer.configure(perchannel=True)``, as its GPTQProcessor does), feeds it every sequence's input with
   ``add_batch`` (GPT-QModel's own Hessian accumulation) and runs its ``quantize(blocksize=128)``;
3. writes to ``--out`` (safetensors) each input's Hessian as GPT-QModel finalized it (identical for the linears
   reading it and every setting: checked), and in the metadata the sha256 of each result's quantized weight Q (float32, (out, in)),
   scales, zero points and g_idx, with the settings, versions and this command. Digests, not tensors: the
   fixture stays small (the Hessians are what the test cannot recompute bit for bit on another processor).

Usage:
    .venv/bin/python -c "import torch; from outlierscope.models.loading import load_model; \
from outlierscope.quant.weights.gptq import GPTQConfig; from outlierscope.quant.weights.sequential import calibration_sequences; \
lm = load_model('smollm2-135m'); torch.save(calibration_sequences(lm.tokenizer, None, GPTQConfig(), None), \
'/tmp/smollm2_calib_ids.pt')"
    GPTQMODEL_CPU_WORKERS=2 .venv-gptq/bin/python references/gptq_smollm2_reference.py \
        --model ~/.cache/outlierscope/models/smollm2-135m --ids /tmp/smollm2_calib_ids.pt \
        --out tests/quant/fixtures/gptq_gptqmodel_smollm2.safetensors

``--down`` makes down_proj's fixture of layer 0 (``MLP_LAYERS``): GPT-QModel's Hessian accumulated from the same
calibration inputs (the gated product), stored as its upper triangle (4.7 MB; the matrix made symmetric from it is
what GPT-QModel quantizes with), and the digests of every setting with the processor that made them (an AMD EPYC):

    GPTQMODEL_CPU_WORKERS=2 .venv-gptq/bin/python references/gptq_smollm2_reference.py --down \
        --model ~/.cache/outlierscope/models/smollm2-135m --ids /tmp/smollm2_calib_ids.pt \
        --out tests/quant/fixtures/gptq_gptqmodel_smollm2_down.safetensors

The digests in the first fixture are of the processor that made it (an Intel Xeon); float32 Cholesky and matmuls round
otherwise on an AMD EPYC. ``--hessians`` makes GPT-QModel's results from the fixture's own Hessians on this machine's
processor, into a JSON the test reads when it runs on that processor:

    GPTQMODEL_CPU_WORKERS=2 .venv-gptq/bin/python references/gptq_smollm2_reference.py \
        --model ~/.cache/outlierscope/models/smollm2-135m --hessians tests/quant/fixtures/gptq_gptqmodel_smollm2.safetensors \
        --out tests/quant/fixtures/gptq_gptqmodel_smollm2.amd.json
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
GROUPS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
          "mlp": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}  # linears reading one input
# down_proj's (1536, 1536) Hessian (9.4 MB) has a fixture of its own (--down): its upper triangle (4.7 MB)
MLP_LAYERS = (0,)  # layers whose o_proj and gate/up are in the fixture too (each Hessian 1.3 MB)


def sha(t) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def layer_inputs(model, ids, layers: list[int]) -> dict[tuple[int, str], list]:
    """Each sequence's input (1, T, D) of each linear group of each layer of ``layers``: (layer, "qkv") the
    input_layernorm's output, and for the layers of ``MLP_LAYERS`` also (layer, "o") o_proj's input and (layer, "mlp")
    the post_attention_layernorm's output."""
    import torch

    got: dict[tuple[int, str], list] = {}
    hooks = []
    for i in layers:
        block = model.model.layers[i]
        hooks.append(block.input_layernorm.register_forward_hook(
            lambda m, a, out, i=i: got.setdefault((i, "qkv"), []).append(out.detach().clone())))
        if i in MLP_LAYERS:
            hooks.append(block.self_attn.o_proj.register_forward_pre_hook(
                lambda m, a, i=i: got.setdefault((i, "o"), []).append(a[0].detach().clone())))
            hooks.append(block.post_attention_layernorm.register_forward_hook(
                lambda m, a, out, i=i: got.setdefault((i, "mlp"), []).append(out.detach().clone())))
    try:
        with torch.no_grad():
            for row in ids:
                model(input_ids=row[None], attention_mask=torch.ones_like(row[None]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return got


def down_inputs(model, ids, layers: list[int]) -> dict[int, list]:
    """Each sequence's input (1, T, 1536) of down_proj (the gated product) of each layer of ``layers``; the forward
    stops after the last of them (the layers above it are not needed)."""
    import torch

    class Stop(Exception):
        pass

    def stop(mod, args):
        raise Stop

    got: dict[int, list] = {}
    hooks = [model.model.layers[i].mlp.down_proj.register_forward_pre_hook(
        lambda m, a, i=i: got.setdefault(i, []).append(a[0].detach().clone())) for i in layers]
    hooks.append(model.model.layers[max(layers)].mlp.down_proj.register_forward_hook(lambda m, a, out: stop(m, a)))
    try:
        with torch.no_grad():
            for row in ids:
                try:
                    model(input_ids=row[None], attention_mask=torch.ones_like(row[None]), use_cache=False)
                except Stop:
                    pass
    finally:
        for h in hooks:
            h.remove()
    return got


def symmetric_from_upper(h):
    """The symmetric matrix of ``h``'s upper triangle (diagonal included): float32 products of X^T X need not be
    bitwise symmetric; the fixture stores only the upper triangle, so the test and GPT-QModel get this matrix."""
    import torch

    return torch.triu(h) + torch.triu(h, 1).T


def upper_values(h):
    """The upper triangle (diagonal included) of a square ``h``, row by row: (n (n + 1) / 2,)."""
    import torch

    i, j = torch.triu_indices(h.shape[0], h.shape[1])
    return h[i, j].contiguous()


def from_upper_values(v, n: int):
    """The symmetric (n, n) matrix of :func:`upper_values`' ``v``."""
    import torch

    i, j = torch.triu_indices(n, n)
    h = torch.zeros(n, n, dtype=v.dtype)
    h[i, j] = v
    h[j, i] = v
    return h


def down_fixture(a) -> None:
    """``--down``: GPT-QModel's GPTQ of down_proj of each layer of ``MLP_LAYERS`` with the Hessian GPT-QModel
    accumulated from the calibration inputs, made symmetric from its upper triangle (stored, (n (n + 1) / 2,)), for
    every setting; the digests in the metadata with the processor that made them."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    ids = torch.load(a.ids)
    inputs = down_inputs(model, ids, list(MLP_LAYERS))
    tensors, digests = {}, {}
    for i, xs in inputs.items():
        linear = model.model.layers[i].mlp.down_proj
        h, *_ = run_gptq(linear, xs, SETTINGS["w4g64-sym"])  # GPT-QModel's accumulated Hessian
        sym = symmetric_from_upper(h)
        print(f"layer {i} down_proj: Hessian bitwise symmetric as accumulated: {bool(torch.equal(h, h.T))}", flush=True)
        tensors[f"layer{i}.down.hessian_upper"] = upper_values(sym)
        zeros = [torch.zeros(1, 512, sym.shape[0])] * len(xs)
        for key, args in SETTINGS.items():
            _, *result = run_gptq(linear, zeros, args, sym)
            digests[f"layer{i}.down_proj.{key}"] = result_digests(*result)
            print(f"layer {i} down_proj {key}: done", flush=True)
    meta = {"command": " ".join(["references/gptq_smollm2_reference.py", *sys.argv[1:]]), "processor": cpu_name(),
            "versions": json.dumps({k: version(k) for k in ("gptqmodel", "torch", "transformers")}),
            "settings": json.dumps({"damp": 0.01, "block": 128, "quantize_config": SETTINGS}),
            "calibration": json.dumps({"shape": list(ids.shape), "ids_sha256": sha(ids)}),
            "torch_threads": str(torch.get_num_threads()), "digests": json.dumps(digests)}
    save_file(tensors, a.out, metadata=meta)
    print(f"wrote {a.out}")


def run_gptq(linear, xs, args: dict, hessian=None):
    """GPT-QModel's GPTQ of ``linear`` on inputs ``xs``: (its finalized Hessian, Q, scale, zero, g_idx). With
    ``hessian`` (a fixture's), that Hessian replaces the one accumulated from ``xs`` before ``quantize``."""
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
    if hessian is not None:
        task.H = hessian.clone()
    h = task.H.clone()
    q, scale, zero, g_idx, _, _, damp, _ = task.quantize(blocksize=128)
    assert damp == 0.01, f"GPT-QModel raised the damping to {damp}: the Hessian was not positive definite"
    return h, q, scale, zero, g_idx


def result_digests(q, scale, zero, g_idx) -> dict:
    """sha256 of a GPTQ result's quantized weight (float32), scales, zero points and g_idx (int32)."""
    return {"weight": sha(q.float()), "scale": sha(scale.float()), "zero": sha(zero.float()), "g_idx": sha(g_idx.int())}


def cpu_name() -> str:
    from pathlib import Path

    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), "unknown")


def digests_on_this_processor(a) -> None:
    """``--hessians``: GPT-QModel's results from the fixture's own Hessians on this machine's processor (float32
    linear algebra rounds by processor), written as JSON with the processor's name, beside the fixture."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    fixture = safe_open(a.hessians, "pt")
    digests = {}
    for tag in sorted(fixture.keys()):  # layer{i}.{group}.hessian, or .hessian_upper (--down's)
        i, group = int(tag.split(".")[0].removeprefix("layer")), tag.split(".")[1]
        h = fixture.get_tensor(tag)
        if tag.endswith(".hessian_upper"):
            n = model.model.layers[i].get_submodule(GROUPS[group][0]).in_features
            h = from_upper_values(h, n)
        zeros = [torch.zeros(1, 512, h.shape[0])] * 128  # the calibration's sample count; the Hessian is h
        for key, args in SETTINGS.items():
            for name in GROUPS[group]:
                _, *result = run_gptq(model.model.layers[i].get_submodule(name), zeros, args, h)
                digests[f"layer{i}.{name.split('.')[-1]}.{key}"] = result_digests(*result)
                print(f"layer {i} {name} {key}: done", flush=True)
    import hashlib
    from pathlib import Path

    record = {"command": " ".join(["references/gptq_smollm2_reference.py", *sys.argv[1:]]), "processor": cpu_name(),
              "torch_threads": torch.get_num_threads(),  # float32 Cholesky and matmuls also round by thread count
              "fixture_sha256": hashlib.sha256(Path(a.hessians).read_bytes()).hexdigest(),
              "versions": {k: version(k) for k in ("gptqmodel", "torch", "transformers")}, "digests": digests}
    Path(a.out).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {a.out}")


def main() -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="SmolLM2-135M's HF directory")
    ap.add_argument("--ids", help="the calibration token ids, a torch (N, T) int64 file")
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 15])
    ap.add_argument("--hessians", help="a fixture this script wrote: GPT-QModel's results from its Hessians on this "
                    "processor, as JSON into --out (no calibration forward)")
    ap.add_argument("--down", action="store_true", help="down_proj's fixture (its Hessian's upper triangle and "
                    "the digests of this processor) into --out, from --ids")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.hessians:
        return digests_on_this_processor(a)
    if a.down:
        if not a.ids:
            ap.error("--down needs --ids")
        return down_fixture(a)
    if not a.ids:
        ap.error("--ids is required without --hessians")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    ids = torch.load(a.ids)
    inputs = layer_inputs(model, ids, a.layers)
    tensors, digests = {}, {}
    for (i, group), xs in inputs.items():
        block = model.model.layers[i]
        for key, args in SETTINGS.items():
            for name in GROUPS[group]:
                h, *result = run_gptq(block.get_submodule(name), xs, args)
                tag = f"layer{i}.{group}.hessian"
                tensors.setdefault(tag, h.contiguous())
                assert torch.equal(tensors[tag], h), (i, key, name)  # one Hessian per input
                digests[f"layer{i}.{name.split('.')[-1]}.{key}"] = result_digests(*result)
                print(f"layer {i} {name} {key}: done", flush=True)
    meta = {"command": " ".join(["references/gptq_smollm2_reference.py", *sys.argv[1:]]),
            "versions": json.dumps({k: version(k) for k in ("gptqmodel", "torch", "transformers")}),
            "settings": json.dumps({"damp": 0.01, "block": 128, "quantize_config": SETTINGS}),
            "calibration": json.dumps({"shape": list(ids.shape), "ids_sha256": sha(ids)}),
            "torch_threads": str(torch.get_num_threads()),  # float32 Cholesky and matmuls also round by thread count
            "digests": json.dumps(digests)}
    save_file(tensors, a.out, metadata=meta)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
