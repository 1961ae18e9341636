"""llm-compressor's own GPTQ on a small model: the reference tests/quant/test_gptq.py compares outlierscope's GPTQ with.

Runs in llm-compressor's venv (``make llmc-venv``: llmcompressor 0.14 with compressed-tensors 0.19), imports nothing
of outlierscope. On the float model of tests/models/packed (a seeded random Llama, hidden 64, loaded in bfloat16 as
GPT-QModel loads it on a CPU) it

1. accumulates layer 0's input Hessian over 16 seeded random sequences of 64 tokens with llm-compressor's own
   ``accumulate_hessian`` (divided by the sample count as its ``prepare_batch`` does);
2. computes each of q/k/v_proj's group scales with compressed-tensors' ``calculate_qparams`` on the weight's group
   minima and maxima (what GPTQModifier's min-max observer gives it: static scales, before any update);
3. runs llm-compressor's ``quantize_weight`` (eager backend) for 4-bit symmetric int groups of 16, block size 32,
   damping 0.01, without and with ``actorder="weight"``;
4. writes the Hessian, the scales and the quantized weights (float32) to ``--out`` (a safetensors file), with the
   versions and this command in its metadata.

Usage: .venv-llmc/bin/python references/gptq_llmc_reference.py --out tests/quant/fixtures/gptq_llmc.safetensors
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version
from pathlib import Path

FLOAT = Path(__file__).resolve().parents[1] / "tests" / "models" / "packed" / "float"
GROUP, BITS, BLOCK, DAMP = 16, 4, 32, 0.01


def main() -> None:
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian, make_empty_hessian
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    model = AutoModelForCausalLM.from_pretrained(FLOAT).to(torch.bfloat16).eval()
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    h, n = make_empty_hessian(attn.q_proj), torch.zeros((), dtype=torch.long)
    for ids in [torch.randint(1, 6144, (1, 64), generator=g) for _ in range(16)]:
        with torch.no_grad():
            x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))  # (1, 64, 64)
        h, n = accumulate_hessian(x, attn.q_proj, h, n)
    h = h / n
    out = {"hessian": h.contiguous()}
    for actorder in (None, "weight"):
        args = QuantizationArgs(num_bits=BITS, type="int", symmetric=True, strategy="group", group_size=GROUP,
                                actorder=actorder)
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(attn, name).weight.float()  # (out, in)
            grouped = w.reshape(w.shape[0], -1, GROUP)  # (out, groups, G)
            scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)  # (out, groups)
            q, _, fallback = quantize_weight(w[None].clone(), h[None].clone(), scale[None], zp[None], None, args,
                                             blocksize=BLOCK, percdamp=DAMP)
            assert not fallback.any()
            tag = f"{name}.{actorder or 'none'}"
            out[f"{tag}.weight"] = q[0].float().contiguous()
            out[f"{tag}.scale"] = scale.float().contiguous()
    meta = {"command": " ".join(["references/gptq_llmc_reference.py", *sys.argv[1:]]),
            "versions": json.dumps({k: version(k) for k in ("llmcompressor", "compressed-tensors", "torch",
                                                             "transformers")}),
            "settings": json.dumps({"bits": BITS, "group": GROUP, "block": BLOCK, "damp": DAMP})}
    save_file(out, a.out, metadata=meta)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
