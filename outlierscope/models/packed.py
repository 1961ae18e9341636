"""GPTQ and AWQ checkpoints without their kernels: the packed integer weights decoded into the float weights they
stand for, so that such a checkpoint loads (and is profiled, swept, scored) on any device where GPT-QModel's
kernels are not installed, a CPU included.

Both methods quantize weights only, so a layer's output is ``x @ W_deq.T`` whatever the kernel: the dequantized
weights are the checkpoint's exact weights, and the forward differs from a kernel's only by the activations' dtype
and the matmul's summation order (GPT-QModel's CPU kernels compute in float16 / bfloat16; here in the model's dtype).

Formats (GPT-QModel's ``gptqmodel.utils.model_dequant`` and AWQ's ``packing_utils``, re-implemented)::

    GPTQ (checkpoint_format gptq = v1, gptq_v2), bits 2, 3, 4, 8, int32 words:
      qweight (in / (32/bits), out)  codes packed along the input dim, lowest bits first (3 bits: one bit stream)
      qzeros  (groups, out / (32/bits)) zero points packed along the output dim; v1 stores zero - 1 per field
      scales  (groups, out)           g_idx (in,): each input channel's group (act-order permutes it)
      W[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]
    AWQ (version gemm), 4 bits:
      qweight (in, out / 8), qzeros (groups, out / 8): 8 codes per word along the output dim, in the order
      AWQ_ORDER (word field k holds output column 8 * w + AWQ_ORDER[k]); scales (groups, out)
      W[o, i] = (q[i, o] - z[i // group, o]) * s[i // group, o]
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from outlierscope.errors import OutlierscopeError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column each 4-bit field of an AWQ word holds, within its 8
GPTQ_FORMATS = ("gptq", "gptq_v2")  # checkpoint_format: v1 (zero points stored minus one) and v2
GPTQ_BITS = (2, 3, 4, 8)
PACKED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


def unpack_codes(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned codes packed in int32 words along a dim, lowest bits first, as int32: the dim grows by 32 / bits.

    Widths that do not divide 32 (3) run as one bit stream across the words.

    Args:
        words: the int32 words.
        bits: the codes' width.
        dim: the packed dim."""
    if words.dtype != torch.int32:
        raise OutlierscopeError(f"packed weights must be int32 words, got {words.dtype}")
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF  # (..., n) unsigned
    if 32 % bits == 0:
        shifts = torch.arange(0, 32, bits, device=w.device)  # (per,)
        codes = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., n, per)
        codes = codes.flatten(-2)  # (..., n * per)
    else:
        if w.shape[-1] % bits:
            raise OutlierscopeError(f"{bits}-bit codes come in runs of {bits} int32 words; got {w.shape[-1]} words")
        stream = (w.unsqueeze(-1) >> torch.arange(32, device=w.device)) & 1  # (..., n, 32) bits
        stream = stream.flatten(-2).unflatten(-1, (-1, bits))  # (..., n * 32 / bits, bits)
        codes = (stream << torch.arange(bits, device=w.device)).sum(-1)  # (..., n * 32 / bits)
    return codes.to(torch.int32).movedim(-1, dim)


def gptq_weight(qweight, qzeros, scales, g_idx, bits: int, group_size: int, v1: bool) -> torch.Tensor:
    """A GPTQ linear's weight ``(out, in)`` in float32 (exact: a small integer times a float16 scale).

    Args:
        qweight: the packed codes ``(in * bits / 32, out)``.
        qzeros: the packed zero points ``(groups, out * bits / 32)``.
        scales: the scales ``(groups, out)``.
        g_idx: each input channel's group (act order); None: contiguous groups.
        bits: the codes' width.
        group_size: input channels per group (-1: one group).
        v1: GPTQ's v1 format, which stores zero - 1 in each field."""
    q = unpack_codes(qweight, bits, 0)  # (in, out)
    z = unpack_codes(qzeros, bits, 1)[:, : scales.shape[1]]  # (groups, out)
    if v1:  # v1 stores zero - 1 in each field (GPT-QModel reads it back field by field, modulo 2**bits)
        z = (z + 1) & ((1 << bits) - 1)
    if g_idx is None:
        g_idx = torch.arange(q.shape[0], device=q.device) // (group_size if group_size > 0 else q.shape[0])
    g = g_idx.long()  # (in,)
    w = (q - z[g]).float() * scales.float()[g]  # (in, out)
    return w.t().contiguous()  # (out, in)


