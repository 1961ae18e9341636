"""Proof and benchmark: our HellaSwag scorer against lm-evaluation-harness 0.4.13, item by item.

Runs lm-eval 0.4.13 from its own virtual environment (``make lmeval-venv`` creates ``.venv-lmeval``)
on a Hugging Face checkpoint, reading the cached HellaSwag arrow file through a task yaml that
``include``s lm-eval's ``hellaswag.yaml`` (``dataset_path: arrow``), fully offline. Then scores
the same items with ``outlierscope`` in this process and compares:

* acc and acc_norm (must agree to 3 decimals),
* per item pred and pred_norm (>= 99.9% identical),
* max |score difference| over all 4 choices of all items,
* items/s end to end for both (one run each, same machine).

Usage::

    python bench/eval_vs_lmeval.py --model outlierscope/pretrained/pair-tiny/diff [--limit N] [--out bench/results]
"""

from __future__ import annotations

import sys

# this folder holds profile.py, which would shadow the standard library's `profile` (imported by torch)
sys.path[:] = [x for x in sys.path if not x.rstrip("/").endswith("bench")]

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LMEVAL_PY = ROOT / ".venv-lmeval" / "bin" / "python"


def run_lmeval(model_dir: Path, arrow: Path, limit: int | None, batch_size: int, work: Path) -> tuple[dict, float]:
    hs_yaml = subprocess.check_output(
        [str(LMEVAL_PY), "-c", "import lm_eval, os; print(os.path.join(os.path.dirname(lm_eval.__file__), 'tasks', 'hellaswag', 'hellaswag.yaml'))"],
        text=True).strip()
    tasks = work / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    (tasks / "hellaswag_local.yaml").write_text(
        f"include: {hs_yaml}\ntask: hellaswag_local\ndataset_path: arrow\ndataset_name: null\ntraining_split: null\n"
        f"dataset_kwargs:\n  data_files:\n    validation: {arrow}\n"
    )
    out = work / "lmeval_out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(work / "hf_datasets"), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(LMEVAL_PY), "-m", "lm_eval", "--model", "hf",
           "--model_args", f"pretrained={model_dir},dtype=float32", "--tasks", "hellaswag_local",
           "--include_path", str(tasks), "--device", "cpu", "--batch_size", str(batch_size),
           "--log_samples", "--output_path", str(out)]
    if limit:
        cmd += ["--limit", str(limit)]
    t0 = time.time()
    subprocess.run(cmd, check=True, env=env)
    wall = time.time() - t0
    samples = sorted(out.rglob("samples_hellaswag_local_*.jsonl"))[-1]
    per_doc = {}
    for line in samples.read_text().splitlines():
        s = json.loads(line)
        scores = [float(r[0][0]) if isinstance(r[0], list) else float(r[0]) for r in s["resps"]]
        per_doc[int(s["doc_id"])] = {"scores": scores, "acc": float(s["acc"]), "acc_norm": float(s["acc_norm"])}
    return per_doc, wall


def run_ours(model_dir: Path, limit: int | None, batch_size: int) -> tuple[np.ndarray, list, float]:
    from outlierscope.data.hellaswag import load_hellaswag
    from outlierscope.eval.hellaswag import build_requests, lmeval_max_length
    from outlierscope.eval.scorer import score_requests
    from outlierscope.models.loading import load_model

    t0 = time.time()
    lm = load_model(str(model_dir))
    items = load_hellaswag()
    items = items[:limit] if limit else items
    reqs = build_requests(items, lm.tokenizer, lmeval_max_length(lm.model, lm.tokenizer))
    scores = score_requests(lm.model, reqs, "shared", batch_size)
    return scores, reqs, time.time() - t0


def main() -> int:
    from outlierscope.data.hellaswag import hellaswag_path
    from outlierscope.eval.hellaswag import accuracy, predictions

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--limit", type=int, help="first N items (default: all 10,042)")
    p.add_argument("--lmeval-batch-size", type=int, default=1, help="lm-eval's batch size (its default is 1)")
    p.add_argument("--batch-size", type=int, default=32, help="our batch size")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args()
    if not LMEVAL_PY.exists():
        sys.exit("lm-eval venv missing: run `make lmeval-venv` first")
    model_dir = Path(a.model).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        theirs, t_lmeval = run_lmeval(model_dir, hellaswag_path(), a.limit, a.lmeval_batch_size, Path(tmp))
    ours, reqs, t_ours = run_ours(model_dir, a.limit, a.batch_size)
    n = len(reqs)
    assert sorted(theirs) == list(range(n)), "lm-eval returned another set of documents"
    ref = np.array([theirs[i]["scores"] for i in range(n)])
    chars = [r.choice_chars for r in reqs]
    labels = np.array([r.label for r in reqs])
    p_ours, pn_ours = predictions(ours, chars)
    p_ref, pn_ref = predictions(ref, chars)
    acc_ref = float(np.mean([theirs[i]["acc"] for i in range(n)]))
    accn_ref = float(np.mean([theirs[i]["acc_norm"] for i in range(n)]))
    result = {
        "model": str(model_dir), "items": n, "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "lm_eval": "0.4.13",
        "acc_ours": accuracy(p_ours == labels)[0], "acc_lmeval": acc_ref,
        "acc_norm_ours": accuracy(pn_ours == labels)[0], "acc_norm_lmeval": accn_ref,
        "same_pred": float((p_ours == p_ref).mean()), "same_pred_norm": float((pn_ours == pn_ref).mean()),
        "max_abs_score_diff": float(np.abs(ours - ref).max()),
        "lmeval_seconds": round(t_lmeval, 1), "ours_seconds": round(t_ours, 1),
        "lmeval_items_per_s": round(n / t_lmeval, 2), "ours_items_per_s": round(n / t_ours, 2),
        "speedup": round(t_lmeval / t_ours, 2),
    }
    result["acc_match_3dp"] = round(result["acc_ours"], 3) == round(acc_ref, 3)
    result["acc_norm_match_3dp"] = round(result["acc_norm_ours"], 3) == round(accn_ref, 3)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"eval_vs_lmeval_{model_dir.name}_{n}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    ok = result["acc_match_3dp"] and result["acc_norm_match_3dp"] and min(result["same_pred"], result["same_pred_norm"]) >= 0.999
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
