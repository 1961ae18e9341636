"""Each notebook runs top to bottom on small settings (parameters overridden through the environment)."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from outlierscope.models.loading import bundled_specs

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_notebooks_are_stripped():
    assert len(NOTEBOOKS) == 4
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name}: outputs not stripped"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    if not {"pair-tiny:transformer", "pair-tiny:diff"} <= set(bundled_specs()):
        pytest.skip("bundled pair-tiny models not present")
    env = {"OS_NB_TOKENS": "4096", "OS_NB_LIMIT": "24", "OS_NB_BITS": "16,4",
           "OS_NB_OUT": str(tmp_path / "out"), "OS_NB_RUN": str(tmp_path / "run")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, "the notebook should show at least one figure"
    assert os.listdir(tmp_path)
