"""No module imports from a layer above its own: data and models at the bottom, the CLI on top."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "outlierscope"
# rank of each top-level part of the package; a module may import only parts of lower or equal rank
# (analysis sits above quant: it measures what quantization does; runs, train and lmeval share a rank)
RANK = {"errors": 0, "io": 1, "parallel": 1, "settings": 1, "state": 1, "data": 2, "models": 3, "hooks": 4, "quant": 5, "analysis": 6, "eval": 7,
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


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycles():
    """No two modules import each other, directly or through others, even lazily inside functions."""
    names = {_module_name(p): p for p in MODULES}
    graph = {m: {i for i, _ in _imports(p) if i in names and i != m} for m, p in names.items()}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


LONG_OK: dict[str, str] = {}  # "module:function" -> why it may exceed 80 lines (none today; README's Layout says so)


def test_functions_fit_on_a_screen():
    """No function in the package is longer than 80 lines (style rule 11)."""
    long = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                key = f"{_module_name(path)}:{node.name}"
                if n > 80 and key not in LONG_OK:
                    long.append(f"{key} ({n} lines)")
    assert not long, "functions over 80 lines: " + ", ".join(long)


# quant/'s sub-packages: the numbers, the spec that names them, then what applies them; a sub-package imports only
# lower ranks or itself. The modules at quant/'s top (apply, export, bnb) sit above every sub-package; apply
# (quantize_model) calls bnb for bitsandbytes weights.
QUANT_RANK = {"numerics": 0, "specs": 1, "attention": 2, "linears": 3, "weights": 4, "bnb": 5, "export": 5, "apply": 6,
              "__init__": 7}
QUANT = PKG / "quant"


def _quant_part(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["outlierscope", "quant"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


@pytest.mark.parametrize("path", sorted(QUANT.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(QUANT)))
def test_quant_subpackages_import_downward(path):
    rel = path.relative_to(QUANT)
    own = rel.parts[0].removesuffix(".py")
    assert own in QUANT_RANK, f"quant/{rel}: add its sub-package to QUANT_RANK"
    for module, line in _imports(path):
        other = _quant_part(module)
        if other is None or other == own:
            continue
        assert other in QUANT_RANK, f"quant/{rel}:{line} imports {module}, which is no sub-package of quant/"
        assert QUANT_RANK[other] < QUANT_RANK[own], (
            f"quant/{rel}:{line} imports {module} (rank {QUANT_RANK[other]}) from quant/{own} (rank {QUANT_RANK[own]})")


def test_the_code_speaks_of_the_present():
    """No issue numbers in the package (its history is git's), no module docstring longer than a summary (manuals are
    docs pages: docs/develop/internals.md), no test named after a review round, no hole of blank lines where code was."""
    import re

    refs = [f"{p.relative_to(PKG)}:{n}" for p in MODULES for n, line in enumerate(p.read_text().splitlines(), 1)
            if re.search(r"(?<![\w&])#\d{1,4}\b|\bissue \d+", line)]
    assert not refs, refs
    long = [f"{p.relative_to(PKG)} ({len(d)})" for p in MODULES
            if (d := ast.get_docstring(ast.parse(p.read_text()), clean=False)) and len(d) > 1500]
    assert not long, long
    tests = Path(__file__).resolve().parent
    named = [str(p.relative_to(tests)) for p in tests.rglob("test_*.py")
             if "review" in p.name or re.search(r"def test_\w*review", p.read_text())]
    assert not named, named
    holes = [f"{p.relative_to(PKG.parent)}:{m.start()}" for p in [*MODULES, *tests.rglob("*.py")]
             if (m := re.search(r"\n(?:[ \t]*\n){3,}", p.read_text()))]
    assert not holes, f"more than two blank lines in a row: {holes}"
