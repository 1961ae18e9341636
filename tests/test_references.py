"""The scripts of references/ that run in the project's venv (references/README.md), against values worked by hand from
their sources' definitions (GGML's Q4_1 rule)."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFS = ROOT / "references"


def test_weight_grid_finds_q4_1_blocks():
    """references/weight_grid.py (the Q4_1 finding of docs/checkpoints): blocks made by GGML's Q4_1 rule by hand (d = (max -
    min) / 15, q = round((x - min) / d), back as min + q d) are on the grid, float blocks are not."""
    import torch

    spec = importlib.util.spec_from_file_location("weight_grid", REFS / "weight_grid.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    b = x.reshape(-1, 32)
    lo, d = b.amin(1, keepdim=True), (b.amax(1, keepdim=True) - b.amin(1, keepdim=True)) / 15
    q41 = (lo + torch.round((b - lo) / d) * d).reshape(8, 64)
    assert mod.on_grid(q41, 32, 1e-3)[0] == 1.0 and mod.on_grid(q41, 32, 1e-3)[1] <= 16
    assert mod.on_grid(x, 32, 1e-3)[0] == 0.0 and mod.on_grid(x, 32, 1e-3)[1] == 32
    half = q41.clone()
    half[:4] = x[:4]
    assert mod.on_grid(half, 32, 1e-3)[0] == 0.5


def test_ggml_snap_is_q4_1_and_reproduces_the_committed_model(tmp_path):
    """references/ggml_snap.py (the snapped pair of docs/perplexity/pair-q41): every decoder-layer linear equals GGML's
    Q4_1 written here from ggml-quants.c's reference (per block of 32: d = (max - min) / 15, q = min(15, trunc((x -
    min) / d + 0.5)), back as q fp16(d) + fp16(min)), everything else is unchanged, and the files' sha256 equal those
    the committed record's run read (the same bytes from the same command)."""
    import torch
    from safetensors.torch import load_file

    from outlierscope.models.resolve import resolve_spec

    spec = importlib.util.spec_from_file_location("ggml_snap", REFS / "ggml_snap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = resolve_spec("pair-tiny:transformer")
    done = mod.snap_dir(src, tmp_path / "snap", "Q4_1")
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "snap" / "model.safetensors")
    assert set(before) == set(after) and len(done["snapped"]) == 28
    for name, w in before.items():
        if name not in done["snapped"]:
            assert torch.equal(after[name], w), name
            continue
        b = w.reshape(-1, 32)  # (O * I / 32, 32)
        lo, hi = b.amin(1, keepdim=True), b.amax(1, keepdim=True)
        d = (hi - lo) / 15
        q = torch.clamp(torch.trunc((b - lo) * torch.where(d > 0, 1 / d, torch.zeros_like(d)) + 0.5), max=15)
        ref = q * d.half().float() + lo.half().float()
        assert torch.equal(after[name], ref.reshape(w.shape)), name
    record = json.loads((ROOT / "docs" / "perplexity" / "pair-q41" / "transformer" / "perplexity.json").read_text())
    assert done["sha256"]["model.safetensors"] == record["model_source"]["weights_sha256"]
