"""File I/O used by every layer: atomic output (a result file is either complete or absent, never
half-written), sha256 of files, and a JSON-lines reader with line-numbered errors."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from outlierscope.errors import OutlierscopeError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` for the block; on success it is renamed onto ``path`` (else removed).

    Args:
        path: the file to write.

    Yields:
        The temporary path."""
    path = Path(path)
    check_file_targets([path])
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


def check_file_targets(paths: Iterable[str | os.PathLike]) -> None:
    """Refuse, in one line, a directory standing where a file outlierscope writes goes.

    Args:
        paths: the files about to be written."""
    for p in paths:
        if Path(p).is_dir():
            raise OutlierscopeError(f"{p} is a directory where outlierscope writes a file; move it away or choose "
                                    "another output directory")


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write UTF-8 text atomically.

    Args:
        path: the file.
        text: its content."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj) -> None:
    """Write an object as indented JSON, atomically (unsealed: ``write_record`` seals).

    Args:
        path: the file.
        obj: a JSON-serialisable object (others are written as their ``str``)."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


SEAL = "record_sha256"  # the key of a record's digest of its own content (the last key of a sealed record)
FRAME = b"outlierscope-sha256 "  # a checked binary file: this, 64 hex digits of the payload's sha256, a newline
IDENT_FRAME = b"outlierscope-sha256-ident "  # ... of its identity's JSON line and payload, then that line


class Damaged(OutlierscopeError):
    """A file outlierscope wrote that no longer holds what it wrote (truncated, emptied, bit-flipped, swapped for
    another file): a cache or cell is computed again, a run's own input is an error naming the file."""


