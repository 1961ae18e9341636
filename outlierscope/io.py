"""Atomic file output: a result file is either complete or absent, never half-written."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from outlierscope.errors import OutlierscopeError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600 files; results get the usual permissions
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_csv(path: str | os.PathLike, df) -> None:
    """Write a pandas DataFrame as CSV atomically."""
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


def replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Swap a fully written ``tmp_dir`` into place of ``final_dir`` (old copy kept until the swap is done)."""
    old = final_dir.with_name(final_dir.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final_dir.exists():
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    if old.exists():
        shutil.rmtree(old)


def ensure_writable_dir(path: str | os.PathLike) -> Path:
    """Create ``path`` if needed and check that files can be written in it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".probe-", delete=True)
        probe.close()
    except OSError as e:
        raise OutlierscopeError(f"cannot write to output directory {path}: {e.strerror or e}; choose a writable --out") from None
    return path


def versions() -> dict:
    """Versions of the packages that determine a result, recorded next to it."""
    import platform

    import tokenizers
    import torch
    import transformers

    import outlierscope

    return {
        "outlierscope": outlierscope.__version__, "torch": torch.__version__,
        "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
        "python": platform.python_version(),
    }
