"""GPTQ and AWQ checkpoints made by GPT-QModel itself, with GPT-QModel's own dequantized weights and forward: the
reference the tests of outlierscope's packed-weight loader compare against (tests/models/test_packed_checkpoints.py).

Runs in GPT-QModel's own venv (``make gptq-venv``: gptqmodel 7.6.0 + optimum 2.3.0; gptqmodel 7.7 wants torch >=
2.14), imports nothing of outlierscope. For each variant (``VARIANTS``) it

1. builds a small random Llama (seeded; hidden 64, MLP 192, two layers, the bundled pair's 6144-token vocabulary)
   and quantizes it on the CPU with GPT-QModel (GPTQ: its Hessian error correction; AWQ: its activation-aware
   scales; calibration: 16 seeded random sequences of 64 tokens);
2. saves the checkpoint as GPT-QModel writes it (config.json + model.safetensors; the tokenizer is not kept: the
   tests add the bundled pair's);
3. writes ``reference.safetensors`` beside it: every quantized linear's weight as GPT-QModel's portable torch kernel
   dequantizes it (``TorchLinear.dequantize_weight`` for GPTQ, ``dequantize_gemm`` for AWQ; loaded in float16,
   the scales' dtype; (out, in)), and
   the last hidden state of two seeded sequences as transformers' own loader runs the checkpoint on this CPU (the
   kernels gptqmodel picks there), with the token ids;
4. writes ``fixture.json`` (variant, versions, kernels, command);
5. keeps the float model they were all made from (float16 weights) as ``float/`` (no tokenizer): compare-quant's
   emulation runs on it.

Usage: .venv-gptq/bin/python references/gptq_fixtures.py --out tests/models/packed
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

TOKENIZER = Path(__file__).resolve().parents[1] / "outlierscope" / "pretrained" / "pair-tiny" / "transformer"
# name -> QuantizeConfig arguments (and the backend that packs it on a CPU)
VARIANTS = {
    "gptq-w4g32-asym-actorder": dict(bits=4, group_size=32, sym=False, desc_act=True, act_group_aware=False),
    "gptq-w3g32-sym": dict(bits=3, group_size=32, sym=True, desc_act=False),
    "gptq-w8g64-sym": dict(bits=8, group_size=64, sym=True, desc_act=False),
    "awq-w4g32-zp": dict(bits=4, group_size=32, sym=False, quant_method="awq", format="gemm"),
}


def float_model(out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=16, vocab_size=6144, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().half().save_pretrained(out)  # float16: half the bytes of the kept float model
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(out)
    return out


def quantize(src: Path, out: Path, args: dict) -> None:
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.utils.backend import BACKEND

    g = torch.Generator().manual_seed(1)
    calib = [{"input_ids": torch.randint(1, 6144, (1, 64), generator=g), "attention_mask": torch.ones(1, 64, dtype=torch.long)}
             for _ in range(16)]
    backend = BACKEND.AWQ_TORCH if args.get("quant_method") == "awq" else BACKEND.AUTO  # AWQ's default: CUDA only
    model = GPTQModel.load(str(src), QuantizeConfig(**args), device="cpu", backend=backend)
    model.quantize(calib, batch_size=1, backend=backend)
    model.save(str(out))
    for f in out.iterdir():  # the tests add the bundled pair's tokenizer; GPT-QModel's quant log is not needed
        if f.name not in ("config.json", "model.safetensors", "quantize_config.json"):
            f.unlink()


def dequantized_weights(path: Path, awq: bool) -> tuple[dict, str]:
    """Every quantized linear's float16 weight (out, in) as GPT-QModel's portable torch kernel dequantizes it."""
    import torch
    from gptqmodel import GPTQModel
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
    from gptqmodel.utils.backend import BACKEND

    # float16: the scales' own dtype (GPT-QModel's default, bfloat16, would round the scales first)
    model = GPTQModel.load(str(path), device="cpu", backend=BACKEND.AWQ_TORCH if awq else BACKEND.TORCH,
                           dtype=torch.float16)
    out, kernels = {}, set()
    for name, m in model.model.named_modules():
        if hasattr(m, "qweight"):
            kernels.add(type(m).__name__)
            w = (dequantize_gemm(m.qweight, m.qzeros, m.scales, m.bits, m.group_size) if awq
                 else m.dequantize_weight())  # (in, out)
            out[f"weight.{name}"] = w.t().contiguous().to("cpu").half()  # (out, in)
    return out, ",".join(sorted(kernels))


def reference_forward(path: Path) -> tuple[dict, str]:
    """The last hidden state of two seeded sequences, as transformers' own loader runs the checkpoint here."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(1, 6144, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1]  # (B, T, D), after the final norm
    kernel = type(model.model.layers[0].self_attn.q_proj).__name__
    return {"input_ids": ids, "last_hidden": hidden.contiguous()}, kernel


def main() -> None:
    # GPT-QModel's default CPU pool, (cores + 1) // 2 workers, is smaller than the 2 its model loader asks for on a
    # 2-core machine (ValueError); the environment variable is its own override
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, ((os.cpu_count() or 1) + 1) // 2)))
    from importlib.metadata import version

    import gptqmodel
    import torch
    import transformers
    from safetensors.torch import save_file

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="one directory per variant is written under it")
    ap.add_argument("--only", action="append", choices=tuple(VARIANTS), help="these variants only (repeat)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = float_model(Path(tmp) / "float")
        keep = Path(a.out) / "float"
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(src, keep, ignore=shutil.ignore_patterns("tokenizer*"))
        for name in a.only or VARIANTS:
            args, dest = VARIANTS[name], Path(a.out) / name
            shutil.rmtree(dest, ignore_errors=True)
            quantize(src, dest, args)
            with tempfile.TemporaryDirectory() as t:  # transformers needs the tokenizer beside the weights
                ckpt = Path(shutil.copytree(dest, Path(t) / "ckpt"))
                for f in ("tokenizer.json", "tokenizer_config.json"):
                    shutil.copy(src / f, ckpt / f)
                weights, kernels = dequantized_weights(ckpt, args.get("quant_method") == "awq")
                forward, forward_kernel = reference_forward(ckpt)
            save_file({**weights, **forward}, str(dest / "reference.safetensors"))
            record = {"variant": name, "quantize_config": args, "dequantized_by": kernels,
                      "forward_by": f"transformers.AutoModelForCausalLM ({forward_kernel}), float32 activations",
                      "versions": {"gptqmodel": gptqmodel.__version__, "optimum": version("optimum"),
                                   "transformers": transformers.__version__, "torch": torch.__version__},
                      "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
                      "command": f"references/gptq_fixtures.py --out {a.out} --only {name}"}
            (dest / "fixture.json").write_text(json.dumps(record, indent=2) + "\n")
            print(json.dumps(record))


if __name__ == "__main__":
    main()
