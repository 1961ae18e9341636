"""llm-compressor's whole GPTQ run on a small model: the reference tests/quant/test_gptq_model.py compares
``gptq:...,sequential=layer`` with, layer after layer.

Runs in llm-compressor's venv (``make llmc-venv``: llmcompressor 0.14 with compressed-tensors 0.19), imports nothing
of outlierscope. On the float model of tests/models/packed (a seeded random Llama, hidden 64, two layers; float32)
``oneshot`` (the bundled pair's tokenizer of the same vocabulary as its processor; the data are token ids) with a
``GPTQModifier`` (4-bit symmetric int groups of 32, block 128, damping 0.01, lm_head ignored)
calibrates on 16 seeded random sequences of 64 tokens (the rows of ``seqs`` in the output, not shuffled, batch 1)
through its sequential pipeline: each decoder layer's Hessians from one pass through it, its linears quantized, the
next layer's inputs through the quantized layer. Two runs: without act order and with ``actorder="static"`` (its
default). Written to ``--out`` (safetensors): every linear's integer codes (``round(weight / scale)``, int8; the
weight llm-compressor left in place is ``codes x scale``, checked here), its group scales and g_idx (act order), the
calibration tokens, and the versions and this command in the metadata.

Usage: .venv-llmc/bin/python references/gptq_llmc_model.py --out tests/quant/fixtures/gptq_llmc_model.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version
from pathlib import Path

FLOAT = Path(__file__).resolve().parents[1] / "tests" / "models" / "packed" / "float"
TOKENIZER = Path(__file__).resolve().parents[1] / "outlierscope" / "pretrained" / "pair-tiny" / "transformer"  # 6144
BITS, GROUP, BLOCK, DAMP, N, T = 4, 32, 128, 0.01, 16, 64


def _run(seqs, actorder):
    """The float model after llm-compressor's GPTQ (``actorder``: None or "static")."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(FLOAT, dtype=torch.float32).eval()
    data = Dataset.from_dict({"input_ids": seqs.tolist(), "attention_mask": torch.ones_like(seqs).tolist()})
    weights = {"num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}
    recipe = GPTQModifier(targets="Linear", ignore=["lm_head"], block_size=BLOCK, dampening_frac=DAMP,
                          actorder=actorder, config_groups={"g": {"targets": ["Linear"], "weights": weights}})
    oneshot(model=model, processor=AutoTokenizer.from_pretrained(TOKENIZER), dataset=data, recipe=recipe, num_calibration_samples=len(seqs), max_seq_length=T,
            shuffle_calibration_samples=False, batch_size=1, pipeline="sequential")
    return model


def main() -> None:
    import torch
    from safetensors.torch import save_file

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    g = torch.Generator().manual_seed(1)
    seqs = torch.cat([torch.randint(1, 6144, (1, T), generator=g) for _ in range(N)])  # (N, T)
    out = {"seqs": seqs.contiguous()}
    for actorder in (None, "static"):
        model = _run(seqs, actorder)
        tag = actorder or "none"
        for name, m in model.named_modules():
            if not (isinstance(m, torch.nn.Linear) and ".layers." in name):
                continue
            scale = m.weight_scale.detach().float()  # (O, groups)
            g_idx = getattr(m, "weight_g_idx", None)
            g_idx = torch.arange(m.in_features) // GROUP if g_idx is None or (g_idx < 0).all() else g_idx.long()
            s = scale.gather(1, g_idx.expand(m.out_features, -1))  # (O, I)
            w = m.weight.detach().float()
            codes = torch.round(w / s)
            if not torch.equal(codes * s, w) or codes.abs().max() > 2 ** (BITS - 1):
                sys.exit(f"error: {name}'s weight is not codes x scale; llm-compressor changed how it stores GPTQ")
            out[f"{tag}.{name}.codes"] = codes.to(torch.int8).contiguous()
            out[f"{tag}.{name}.scale"] = scale.contiguous()
            out[f"{tag}.{name}.g_idx"] = g_idx.to(torch.int32).contiguous()
    meta = {"command": " ".join(["references/gptq_llmc_model.py", *sys.argv[1:]]),
            "versions": json.dumps({k: version(k) for k in ("llmcompressor", "compressed-tensors", "torch",
                                                             "transformers")}),
            "settings": json.dumps({"bits": BITS, "group": GROUP, "block": BLOCK, "damp": DAMP, "samples": N,
                                    "seqlen": T, "actorder": [None, "static"]})}
    save_file(out, a.out, metadata=meta)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
