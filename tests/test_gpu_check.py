"""bench/gpu_check.sh, dry-run on the CPU (DRY_RUN=1: tiny sizes, the bundled model): every step runs and
leaves its file, at most 8 of them (what the GPU machine sends back)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run(tmp_path, hellaswag_cached):
    out = tmp_path / "out"
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "OUTLIERSCOPE_CACHE": str(Path(hellaswag_cached).parent)}
    r = subprocess.run(["bash", "bench/gpu_check.sh", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["attention_memory.txt", "env.txt", "fused.txt", "profile.json", "profile.txt", "pytest.txt",
                     "sweep.json", "sweep.txt"]
    assert len(files) <= 8
    assert "cuda available: False" in (out / "env.txt").read_text()
    assert "skipped" in (out / "pytest.txt").read_text()  # the cuda tests are collected and skip without a GPU
    mem = json.loads((out / "attention_memory.txt").read_text().strip().splitlines()[-1])
    assert mem["smollm2-135m_ours_memory_ratio"] > 1  # blocks hold less than one whole layer
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["settings"]["device"] == "cpu" and sweep["n_items"] == 6
    assert json.loads((out / "profile.json").read_text())["settings"]["device"] == "cpu"
    assert "wall" in (out / "sweep.txt").read_text()
    fused = (out / "fused.txt").read_text()
    got = json.loads(fused.strip().splitlines()[-1])  # the compiled quantizers: the eager bytes (on the CPU)
    assert "wall" in fused and got["csv_files"] >= 4 and got["byte_identical"] == got["csv_files"], got
    assert set(got["cell_seconds"]) == {"sweep", "sweep-fused"} and len(got["cell_seconds"]["sweep-fused"]) == 2
