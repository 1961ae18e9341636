"""The specs bench/cost.py times, by family (imported by bench/cost.py and bench/tables.py; nothing else here)."""

LOGITS = ("logits-int8", "logits-int6", "logits-int4")
RECIPES = ("sage1", "sage2-int4", "fa3-fp8", "fa3-fp8-hadamard", "kivi-2bit", "kivi-4bit", "mxfp4-attn",
           "mxfp8-attn", "nvfp4-attn")
LINEAR = ("w8a8", "w8a8-restricted", "w8a8-sq", "w=fint4/per_group:64", "w=fint4/per_group:64; a=fint8/per_token",
          "w4a4", "w4a4-rotated", "fp8-dynamic", "mxfp4", "ct-mxfp4", "nvfp4", "llm-int8", "llm-int8-paper",
          "w=int4/per_group:64")  # W4A16 and W4A8 at group 64: SmolLM2's 576 inputs are no multiple of their 128
CALIBRATED = ("w=fint4/per_group:64; gptq:samples=16,seqlen=256", "w=fint4/per_group:64; awq:samples=8,seqlen=128,grid=4")
# few samples and ratios: the cells time the applied weights, not the calibration (cached in runs/bench-cost/)
BASE, OURS = "unquantized sdpa", "16-bit, our attention"
GOALS = {**{s: 1.6 for s in LOGITS}, **{s: 1.3 for s in (*RECIPES, *LINEAR, *CALIBRATED)}}
FAMILIES = {"the paper's logits at 8 / 6 / 4 bits": LOGITS, "attention recipes": RECIPES, "linear schemes": LINEAR,
            "GPTQ / AWQ weights, calibration excluded": CALIBRATED}
