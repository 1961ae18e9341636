"""The named recipes: what low-bit attention kernels, KV caches and linear-layer schemes quantize, as the text of a
``QuantSpec`` (``QuantSpec.parse(name)``), with the source each follows and what the
emulation does not model. Data only: the spec type and its parser are ``outlierscope.quant.specs.spec``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    """A named kernel emulation.

    Attributes:
        name: its name (``sage2-int4``, ...).
        text: its spec text.
        source: the source it follows.
        not_modelled: what the emulation does not model."""

    name: str
    text: str
    source: str
    not_modelled: str


_SAGE = "sageattention/triton/quant_per_block.py (BLKQ=128, BLKK=64)"
RECIPES = {r.name: r for r in (
    Recipe("sage1", "q=int8/per_block:128; k=int8/per_block:64; smooth_k",
           f"SageAttention (arXiv 2410.02367) sec. 3-4; {_SAGE}",
           "INT8 rounds half to even here (the kernel: half away from zero); P.V's FP16 accumulator"),
    Recipe("sage2-int4", "q=int4/per_block:4; k=int4/per_block:16; smooth_k; smooth_q:128; probs=e4m3/static; "
           "v=e4m3/per_channel", "SageAttention2 (arXiv 2411.10958) sec. 3; sageattention/triton/quant_per_thread.py",
           "per-thread groups are strided rows (Q: every 8th row of 32, K: pairs in 64); here contiguous blocks of "
           "the same size (4 and 16 rows); FP8 accumulation of P.V and its two-level fix"),
    Recipe("fa3-fp8", "q=e4m3/per_block:128; k=e4m3/per_block:128; v=e4m3/per_block:128",
           "FlashAttention-3 (arXiv 2407.08608) sec. 3.3, block quantization", "P's FP8 conversion inside the kernel; "
           "the FP32 accumulators"),
    Recipe("fa3-fp8-hadamard", "q=e4m3/per_block:128; k=e4m3/per_block:128; v=e4m3/per_block:128; hadamard:0",
           "FlashAttention-3 sec. 3.3, block quantization with incoherent processing (random-sign Hadamard)",
           "the rotation is one seeded random-sign Hadamard matrix per run (the paper: per head)"),
    Recipe("kivi-2bit", "k=asym2/per_channel:32; v=asym2/per_group:32",
           "KIVI (arXiv 2402.02750) sec. 3: K per channel, V per token, groups of 32",
           "the full-precision window of recent tokens (residual length R); the cache's streaming group fill"),
    Recipe("kivi-4bit", "k=asym4/per_channel:32; v=asym4/per_group:32", "KIVI (arXiv 2402.02750), 4 bits",
           "the full-precision window of recent tokens (residual length R)"),
    Recipe("mxfp4-attn", "q=mxfp4; k=mxfp4; probs=mxfp4; v=mxfp4",
           "OCP Microscaling Formats (MX) v1.0 sec. 5-6: 32-element blocks, E8M0 scales, FP4 E2M1 elements",
           "the matmuls' accumulation precision"),
    Recipe("mxfp8-attn", "q=mxfp8_e4m3; k=mxfp8_e4m3; probs=mxfp8_e4m3; v=mxfp8_e4m3", "OCP MX v1.0, MXFP8 E4M3",
           "the matmuls' accumulation precision"),
    Recipe("nvfp4-attn", "q=nvfp4; k=nvfp4; probs=nvfp4; v=nvfp4",
           "NVIDIA NVFP4 (16-element blocks, E4M3 block scales, FP32 per-tensor scale; per sequence here)",
           "the matmuls' accumulation precision"),
    *(Recipe(f"logits-int{b}", f"logits=int{b}/per_tensor", "Diff Transformer (arXiv 2410.05258) Figure 8",
             "nothing: it is the paper's post-hoc quantization of the logits") for b in (8, 6, 4)),
    # linear layers: weights RTN (no GPTQ/AWQ), activations dynamic unless said
    Recipe("w8a8", "w=fint8/per_channel; a=fint8/per_token",
           "llm-compressor / compressed-tensors W8A8 (INT8 channel weights, dynamic per-token activations, the "
           "full-range grid: absmax / 127.5 onto [-128, 127]); torchao Int8DynamicActivationInt8WeightConfig's grid",
           "the int32 accumulation (here float32 sums of the dequantized values); GPTQ's weight rounding (RTN here); "
           "torchao multiplies by the scale's reciprocal where compressed-tensors and we divide (codes differ at "
           "exact ties: ~0.02% of values)"),
    Recipe("w8a8-restricted", "w=int8/per_channel; a=int8/per_token",
           "W8A8 on the restricted grid (absmax / 127 onto [-127, 127]): SmoothQuant's fake quantization, "
           "bitsandbytes' int8 vectors, vLLM's dynamic per-token INT8 activation kernel",
           "the int32 accumulation (here float32 sums of the dequantized values); GPTQ's weight rounding (RTN here); "
           "not llm-compressor's W8A8 (its grid is w8a8's)"),
    Recipe("w8a8-sq", "w=int8/per_channel; a=int8/per_token; smooth:0.5",
           "SmoothQuant (arXiv 2211.10438) sec. 4, alpha 0.5, on its own restricted INT8 grid (absmax / 127); "
           "llm-compressor's SmoothQuantModifier + W8A8 is 'w8a8; smooth:0.5' (the full-range grid)",
           "the scales are applied to the linear's input, not folded into the norm (same values); calibration text "
           "and size (calib:, 8 x 512 tokens)"),
    Recipe("w4a16", "w=fint4/per_group:128", "llm-compressor / compressed-tensors W4A16 (symmetric INT4 on the "
           "full-range grid: absmax / 7.5 onto [-8, 7], groups of 128 inputs)",
           "GPTQ/AWQ's weight rounding (RTN here); the kernel's FP16 dequantization"),
    Recipe("w4a8", "w=fint4/per_group:128; a=fint8/per_token",
           "llm-compressor / compressed-tensors W4A8 (INT4 group-128 weights, dynamic per-token INT8 activations, "
           "both on the full-range grid)", "GPTQ's weight rounding (RTN here)"),
    Recipe("w4a4", "w=int4/per_channel; a=int4/per_token", "QuaRot (arXiv 2404.00456) W4A4 without its rotation "
           "(symmetric per-channel weights, per-token activations)", "GPTQ (RTN here); QuaRot's clipping ratio"),
    Recipe("w4a4-rotated", "w=int4/per_channel; a=int4/per_token; rotate:0",
           "QuaRot (arXiv 2404.00456): a random Hadamard rotation of each linear's input (x H, W H), then W4A4",
           "QuaRot folds the rotation of the residual stream into the weights and norms and rotates online only "
           "down_proj's input; here every quantized linear's input is rotated online (the same arithmetic in full "
           "precision); GPTQ (RTN here)"),
    Recipe("fp8-dynamic", "w=e4m3/per_channel; a=e4m3/per_token",
           "llm-compressor FP8_DYNAMIC (E4M3 channel weights, dynamic per-token E4M3 activations)",
           "the FP8 GEMM's accumulation precision"),
    Recipe("mxfp4", "w=mxfp4; a=mxfp4", "OCP MX v1.0 MXFP4 weights and activations (32-element blocks along the "
           "inputs, E8M0 scales: floor(log2(amax)) - 2); torchao MXLinear", "the matmul's accumulation precision; "
           "not compressed-tensors' MXFP4, which rounds a block's max up to the next power of 2 when its mantissa is "
           ">= 1.75 before taking the exponent (~6% of values differ): that one is ct-mxfp4"),
    Recipe("ct-mxfp4", "w=ct-mxfp4; a=ct-mxfp4", "compressed-tensors / llm-compressor MXFP4 preset (what its "
           "checkpoints and exports hold: OCP's blocks and E2M1 elements, the block max rounded to a power of 2 "
           "before the exponent, up from mantissa 1.75)", "the matmul's accumulation precision"),
    Recipe("nvfp4", "w=nvfp4; a=nvfp4", "NVIDIA NVFP4 weights and activations (llm-compressor NVFP4: 16-element "
           "blocks, E4M3 block scales, FP32 per-tensor scales)", "the activations' per-tensor scale is each "
           "sequence's (llm-compressor calibrates a static one); the accumulation precision"),
    Recipe("llm-int8", "w=int8/per_channel; a=int8/per_token; bnb_outliers:6.0",
           "bitsandbytes Linear8bitLt(threshold=6.0) (int8_vectorwise_quant: only the elements with |x| >= 6 are "
           "left out of a row's absmax; their columns are computed in full precision against the int8 weights)",
           "the outlier columns are chosen per sequence (bitsandbytes: over the batch's rows), so a sequence's "
           "result does not depend on the batch; bitsandbytes' float16 copies of x and W (~0.3%)"),
    Recipe("llm-int8-paper", "w=int8/per_channel; a=int8/per_token; outliers:6.0",
           "LLM.int8() (arXiv 2208.07339) sec. 3.2: the outlier columns leave X whole (out of every row's scale)",
           "the outlier columns are chosen per sequence, so a sequence's result does not depend on the batch; "
           "not bitsandbytes' rule (llm-int8: its row scales still see an outlier column's other elements)"),
)}
"""Named recipes by name: low-bit attention as kernels do it (SageAttention, FA3 FP8, KIVI, MX, NVFP4) and linear
schemes as servers quantize them (W8A8, SmoothQuant, W4A8, W4A4 rotated, FP8, MXFP4, NVFP4, LLM.int8); each a
``Recipe`` with its spec text and the source it follows. ``QuantSpec.parse(name)`` builds its spec."""

