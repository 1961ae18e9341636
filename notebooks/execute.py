"""Run notebooks top to bottom in place, from the repository root, keeping their outputs (committed, so that a reader
sees the figures without running anything): ``make notebooks``, or ``python notebooks/execute.py [NOTEBOOK...]``.
The test suite runs them again on small settings (tests/test_notebooks.py) without writing them."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def execute(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=3600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    nbformat.write(nb, path)
    print(f"executed {path.relative_to(ROOT)}", flush=True)


if __name__ == "__main__":
    for p in [Path(a).resolve() for a in sys.argv[1:]] or sorted((ROOT / "notebooks").glob("*.ipynb")):
        execute(p)
