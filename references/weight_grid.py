"""Are a checkpoint's weights already on a 4-bit grid? For every 2-D weight of a safetensors checkpoint, the share of
its blocks of ``--block`` consecutive input columns whose values lie on an affine grid of 16 levels spanning the
block (GGML's Q4_1: ``d = (max - min) / 15``, every value ``min + q d`` with integer ``q`` in 0..15, to ``--tol`` of a
step), and the mean count of distinct values per block. A weight dequantized from Q4_1 has every block on its grid;
a weight trained in float (or dequantized from 8 bits) has almost none.

Usage: .venv/bin/python references/weight_grid.py --model ~/.cache/outlierscope/models/smollm2-135m \
           --out docs/checkpoints/smollm2-135m-weight-grid.json
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from pathlib import Path


def on_grid(w, block: int, tol: float):
    """(share of blocks on a 16-level affine grid, mean distinct values per block) of ``w`` (O, I)."""
    import torch

    b = w.double().reshape(-1, block)  # (O * I / block, block)
    lo, hi = b.amin(1, keepdim=True), b.amax(1, keepdim=True)
    d = (hi - lo) / 15
    k = (b - lo) / torch.where(d > 0, d, torch.ones_like(d))
    ok = ((k - k.round()).abs() <= tol).all(1) & (d[:, 0] > 0)
    distinct = torch.sort(b, 1).values.diff(dim=1).ne(0).sum(1) + 1
    return float(ok.double().mean()), float(distinct.double().mean())


def main() -> None:
    import torch
    from safetensors import safe_open

    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a directory holding *.safetensors")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--tol", type=float, default=1e-3)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    files = sorted(Path(a.model).expanduser().glob("*.safetensors"))
    if not files:
        sys.exit(f"error: no *.safetensors in {a.model}; give a checkpoint directory")
    rows = {}
    for f in files:
        with safe_open(f, "pt") as st:
            for name in st.keys():
                w = st.get_tensor(name)
                if w.dim() == 2 and w.shape[1] % a.block == 0:
                    share, distinct = on_grid(w, a.block, a.tol)
                    rows[name] = {"shape": list(w.shape), "dtype": str(w.dtype), "on_grid": share,
                                  "distinct_per_block": distinct}
    kinds: dict = {}
    for name, r in rows.items():
        kind = ".".join(name.split(".")[-3:-1]) if ".layers." in name else name
        kinds.setdefault(kind, []).append(r["on_grid"])
    summary = {k: {"tensors": len(v), "min_on_grid": min(v), "mean_on_grid": sum(v) / len(v)} for k, v in kinds.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"command": " ".join(["references/weight_grid.py", *sys.argv[1:]]), "commit": commit,
              "machine": {"cpu": platform.machine(), "python": platform.python_version(), "torch": torch.__version__},
              "block": a.block, "tol": a.tol, "summary": summary, "tensors": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    from textpack import write_sealed

    write_sealed(a.out, record)
    for k, v in summary.items():
        print(f"{k:28s} {v['tensors']:3d} tensors, on a Q4_1 grid: {v['mean_on_grid']:.4f} (min {v['min_on_grid']:.4f})")


if __name__ == "__main__":
    main()
