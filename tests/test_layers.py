"""No module imports from a layer above its own: data and models at the bottom, the CLI on top."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "outlierscope"
# rank of each top-level part of the package; a module may import only parts of lower or equal rank
# (analysis sits above quant: it measures what quantization does; runs, train and lmeval share a rank)
RANK = {"errors": 0, "io": 1, "parallel": 1, "settings": 1, "data": 2, "models": 3, "hooks": 4, "quant": 5, "analysis": 6, "eval": 7,
        "report": 8, "runs": 9, "train": 9, "lmeval": 9, "cli": 10, "__init__": 11, "__main__": 11}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("outlierscope"):
            yield node.module, node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("outlierscope"):
                    yield a.name, node.lineno


MODULES = sorted(p for p in PKG.rglob("*.py") if "pretrained" not in p.parts)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_no_upward_imports(path):
    rel = path.relative_to(PKG)
    own = rel.parts[0].removesuffix(".py")
    assert own in RANK, f"{rel}: add its part to RANK"
    for module, line in _imports(path):
        other = _part(module)
        if other == own or module == "outlierscope":
            continue
        assert RANK[other] < RANK[own], (
            f"{rel}:{line} imports {module} (layer {other}, rank {RANK[other]}) from layer {own} (rank {RANK[own]})")
