"""How many NVFP4 blocks the hardware's subnormal E4M3 block scales change (issue #37).

NVIDIA's conversion keeps E4M3 subnormal block scales (down to 2^-9) and zeroes a block whose scale rounds to zero;
torchao (and outlierscope before #37) clamped the scale up to 2^-6. The two differ exactly in the blocks of nonzero
values whose scale is below 2^-6. This bench counts them in what the ``nvfp4-attn`` recipe quantizes (q and k along
head_dim, v along the tokens, P along the keys; the per-tensor scale per sequence), on SmolLM2-135M scoring seeded
HellaSwag items as ``evaluate`` does: an observing stage entered before the recipe sees each tensor as the recipe
gets it. Writes bench/results/nvfp4_scales.json (see bench/artifact.py).
Usage: python bench/nvfp4_scales.py [--items 50] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse

from artifact import begin, write  # bench/artifact.py (this folder is on sys.path when run as a script)


class BlockCounter:
    """Per target: NVFP4 blocks holding a nonzero value, those whose E4M3 scale is subnormal (kept now, clamped to
    2^-6 before) and those whose scale rounds to zero (zeroed now)."""

    def __init__(self):
        self.counts = {t: {"blocks": 0, "subnormal_scale": 0, "zero_scale": 0} for t in ("q", "k", "v", "probs")}

    def add(self, target: str, x, valid) -> None:
        """``x`` (B, ..., n) with the blocks along its last dim, ``valid`` broadcastable to it; per-sequence amax."""
        from outlierscope.quant.attention.ops import _pad_to
        from outlierscope.quant.numerics.formats import NVFP4_BLOCK, nvfp4_scales

        w = _pad_to(x.float().masked_fill(~valid, 0), -1, NVFP4_BLOCK)  # whole blocks
        amax = w.abs().amax(tuple(range(1, w.dim())))  # (B,): NVFP4's per-tensor scale, per sequence
        _, s = nvfp4_scales(w, amax.view(-1, *[1] * (w.dim() - 2)))  # (B, ..., n_blocks, 1)
        real = w.reshape(*w.shape[:-1], -1, NVFP4_BLOCK).abs().amax(-1, keepdim=True) > 0  # (B, ..., n_blocks, 1)
        c = self.counts[target]
        c["blocks"] += int(real.sum())
        c["subnormal_scale"] += int((real & (s > 0) & (s < 2**-6)).sum())
        c["zero_scale"] += int((real & (s == 0)).sum())

    def stage(self):
        """An observing stage: q/k/v as the recipe gets them, and P before its quantization."""
        from outlierscope.hooks.attention import QKV, Stage

        def qkv(ctx, q, k, v):
            if not ctx.second:
                self.add("q", q, ctx.q_valid[:, None, :, None])  # (B, H, T, d): blocks along head_dim
                self.add("k", k, ctx.k_valid[:, None, :, None])
                self.add("v", v.transpose(2, 3), ctx.k_valid[:, None, None, :])  # (B, KV, d, S): along the tokens
            return QKV(q, k, v)

        def probs(ctx, p):
            self.add("probs", p, ctx.valid.expand_as(p))  # (B, H, t, S): along the keys (right padding: from key 0)
            return p

        return Stage(apply=lambda ctx, logits: logits, name="count NVFP4 blocks", qkv=qkv, probs=probs)


def main() -> None:
    start = begin()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=50)
    ap.add_argument("--model", default="smollm2-135m")
    a = ap.parse_args()

    from outlierscope.eval.evaluate import evaluate, select_items
    from outlierscope.hooks.attention import attention_stages
    from outlierscope.models.loading import load_model
    from outlierscope.quant.specs.spec import QuantSpec

    lm = load_model(a.model)
    items = select_items(sample=500, seed=0)[: a.items]  # the first of docs/recipes' 500 seeded items
    counter = BlockCounter()
    with attention_stages(lm.model, counter.stage()):
        res = evaluate(lm, quant=QuantSpec.parse("nvfp4-attn"), items=items, progress=False)
    derived = {t: {**c, "changed_share": round((c["subnormal_scale"] + c["zero_scale"]) / max(c["blocks"], 1), 6)}
               for t, c in counter.counts.items()}
    write("nvfp4_scales", {"counts": counter.counts, "acc_norm": res.metrics["acc_norm"]}, derived, start,
          notes=f"{a.model}, the first {a.items} of the 500 HellaSwag items drawn with seed 0 (docs/recipes), one "
                "sequence per (context, choice), every layer; a block is changed by #37 when it holds a nonzero value "
                "and its E4M3 scale is below 2^-6 (subnormal: kept instead of clamped) or rounds to zero (zeroed)")


if __name__ == "__main__":
    main()
