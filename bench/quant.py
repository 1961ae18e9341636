"""Quantization cost (issue: absmax PTQ of attention logits).

1. fake-quant throughput in GB/s (input bytes per second) for each granularity, vs a plain copy
   (``clone``) of the same logits tensor.
2. a forward pass with quantized attention (8-bit per_tensor) vs the same forward unquantized
   through eager and sdpa attention.

Goal: a quantized forward costs <= 1.5x the unquantized eager forward.
Usage: python bench/quant.py [--model pair-tiny:diff]
"""

from __future__ import annotations

import sys

# this folder holds profile.py, which would shadow the standard library's `profile` (imported by torch)
sys.path[:] = [x for x in sys.path if not x.rstrip("/").endswith("bench")]

import argparse
import json
import time

import torch


def timeit(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    from outlierscope.models.loading import load_model
    from outlierscope.quant.apply import quantize_attention
    from outlierscope.quant.spec import QuantSpec

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="pair-tiny:diff")
    a = p.parse_args()
    res = {"threads": torch.get_num_threads()}
    x = torch.randn(8, 6, 256, 256)  # (B, H, T, S): a pair-tiny batch of logits
    valid = torch.ones(256, 256, dtype=torch.bool).tril()[None, None]
    gb = x.numel() * 4 / 1e9
    res["copy_GBps"] = round(gb / timeit(lambda: x.clone()), 2)
    for gran in ("per_tensor", "per_head", "per_row"):
        spec = QuantSpec(bits=8, granularity=gran)
        res[f"fake_quant_{gran}_GBps"] = round(gb / timeit(lambda spec=spec: spec(x, valid)), 2)
    spec = QuantSpec(bits=8, granularity="per_row", backend="bitsandbytes")
    res["bitsandbytes_per_row_GBps"] = round(gb / timeit(lambda: spec(x, valid)), 2)

    lm = load_model(a.model)
    ids = torch.randint(0, lm.model.config.vocab_size, (8, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for impl in ("eager", "sdpa"):
            lm.model.set_attn_implementation(impl)
            res[f"forward_{impl}_s"] = round(timeit(lambda: lm.model(input_ids=ids, use_cache=False)), 4)
        lm.model.set_attn_implementation("eager")
        with quantize_attention(lm.model, QuantSpec(bits=8)):
            res["forward_quant8_per_tensor_s"] = round(timeit(lambda: lm.model(input_ids=ids, use_cache=False)), 4)
        with quantize_attention(lm.model, QuantSpec(bits=16)):
            res["forward_ours_unquantized_s"] = round(timeit(lambda: lm.model(input_ids=ids, use_cache=False)), 4)
    res["quant_vs_eager"] = round(res["forward_quant8_per_tensor_s"] / res["forward_eager_s"], 2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
