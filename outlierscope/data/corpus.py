"""Streaming readers for corpus text: ``.jsonl`` / ``.jsonl.xz`` / ``.jsonl.gz`` with a ``text`` field, or ``.txt``."""

from __future__ import annotations

import gzip
import lzma
import os
from collections.abc import Iterator
from pathlib import Path

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.io import iter_jsonl

SUFFIXES = (".jsonl", ".jsonl.xz", ".jsonl.gz", ".txt", ".txt.xz", ".txt.gz")


def _open(path: Path):
    name = path.name
    if name.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def check_corpus(paths: list[str | os.PathLike]) -> list[Path]:
    """Validate corpus paths up front: they exist, have a known suffix and are not empty.

    Args:
        paths: the files."""
    if not paths:
        raise ParamError("corpus", "at least one file", list(paths))
    out = []
    for p in map(Path, paths):
        if not p.is_file():
            raise OutlierscopeError(f"corpus file not found: {p}")
        if not p.name.endswith(SUFFIXES):
            raise OutlierscopeError(f"corpus file {p}: unsupported format; expected one of {', '.join(SUFFIXES)}")
        if p.stat().st_size == 0:
            raise OutlierscopeError(f"corpus file {p} is empty")
        out.append(p)
    return out


def iter_documents(paths: list[str | os.PathLike]) -> Iterator[str]:
    """The documents of some corpus files, one at a time: a jsonl line's ``text``, or a .txt file split on blank lines.

    Args:
        paths: the files."""
    for path in check_corpus(paths):
        is_jsonl = ".jsonl" in path.name
        try:
            with _open(path) as f:
                if is_jsonl:
                    for lineno, row in iter_jsonl(f, str(path)):
                        if not isinstance(row.get("text"), str):
                            raise OutlierscopeError(f"{path} line {lineno}: expected an object with a string field 'text'")
                        if row["text"].strip():
                            yield row["text"]
                else:
                    para: list[str] = []
                    for line in f:
                        if line.strip():
                            para.append(line)
                        elif para:
                            yield "".join(para).strip()
                            para = []
                    if para:
                        yield "".join(para).strip()
        except UnicodeDecodeError as e:
            raise OutlierscopeError(f"corpus file {path} is not UTF-8 text ({e.reason}); save it as UTF-8") from None
        except (OSError, EOFError, lzma.LZMAError) as e:
            raise OutlierscopeError(f"cannot read corpus file {path}: {e}") from None