def json_sha256(obj) -> str:
    """The sha256 of an object's canonical JSON: sorted keys, no spaces (what a JSON file reads back as).

    Args:
        obj: a JSON-serialisable object."""
    blob = json.dumps(json.loads(json.dumps(obj, default=str)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def sealed(obj: dict) -> dict:
    """A record with ``SEAL`` (the digest of its content) appended as its last key.

    Args:
        obj: the record."""
    body = {k: v for k, v in obj.items() if k != SEAL}
    return {**body, SEAL: json_sha256(body)}


def check_seal(obj, path: str | os.PathLike, required: bool = True) -> dict:
    """A record read back, without its seal, after checking the seal against its content.

    Args:
        obj: the record as read.
        path: where it was read, for the error.
        required: a record without a seal is ``Damaged``; False: returned as read.

    Raises:
        Damaged: a seal that does not match, or none where one is required."""
    if not isinstance(obj, dict) or SEAL not in obj:
        if required:
            raise Damaged(f"{path}: no {SEAL}: written by an older outlierscope or not by outlierscope")
        return obj
    body = {k: v for k, v in obj.items() if k != SEAL}
    if json_sha256(body) != obj[SEAL]:
        raise Damaged(f"{path}: its content does not match its {SEAL} (the file was changed after it was written)")
    return body


def write_record(path: str | os.PathLike, obj: dict) -> None:
    """Write a record (a JSON object outlierscope reads back) sealed with its digest, atomically.

    Args:
        path: the file.
        obj: the record."""
    write_json(path, sealed(obj))


def write_run_record(path: str | os.PathLike, obj: dict, tables: Iterable[str]) -> None:
    """Write a run's record (``write_record``) with the sha256 of each of its tables under ``files``.

    Args:
        path: the record; it is written last, after its tables.
        obj: the record's content.
        tables: the names of the files beside it that the run wrote (read back, each is checked: ``vouched``)."""
    path = Path(path)
    write_record(path, {**obj, "files": file_digests(path.parent, tables)})


def vouched(record: dict, directory: str | os.PathLike, name: str, what: str = "run") -> Path:
    """``directory/name`` after checking it against the digest its run's record lists.

    Args:
        record: the run's record, as ``read_record`` returns it.
        directory: where the record and its tables are.
        name: the table's file name.
        what: the run's kind, for the error.

    Raises:
        Damaged: the record lists no digests, not this file, or another digest than the file's."""
    path = Path(directory) / name
    files = record.get("files")
    if not isinstance(files, dict):
        raise Damaged(f"{directory}: its {what} record holds no digests of its tables (written by an older "
                      f"outlierscope): run the {what} again")
    if name not in files:
        raise Damaged(f"{path}: not among the tables its {what} record lists (not written by that {what}); remove it "
                      f"or run the {what} again")
    check_files(directory, {name: files[name]})
    return path


def file_digests(directory: str | os.PathLike, names: Iterable[str]) -> dict[str, str]:
    """The sha256 of each file a record vouches for.

    Args:
        directory: where the files are.
        names: their names.

    Returns:
        name -> sha256."""
    return {n: sha256_file(Path(directory) / n) for n in names}


def check_files(directory: str | os.PathLike, digests: dict[str, str]) -> None:
    """Check that each file a record lists is present with its digest.

    Args:
        directory: where the files are.
        digests: name -> sha256.

    Raises:
        Damaged: naming the first file missing or changed."""
    for name, want in digests.items():
        path = Path(directory) / name
        if not path.is_file():
            raise Damaged(f"{path}: missing")
        if sha256_file(path) != want:
            raise Damaged(f"{path}: its content does not match the digest its record holds (changed, cut or swapped)")


def write_checked(path: str | os.PathLike, payload: bytes, ident: dict | None = None) -> None:
    """Write ``payload`` atomically behind a header holding its sha256 (``read_checked`` reads it back).

    Args:
        path: the file to write.
        payload: the bytes to store.
        ident: what the file claims to be (a cell and its part, say), stored in the header under the same digest
            (``read_checked_ident`` reads it back)."""
    body = payload if ident is None else json.dumps(ident, sort_keys=True).encode() + b"\n" + payload
    frame = FRAME if ident is None else IDENT_FRAME
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(frame + hashlib.sha256(body).hexdigest().encode() + b"\n")
            f.write(body)


def _checked_body(path: Path) -> tuple[bool, bytes]:
    """(whether the file carries an identity, its body), its digest checked; ``Damaged`` otherwise."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Damaged(f"{path}: cannot be read ({e.strerror or e})") from None
    head, _, body = data.partition(b"\n")
    frame = IDENT_FRAME if head.startswith(IDENT_FRAME) else FRAME
    if not head.startswith(frame) or len(head) != len(frame) + 64:
        raise Damaged(f"{path}: no digest header: written by an older outlierscope, or not by outlierscope")
    if hashlib.sha256(body).hexdigest().encode() != head[len(frame):]:
        raise Damaged(f"{path}: its content does not match its digest (cut or changed after it was written)")
    return frame is IDENT_FRAME, body


def read_checked(path: str | os.PathLike) -> bytes:
    """The payload of a file written by ``write_checked``, its digest checked.

    Args:
        path: the file.

    Raises:
        Damaged: a file cut, changed or not written by outlierscope."""
    has_ident, body = _checked_body(Path(path))
    return body.partition(b"\n")[2] if has_ident else body


def read_checked_ident(path: str | os.PathLike) -> tuple[dict, bytes]:
    """The identity and payload of a file written by ``write_checked`` with ``ident``, its digest checked.

    Args:
        path: the file.

    Returns:
        ``(identity, payload)``.

    Raises:
        Damaged: a file cut, changed, not written by outlierscope, or carrying no identity."""
    path = Path(path)
    has_ident, body = _checked_body(path)
    line, _, payload = body.partition(b"\n")
    try:
        ident = json.loads(line) if has_ident else None
    except ValueError:
        ident = None
    if not isinstance(ident, dict):
        raise Damaged(f"{path}: carries no identity (written by an older outlierscope, or not by outlierscope)")
    return ident, payload


def save_torch_checked(path: str | os.PathLike, obj) -> None:
    """``torch.save`` an object into a checked file (``write_checked``).

    Args:
        path: the file.
        obj: tensors and plain containers only (what ``load_torch_checked`` reads back)."""
    import io as _io

    import torch

    buf = _io.BytesIO()
    torch.save(obj, buf)
    write_checked(path, buf.getvalue())


def load_torch_checked(path: str | os.PathLike):
    """What ``save_torch_checked`` saved, its digest checked, read with ``weights_only=True`` (never unpickled).

    Args:
        path: the file.

    Raises:
        Damaged: a changed file, or one holding objects other than tensors and plain containers."""
    import io as _io

    import torch

    return torch.load(_io.BytesIO(read_checked(path)), map_location="cpu", weights_only=True)


def write_csv(path: str | os.PathLike, df) -> None:
    """Write a pandas DataFrame as CSV, atomically.

    Args:
        path: the file.
        df: the table."""
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary directory beside ``path`` for the block; on success it replaces ``path`` (``replace_dir``).

    Args:
        path: the directory to write.

    Yields:
        The temporary directory."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        replace_dir(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Swap a fully written directory into place, the old copy kept until the swap is done.

    Args:
        tmp_dir: the written directory.
        final_dir: where it goes."""
    old = final_dir.with_name(final_dir.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final_dir.exists():
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    if old.exists():
        shutil.rmtree(old)


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of one file, read in 1 MiB blocks.

    Args:
        path: the file."""
    return sha256_files([path])


def sha256_files(paths: Iterable[str | os.PathLike]) -> str:
    """The hex sha256 of the concatenated bytes of files, in the order given.

    Args:
        paths: the files."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def iter_jsonl(lines: Iterable[str], where: str) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line of a JSON-lines text.

    Args:
        lines: the lines.
        where: the file's name, for the errors.

    Raises:
        OutlierscopeError: a line that is not a JSON object, naming ``where`` and the line."""
    lineno = 0
    try:
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise OutlierscopeError(f"{where} line {lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise OutlierscopeError(f"{where} line {lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row
    except UnicodeDecodeError as e:
        raise OutlierscopeError(f"{where} line {lineno + 1}: not UTF-8 text ({e.reason} at byte {e.start}); "
                                "save the file as UTF-8") from None


def read_record(path: str | os.PathLike, keys: Iterable[str] = (), what: str = "run record",
                sealed_only: bool = False) -> dict:
    """A JSON object written by outlierscope, its seal checked.

    Args:
        path: the file.
        keys: keys it must hold.
        what: what it is, for the errors (``run record``, ``cell record`` ...).
        sealed_only: refuse a record without a seal; False: one written before seals is read as it is.

    Raises:
        OutlierscopeError: a missing, damaged or foreign file, in one line."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        where = "the directory does not exist" if not path.parent.exists() else "no such file"
        raise OutlierscopeError(f"{path}: {where}; expected the {what} of a finished run (check the path)") from None
    except OSError as e:
        raise OutlierscopeError(f"{path} cannot be read ({e.strerror}); check its permissions") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise OutlierscopeError(f"{path} is not a readable {what} ({str(e).splitlines()[0][:80]}); the file is damaged: "
                                "run the command that wrote it again") from None
    try:
        obj = check_seal(obj, path, required=sealed_only)
    except Damaged as e:
        raise Damaged(f"{e}; the {what} is damaged: run the command that wrote it again") from None
    missing = [k for k in keys if not isinstance(obj, dict) or k not in obj]
    if missing:
        raise OutlierscopeError(f"{path} is not a {what}: it lacks {', '.join(missing)}; run the command that wrote it "
                                "again") from None
    return obj


def read_torch_record(path: str | os.PathLike, keys: Iterable[str] = (), what: str = "shard file") -> dict:
    """A dict saved with ``save_torch_checked``, holding ``keys``.

    Args:
        path: the file.
        keys: keys it must hold.
        what: what it is, for the errors.

    Raises:
        OutlierscopeError: a cut, changed or foreign file, or one holding objects other than tensors and plain
            containers (a pickle that could run code), in one line."""
    import pickle

    path = Path(path)
    try:
        obj = load_torch_checked(path)
    except Damaged as e:
        raise Damaged(f"{e}; not a readable {what}: run that shard again") from None
    except pickle.UnpicklingError:
        raise OutlierscopeError(f"{path} holds Python objects other than tensors and plain containers (a pickle that "
                                f"could run code when loaded): refused; not a {what} outlierscope wrote: run that shard "
                                "again") from None
    except Exception as e:  # noqa: BLE001 - torch raises many types for a payload it cannot read
        raise OutlierscopeError(f"{path} is not a readable {what} ({type(e).__name__}); run that shard again") from None
    missing = [k for k in keys if not isinstance(obj, dict) or k not in obj]
    if missing:
        raise OutlierscopeError(f"{path} is not a {what}: it lacks {', '.join(missing)}; run that shard again")
    return obj


@contextlib.contextmanager
def output_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A writable output directory for the block; if the block fails, the directories it made and left empty go again.

    The checkout's commit is read on entry, before the block writes: a record written inside it does not count the
    block's own earlier files (an output directory in docs/) as changes.

    Args:
        path: the directory.

    Yields:
        The directory."""
    git_commit()
    path = Path(path)
    before = {path, *path.parents} if path.exists() else set(path.parents)
    before = {p for p in before if p.exists()}
    if path.exists():
        before |= {p for p in path.rglob("*") if p.is_dir()}
    ensure_writable_dir(path)
    try:
        yield path
    except BaseException:
        made = [p for p in path.rglob("*") if p.is_dir() and p not in before] if path.exists() else []
        made += [p for p in (path, *path.parents) if p not in before]
        for d in sorted(set(made), key=lambda p: -len(p.parts)):  # deepest first
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise


@contextlib.contextmanager
def run_lock(out: str | os.PathLike, tag: str = "whole", what: str = "run") -> Iterator[None]:
    """Hold ``out/.outlierscope-TAG.lock`` (an exclusive ``flock``) for the block; released at its end or the process's.

    A second run of the same tag into ``out`` while the first holds it is a one-line error at once, before it writes
    anything.

    Args:
        out: the run's output directory.
        tag: the whole run (``whole``) or one ``--shard``'s tag.
        what: the command, for the error."""
    import fcntl

    path = Path(out) / f".outlierscope-{tag}.lock"
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "?"
            f.close()
            raise OutlierscopeError(f"{out}: another {what} into this directory is running (pid {pid}); wait for it to "
                                    "finish (a rerun then resumes from its cells), or choose another output directory"
                                    ) from None
        try:
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()  # the file was removed by a run that just finished: lock the one there now
    try:
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield
    finally:
        path.unlink(missing_ok=True)  # while still held: a run that opened it before waits for none
        f.close()


def ensure_writable_dir(path: str | os.PathLike) -> Path:
    """Create a directory if needed and check that files can be written in it.

    Args:
        path: the directory.

    Raises:
        OutlierscopeError: one that cannot be written, in one line."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".probe-", delete=True)
        probe.close()
    except OSError as e:
        raise OutlierscopeError(f"cannot write to output directory {path}: {e.strerror or e}; choose a writable output directory") from None
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


def machine() -> dict:
    """The machine a result was measured on: CPU model, cores, torch threads, GPU (if any)."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


OUTPUTS = ("docs",)  # the checkout's committed results: a run's own outputs, not the code that makes them


@functools.cache
def git_commit() -> str | None:
    """The commit of the outlierscope checkout that ran (with ``+changes`` if its tracked files outside the committed
    results, ``docs/``, differ), or None for an installed copy outside git. Read once per process, at the first
    record. The results under docs/ do not count: a study rerun from a clean clone writes its outputs there, and the
    next study of the same clone must not be marked ``+changes`` for them (each record names its inputs by digest)."""
    return tree_state(Path(__file__).resolve().parent.parent)


def tree_state(root: Path) -> str | None:
    """``HEAD`` of a git checkout, with ``+changes`` if a tracked file outside ``OUTPUTS`` differs from it.

    Args:
        root: the checkout.

    Returns:
        The state; None outside git."""
    import subprocess

    outside = ["--", ":(top)", *(f":(top,exclude){d}" for d in OUTPUTS)]  # paths from the checkout's top
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", *outside], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def peak_rss_mb() -> float:
    """The peak resident memory of this process so far, MiB: Linux's VmHWM (the high-water mark of the process's own
    memory); elsewhere ``ru_maxrss``. (A process started by fork and exec keeps its parent's ``ru_maxrss`` when that is
    larger, so a profile launched from a process that has loaded a model would report that process's peak.)"""
    try:
        with open("/proc/self/status") as f:
            return round(next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024, 1)
    except (OSError, StopIteration, ValueError):
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux
