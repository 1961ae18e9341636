"""Each notebook runs top to bottom on small settings (parameters overridden through the environment), and is
committed with the outputs of a full run (``make notebooks``) so that a reader sees its figures without running it."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from outlierscope.models.loading import bundled_specs

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_notebooks_are_committed_with_their_outputs():
    assert len(NOTEBOOKS) >= 5
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(c.execution_count is not None for c in code), f"{path.name}: not executed (make notebooks)"
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), f"{path.name}: run out of order"
        assert not any(o.output_type == "error" for c in code for o in c.outputs), f"{path.name}: an error"
        assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), f"{path.name}: no figure"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    if not {"pair-tiny:transformer", "pair-tiny:diff"} <= set(bundled_specs()):
        pytest.skip("bundled pair-tiny models not present")
    env = {"OS_NB_TOKENS": "4096", "OS_NB_LIMIT": "24", "OS_NB_BITS": "16,4",
           "OS_NB_OUT": str(tmp_path / "out"), "OS_NB_RUN": str(tmp_path / "run"),
           "OS_NB_DOCS": str(Path(__file__).resolve().parent.parent / "docs")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "the notebook should show at least one figure"
    if any("OS_NB_OUT" in c.source or "OS_NB_RUN" in c.source for c in nb.cells):  # those that run something write it
        assert os.listdir(tmp_path)


def test_markdown_cells_are_prose():
    """No markdown cell holds code (a cell whose text is a Python call would render as a stray line of text)."""
    import ast

    def is_code(text: str) -> bool:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return False
        return any(isinstance(n, ast.Call) for n in ast.walk(tree))

    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        stray = [c.source for c in nb.cells if c.cell_type == "markdown" and is_code(c.source)]
        assert not stray, f"{path.name}: markdown cells that are code: {stray}"
