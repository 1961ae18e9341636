"""Quantization cost (issue: absmax PTQ of attention logits).

1. fake-quant throughput in GB/s (input bytes per second) for each granularity, vs a plain copy
   (``clone``) of the same logits tensor.
2. a forward pass with quantized attention (8-bit per_tensor) vs the same forward unquantized
   through eager and sdpa attention.

Goal: a quantized forward costs <= 1.5x the unquantized eager forward.
Every timing is 5 runs after a warm-up (the median is quoted); writes bench/results/quant.json.
Usage: python bench/quant.py [--model pair-tiny:diff]
"""

from __future__ import annotations

import argparse

import torch
from artifact import begin, median, repeat, write  # bench/artifact.py (this folder is on sys.path when run as a script)


def main() -> None:
    start = begin()
    from outlierscope.models.loading import load_model
    from outlierscope.quant.apply import quantize_model
    from outlierscope.quant.attention.logits import logits_quant
    from outlierscope.quant.specs.spec import QuantSpec

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="pair-tiny:diff")
    a = p.parse_args()
    raw = {"model": a.model, "logits_shape": [8, 6, 256, 256]}
    x = torch.randn(8, 6, 256, 256)  # (B, H, T, S): a pair-tiny batch of logits
    valid = torch.ones(256, 256, dtype=torch.bool).tril()[None, None]
    raw["copy_s"] = repeat(lambda: x.clone(), 5)
    for gran in ("per_tensor", "per_head", "per_row"):
        spec = logits_quant(QuantSpec.logits(bits=8, granularity=gran))
        raw[f"fake_quant_{gran}_s"] = repeat(lambda spec=spec: spec(x, valid), 5)
    spec = logits_quant(QuantSpec.logits(bits=8, granularity="per_row", backend="bitsandbytes"))
    raw["bitsandbytes_per_row_s"] = repeat(lambda: spec(x, valid), 5)

    lm = load_model(a.model)
    ids = torch.randint(0, lm.model.config.vocab_size, (8, 256), generator=torch.Generator().manual_seed(0))
    run = lambda: lm.model(input_ids=ids, use_cache=False)  # noqa: E731
    with torch.no_grad():
        for impl in ("eager", "sdpa"):
            lm.model.set_attn_implementation(impl)
            raw[f"forward_{impl}_s"] = repeat(run, 5)
        lm.model.set_attn_implementation("eager")
        with quantize_model(lm.model, QuantSpec.logits(bits=16)):
            raw["forward_ours_unquantized_s"] = repeat(run, 5)
        with quantize_model(lm.model, QuantSpec.logits(bits=8)):
            raw["forward_quant8_per_tensor_s"] = repeat(run, 5)
    gb = x.numel() * 4 / 1e9
    derived = {k.removesuffix("_s") + "_GBps": round(gb / median(raw[k]), 2)
               for k in ("copy_s", "fake_quant_per_tensor_s", "fake_quant_per_head_s", "fake_quant_per_row_s",
                         "bitsandbytes_per_row_s")}
    derived.update({k.removesuffix("_s") + "_ms": round(1000 * median(raw[k]), 1)
                    for k in ("forward_eager_s", "forward_sdpa_s", "forward_ours_unquantized_s", "forward_quant8_per_tensor_s")})
    derived["quant_vs_eager"] = round(median(raw["forward_quant8_per_tensor_s"]) / median(raw["forward_eager_s"]), 2)
    write("quant", raw, derived, start=start, notes="GB/s = input bytes of the fp32 logits tensor per second; forwards: batch 8 x 256")


if __name__ == "__main__":
    main()