def awq_weight(qweight, qzeros, scales, bits: int, group_size: int) -> torch.Tensor:
    """An AWQ (gemm) linear's weight ``(out, in)`` in float32.

    Args:
        qweight: the packed codes ``(in, out / 8)``, AWQ's field order.
        qzeros: the packed zero points ``(groups, out / 8)``.
        scales: the scales ``(groups, out)``.
        bits: the codes' width (4).
        group_size: input channels per group (-1: one group)."""
    if bits != 4:
        raise OutlierscopeError(f"AWQ gemm checkpoints hold 4-bit weights; this one says bits={bits}")
    inverse = torch.tensor(AWQ_ORDER).argsort()  # field of each output column within its 8

    def columns(words):  # (rows, out / 8) -> (rows, out), output columns in order
        codes = unpack_codes(words, 4, 1)  # (rows, out) in field order
        order = (torch.arange(codes.shape[1]) // 8 * 8 + inverse.repeat(codes.shape[1] // 8)).to(codes.device)
        return codes[:, order]

    q, z = columns(qweight), columns(qzeros)  # (in, out), (groups, out)
    g = torch.arange(q.shape[0], device=q.device) // (group_size if group_size > 0 else q.shape[0])  # (in,)
    w = (q - z[g]).float() * scales.float()[g]  # (in, out)
    return w.t().contiguous()  # (out, in)


def packed_scheme(quant: dict | None) -> str | None:
    """Which packed format a checkpoint's ``quantization_config`` is, where ``decode_into`` reads it.

    Args:
        quant: the ``quantization_config``, or None.

    Returns:
        ``"gptq"`` or ``"awq"``; None for any other method.

    Raises:
        OutlierscopeError: a GPTQ / AWQ layout it cannot read, naming what can (GPT-QModel's kernels)."""
    method = (quant or {}).get("quant_method")
    if method not in ("gptq", "awq"):
        return None
    bits = quant.get("bits")
    if method == "gptq":
        fmt = quant.get("checkpoint_format") or "gptq"
        if fmt not in GPTQ_FORMATS or bits not in GPTQ_BITS:
            raise OutlierscopeError(f"a GPTQ checkpoint in format {fmt!r} with {bits} bits is not decoded here "
                                    f"(formats {', '.join(GPTQ_FORMATS)}, bits {', '.join(map(str, GPTQ_BITS))}); "
                                    "install gptqmodel and optimum to load it with their kernels (marlin, bitblas: a CUDA GPU)")
    else:
        version = str(quant.get("version") or quant.get("format") or "gemm").lower()
        if version != "gemm" or bits != 4:
            raise OutlierscopeError(f"an AWQ checkpoint of version {version!r} with {bits} bits is not decoded here "
                                    "(version gemm, 4 bits); install gptqmodel to load it with its kernels (gemv, "
                                    "exllama, marlin: a CUDA GPU)")
    return method


def tensor_files(path: Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor: the index of a sharded checkpoint, else the files' own keys.

    Args:
        path: the checkpoint's directory."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: f for k in st.keys()})
    return out


def read_tensor(files: dict[str, Path], key: str):
    """A tensor from the file ``tensor_files`` maps it to; None where no file holds it.

    Args:
        files: ``tensor_files``' map.
        key: the tensor's name."""
    from safetensors import safe_open

    if key not in files:
        return None
    with safe_open(str(files[key]), "pt") as st:
        return st.get_tensor(key)


def packed_names(files: dict[str, Path]) -> list[str]:
    """The module names of a checkpoint's packed linears: those with a ``qweight``.

    Args:
        files: tensor name -> anything (``tensor_files``' map, or the headers' shapes)."""
    return sorted(k[: -len(".qweight")] for k in files if k.endswith(".qweight"))


def packed_modules(path: Path) -> list[str]:
    """The module names of the packed linears of a checkpoint.

    Args:
        path: the checkpoint's directory."""
    return packed_names(tensor_files(path))


def expected_shapes(method: str, bits: int, group: int, out_f: int, in_f: int) -> dict[str, tuple[int, ...]]:
    """The packed tensors a GPTQ / AWQ (gemm) linear holds, by suffix, and their shapes.

    Args:
        method: ``gptq`` or ``awq``.
        bits: the codes' width.
        group: input channels per group (-1: one group).
        out_f: the linear's output features.
        in_f: its input features."""
    groups = -(-in_f // (group if group > 0 else in_f))  # ceil: GPTQ's last group may be short
    if method == "gptq":
        return {".qweight": (in_f * bits // 32, out_f), ".qzeros": (groups, out_f * bits // 32), ".scales": (groups, out_f)}
    return {".qweight": (in_f, out_f // 8), ".qzeros": (groups, out_f // 8), ".scales": (groups, out_f)}


def check_packed(path: Path, quant: dict, shapes: dict[str, tuple[int, ...]], linears: dict[str, tuple[int, int]]) -> None:
    """Check every packed linear's tensors against the config and the model before anything loads.

    A missing tensor, or a shape another group size or bit width would give, is one line (a wrong group size would
    otherwise decode wrong weights silently).

    Args:
        path: the checkpoint's directory, for the errors.
        quant: its ``quantization_config`` (bits, group size).
        shapes: tensor name -> shape, from the safetensors headers.
        linears: the model's linears: name -> ``(out, in)``."""
    method = packed_scheme(quant)
    bits, group = int(quant.get("bits", 4)), int(quant.get("group_size", -1) or -1)
    for name in packed_names(shapes):
        if name not in linears:
            raise OutlierscopeError(f"{path}: packed weights for {name}, which the model has no nn.Linear at; the "
                                    "config and the checkpoint are not one model")
        out_f, in_f = linears[name]
        want = expected_shapes(method, bits, group, out_f, in_f)
        if method == "gptq" and name + ".g_idx" in shapes:
            want[".g_idx"] = (in_f,)
        for suffix, shape in want.items():
            got = shapes.get(name + suffix)
            if got is None:
                raise OutlierscopeError(f"{path}: {name}{suffix} is missing; a {method} linear needs "
                                        f"{', '.join(s[1:] for s in want)}: re-save the checkpoint")
            if tuple(got) != shape:
                raise OutlierscopeError(f"{path}: {name}{suffix} has shape {tuple(got)}, but {bits} bits and "
                                        f"group_size {group} over the model's {out_f} x {in_f} linear give {shape}; "
                                        "the quantization_config (bits, group_size) and the packed tensors disagree")


def decode_into(model, path: Path, quant: dict, files: dict[str, Path]) -> None:
    """Write each packed linear's dequantized weight into a model, module by module (memory: one layer's codes).

    Args:
        model: built from the config without its quantization_config, so those linears are plain ``nn.Linear``.
        path: the checkpoint's directory.
        quant: its ``quantization_config``.
        files: ``tensor_files(path)``."""
    method = packed_scheme(quant)
    bits, group = int(quant.get("bits", 4)), int(quant.get("group_size", -1) or -1)
    for name in packed_names(files):
        def get(suffix, name=name):
            return read_tensor(files, name + suffix)

        if method == "gptq":
            w = gptq_weight(get(".qweight"), get(".qzeros"), get(".scales"), get(".g_idx"), bits, group,
                            v1=(quant.get("checkpoint_format") or "gptq") == "gptq")
        else:
            w = awq_weight(get(".qweight"), get(".qzeros"), get(".scales"), bits, group)
        linear = model.get_submodule(name)
        if tuple(linear.weight.shape) != tuple(w.shape):
            raise OutlierscopeError(f"{path}: {name} decodes to a weight of shape {tuple(w.shape)}, but the model's "
                                    f"linear is {tuple(linear.weight.shape)}; the config and the packed weights differ")
        with torch.no_grad():
            linear.weight.copy_(w.to(linear.weight.dtype))
