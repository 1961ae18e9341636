"""Proof and benchmark: our HellaSwag scorer against lm-evaluation-harness 0.4.13, item by item.

Runs lm-eval 0.4.13 from its own virtual environment (``make lmeval-venv`` creates ``.venv-lmeval``)
on a Hugging Face checkpoint, reading the cached HellaSwag arrow file through a task yaml that
``include``s lm-eval's ``hellaswag.yaml`` (``dataset_path: arrow``), fully offline. Then scores
the same items with ``outlierscope`` in this process and compares:

* acc and acc_norm (must agree to 3 decimals),
* per item pred and pred_norm (>= 99.9% identical),
* per item, our acc / acc_norm outcome against lm-eval's own per-item flags,
* max |score difference| over all 4 choices of all items,
* items/s end to end for both, each timed as a whole process (start-up, loading, tokenization, scoring),
* the FLOP-bound ratio: lm-eval's matmul FLOPs over ours for the same items (see :func:`flops`),
  the speed-up that removing work alone would give if both ran at the same FLOP rate.

Writes ``bench/results/eval_vs_lmeval_<model>_<n>.json`` (see bench/artifact.py), lm-eval's batch size included.

Usage::

    python bench/eval_vs_lmeval.py --model outlierscope/pretrained/pair-tiny/diff [--limit N] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LMEVAL_PY = ROOT / ".venv-lmeval" / "bin" / "python"


def run_lmeval(model_dir: Path, limit: int | None, batch_size: int, work: Path) -> tuple[dict, float]:
    """lm-eval on the cached HellaSwag file (``outlierscope.lmeval.tasks.write_task_yamls``); per-doc scores, wall time."""
    from outlierscope.lmeval.tasks import write_task_yamls

    lm_tasks = subprocess.check_output(
        [str(LMEVAL_PY), "-c", "import lm_eval, os; print(os.path.join(os.path.dirname(lm_eval.__file__), 'tasks'))"],
        text=True).strip()
    tasks = work / "tasks"
    write_task_yamls(tasks, ["hellaswag"], lm_tasks)
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


def run_ours(model_dir: Path, limit: int | None, batch_size: int, work: Path) -> tuple[np.ndarray, list, object, float]:
    """Our scores from a separate process (timed whole, as lm-eval's is), and the requests rebuilt here."""
    from outlierscope.data.hellaswag import load_hellaswag
    from outlierscope.eval.requests import build_requests, lmeval_max_length
    from outlierscope.models.loading import load_model

    out = work / "ours.npy"
    t0 = time.time()
    subprocess.run([sys.executable, __file__, "--model", str(model_dir), "--batch-size", str(batch_size),
                    "--scores-only", str(out)] + (["--limit", str(limit)] if limit else []), check=True)
    wall = time.time() - t0
    lm = load_model(str(model_dir))
    items = load_hellaswag()
    items = items[:limit] if limit else items
    return np.load(out), build_requests(items, lm.tokenizer, lmeval_max_length(lm.model, lm.tokenizer)), lm.model, wall


def flops(model, reqs) -> dict:
    """Matmul FLOPs (2 per multiply-add) of lm-eval's and of our forwards over ``reqs``, padding excluded.

    * trunk: 2 x (parameters of the decoder layers) per token read,
    * attention: 2 x 2 x layers x heads x head_dim per (query, key) pair, dense (both sides run
      square score matrices: lm-eval one causal T x T per choice, ours one tree-masked T x T per item),
    * head: 2 x hidden x vocabulary per position whose logits are computed: lm-eval every position
      of every choice (the Hugging Face forward returns them all), ours only continuation positions.
    """
    cfg = getattr(model.config, "text_config", None) or model.config
    layers = model.get_decoder().layers
    p_trunk = sum(p.numel() for p in layers.parameters())
    n_layers, d = len(layers), cfg.hidden_size
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or d // heads
    vocab = model.get_output_embeddings().weight.shape[0]
    att = 4 * n_layers * heads * hd

    def side(rows: list[tuple[int, int]]) -> dict:  # (tokens read, logit positions)
        t = sum(r[0] for r in rows)
        return {"trunk": 2 * p_trunk * t, "attention": att * sum(r[0] ** 2 for r in rows),
                "head": 2 * d * vocab * sum(r[1] for r in rows), "tokens": t}

    lmeval = side([(len(r.inputs(j)), len(r.inputs(j))) for r in reqs for j in range(len(r.conts))])
    ours = side([(len(r.ctx) + sum(len(c) - 1 for c in r.conts), sum(len(c) for c in r.conts)) if not r.truncated
                 else (sum(len(r.inputs(j)) for j in range(len(r.conts))), sum(len(c) for c in r.conts))
                 for r in reqs])
    for s in (lmeval, ours):
        s["total"] = s["trunk"] + s["attention"] + s["head"]
    return {"lmeval": lmeval, "ours": ours, "ratio": lmeval["total"] / ours["total"]}


def scores_only(model_dir: Path, limit: int | None, batch_size: int, out: Path) -> None:
    from outlierscope import evaluate, load_model

    res = evaluate(load_model(str(model_dir)), limit=limit, batch_size=batch_size, progress=False)
    np.save(out, res.items[[f"score{j}" for j in range(4)]].to_numpy())


def main() -> int:
    from artifact import begin, write

    from outlierscope.eval.requests import predictions

    start = begin()

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--limit", type=int, help="first N items (default: all 10,042)")
    p.add_argument("--lmeval-batch-size", type=int, default=1, help="lm-eval's batch size (its default is 1)")
    p.add_argument("--batch-size", type=int, default=32, help="our batch size")
    p.add_argument("--reps", type=int, default=3, help="timed runs of each side, alternating (median quoted; the scores "
                                                      "compared are the first run's)")
    p.add_argument("--scores-only", metavar="FILE", help=argparse.SUPPRESS)  # the timed child process
    a = p.parse_args()
    if a.scores_only:
        scores_only(Path(a.model), a.limit, a.batch_size, Path(a.scores_only))
        return 0
    if not LMEVAL_PY.exists():
        sys.exit("lm-eval venv missing: run `make lmeval-venv` first")
    model_dir = Path(a.model).resolve()
    t_lm, t_us, theirs, ours = [], [], None, None
    for r in range(a.reps):
        with tempfile.TemporaryDirectory() as tmp:
            got, t = run_lmeval(model_dir, a.limit, a.lmeval_batch_size, Path(tmp))
            theirs, t_lm = theirs or got, [*t_lm, round(t, 2)]
            got, reqs, lm, t = run_ours(model_dir, a.limit, a.batch_size, Path(tmp))
            ours, t_us = (got if ours is None else ours), [*t_us, round(t, 2)]
        print(f"run {r + 1}/{a.reps}: lm-eval {t_lm[-1]} s, outlierscope {t_us[-1]} s", flush=True)
    t_lmeval, t_ours = float(np.median(t_lm)), float(np.median(t_us))
    n = len(reqs)
    assert sorted(theirs) == list(range(n)), "lm-eval returned another set of documents"
    ref = np.array([theirs[i]["scores"] for i in range(n)])
    chars = [r.choice_chars for r in reqs]
    labels = np.array([r.label for r in reqs])
    p_ours, pn_ours = predictions(ours, chars)
    p_ref, pn_ref = predictions(ref, chars)
    flags = {m: np.array([theirs[i][m] for i in range(n)]) for m in ("acc", "acc_norm")}
    ok = {"acc": (p_ours == labels).astype(float), "acc_norm": (pn_ours == labels).astype(float)}
    raw = {"model": str(model_dir), "items": n, "lm_eval": "0.4.13", "lmeval_batch_size": a.lmeval_batch_size,
           "our_batch_size": a.batch_size, "lmeval_process_s": t_lm, "ours_process_s": t_us}
    derived = {
        "acc_ours": float(ok["acc"].mean()), "acc_lmeval": float(flags["acc"].mean()),
        "acc_norm_ours": float(ok["acc_norm"].mean()), "acc_norm_lmeval": float(flags["acc_norm"].mean()),
        "same_acc_flags": float((ok["acc"] == flags["acc"]).mean()),
        "same_acc_norm_flags": float((ok["acc_norm"] == flags["acc_norm"]).mean()),
        "same_pred": float((p_ours == p_ref).mean()), "same_pred_norm": float((pn_ours == pn_ref).mean()),
        "max_abs_score_diff": float(np.abs(ours - ref).max()),
        "lmeval_items_per_s": round(n / t_lmeval, 2), "ours_items_per_s": round(n / t_ours, 2),
        "speedup": round(t_lmeval / t_ours, 2),
    }
    fl = flops(lm, reqs)
    raw["flops"] = {k: fl[k] for k in ("lmeval", "ours")}
    derived["flop_ratio"] = round(fl["ratio"], 2)
    derived["speedup_over_flop_ratio"] = round(derived["speedup"] / fl["ratio"], 2)
    write(f"eval_vs_lmeval_{model_dir.name}_{n}", raw, derived, start=start,
          notes=f"both sides timed as whole processes (start-up, loading, tokenization, scoring); {a.reps} runs each, "
                "alternating, medians; the scores compared are each side's first run")
    good = min(derived["same_acc_flags"], derived["same_acc_norm_flags"], derived["same_pred"], derived["same_pred_norm"])
    return 0 if good >= 0.999 else 1


if __name__ == "__main__":
    sys.exit(main())
