"""compressed-tensors checkpoints at load: decompressed now (not at the first whole-model forward), NVFP4 weights
decoded in float32 arithmetic from the checkpoint's own files.

compressed-tensors decompresses a checkpoint on the first forward of the whole model (a pre-hook); the scorer and
the hooks run the decoder trunk alone, so ``decompress_now`` does it at load. Its NVFP4 decompression computes
in bfloat16 whatever the model's dtype (codes and scales unpacked to bfloat16, then ``q * (s / gs)``): 0.4% off an
exact float32 decode and unlike the emulation. ``decode_nvfp4`` decodes those linears again from the packed
tensors with compressed-tensors' own ``dequantize`` in float32 (its order: the effective scale ``s / gs``, then
``q * (s / gs)``; NVFP4's scales are float32 arithmetic), then takes the model's dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from outlierscope.models.packed import read_tensor, tensor_files


def decompress_now(model, path: Path) -> None:
    """Decompress a compressed-tensors model in place; each quantized linear keeps compressed-tensors' own forward.

    Its activation scheme is emulated; every weight takes the model's dtype. Nothing for other models.

    Args:
        model: the loaded model.
        path: its directory."""
    quantizer = getattr(model, "hf_quantizer", None)
    if getattr(model, "ct_decompress_hook", None) is None or not hasattr(quantizer, "compressor"):
        return
    nvfp4 = nvfp4_linears(model)  # before decompression: it rewrites the schemes' formats
    quantizer.compressor.decompress_model(model)
    for p in model.parameters():  # NVFP4 decompresses to bfloat16 whatever the model's dtype
        if p.is_floating_point() and p.dtype != model.dtype:
            p.data = p.data.to(model.dtype)
    if nvfp4:
        decode_nvfp4(nvfp4, path)


def nvfp4_linears(model) -> dict[str, torch.nn.Module]:
    """The modules whose weights are NVFP4 (E2M1 codes in groups of 16, E4M3 scales, a float32 global scale).

    Args:
        model: the model.

    Returns:
        Name (as the checkpoint's tensors are named) -> module."""
    out = {}
    for name, module in model.named_modules():
        w = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if w is not None and (w.num_bits, w.type, w.strategy, w.group_size) == (4, "float", "tensor_group", 16):
            out[name] = module
    return out


def decode_nvfp4(modules: dict[str, torch.nn.Module], path: Path) -> None:
    """Set each module's weight to its NVFP4 decode from the checkpoint's files (shards included).

    compressed-tensors' ``dequantize`` of the unpacked E2M1 codes with ``weight_scale`` and ``weight_global_scale``,
    in float32, then in the module's dtype.

    Args:
        modules: ``nvfp4_linears``' modules.
        path: the checkpoint's directory."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    files = tensor_files(Path(path))  # shards included

    def tensor(key: str) -> torch.Tensor:
        return read_tensor(files, key)

    for name, module in modules.items():
        packed = tensor(f"{name}.weight_packed")  # (O, I / 2) uint8: two E2M1 codes a byte
        rows, half = packed.shape
        codes = unpack_fp4_from_uint8(packed, rows, 2 * half, dtype=torch.float32)  # (O, I): exact values
        weight = dequantize(x_q=codes, scale=tensor(f"{name}.weight_scale").float(),  # (O, I / 16) E4M3 -> exact
                            args=module.quantization_scheme.weights, global_scale=tensor(f"{name}.weight_global_scale"),
                            dtype=torch.float32)
        module.weight.data = weight.to(device=module.weight.device, dtype=module.weight.dtype)
