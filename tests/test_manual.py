"""The manual: a README of at most ~200 lines whose tables are the committed records' rows and whose links resolve,
and a documentation site whose API reference renders every public name from its docstring."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
API = ROOT / "docs" / "api"


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200


def test_readme_table_rows_are_their_records_rows():
    """Each table under a ``<!-- rows from: PATH -->`` comment is rows of that committed file, verbatim, or inside a
    ``<!-- bench:NAME -->`` block (generated from bench records by bench/tables.py, tests/test_bench_records.py
    compares it with them); every table of the README is one of these (no number typed by hand)."""
    source, tables, generated = None, 0, False
    for line in README.read_text().splitlines():
        if re.match(r"<!-- bench:\w+ -->", line) or line == "<!-- /bench -->":
            generated = line != "<!-- /bench -->"
        elif generated:
            continue
        elif m := re.match(r"<!-- rows from: (\S+) -->", line):
            source, tables = (ROOT / m.group(1)).read_text(), tables + 1
        elif line.startswith("|"):
            assert source is not None, f"a README table row with no record named above it: {line}"
            assert line in source.splitlines(), f"not a row of its record: {line}"
        elif line.strip() and not line.startswith("<!--"):
            source = None
    assert tables >= 3


def test_readme_links_resolve_and_reach_every_guide_page():
    text = README.read_text()
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", text) if not t.startswith("http")]
    missing = [t for t in links if not (ROOT / t).exists()]
    assert not missing
    pages = {f"docs/guide/{p.name}" for p in (ROOT / "docs" / "guide").glob("*.md") if p.name != "index.md"}
    assert pages <= set(links), f"guide pages the README does not link: {sorted(pages - set(links))}"


def _api_targets() -> list[str]:
    return re.findall(r"^::: ([\w.]+)", "\n".join(p.read_text() for p in sorted(API.glob("*.md"))), re.M)


def test_every_public_name_has_an_api_page():
    """The API reference renders each name once, by the module that defines it: every name of the package root and
    the public names of the sub-packages a user builds on (each importable from its module)."""
    import importlib

    import outlierscope

    targets = _api_targets()
    assert len(targets) == len(set(targets))
    assert set(outlierscope.__all__) <= {t.rsplit(".", 1)[1] for t in targets}
    for t in targets:
        module, name = t.rsplit(".", 1)
        if name in outlierscope._MODULES:
            assert outlierscope._MODULES[name] == t
        elif name in outlierscope._EXPORTS:
            assert outlierscope._EXPORTS[name] == module, t
        else:
            assert not name.startswith("_") and hasattr(importlib.import_module(module), name), t


def test_every_public_name_has_a_docstring():
    """What mkdocstrings renders: griffe's view of each target (a module-level constant's docstring is the string
    after it)."""
    griffe = pytest.importorskip("griffe")
    pkg = griffe.load("outlierscope", search_paths=[str(ROOT)])
    empty = [t for t in _api_targets() if not (d := pkg[t.removeprefix("outlierscope.")].docstring) or not d.value.strip()]
    assert not empty, f"public names without a docstring: {empty}"


def _documented_names(obj) -> list[str] | None:
    """The names an API entry's docstring must list, in order: a function's parameters, a dataclass's fields, a
    class's own ``__init__`` parameters; None where there are none."""
    import dataclasses
    import inspect

    if inspect.isclass(obj):
        if dataclasses.is_dataclass(obj):  # its own fields (a base documents those it adds; an option, its help)
            based = {f.name for b in obj.__mro__[1:] if dataclasses.is_dataclass(b) for f in dataclasses.fields(b)}
            names = [f.name for f in dataclasses.fields(obj)
                     if f.init and f.name[0] != "_" and f.name not in based and "cli" not in f.metadata]
        elif "__init__" in vars(obj):
            names = list(inspect.signature(obj.__init__).parameters)[1:]
        else:
            return None
    elif inspect.isfunction(obj) or callable(obj) and hasattr(obj, "__wrapped__"):
        names = list(inspect.signature(obj).parameters)
        if "." in obj.__qualname__.replace(".<locals>.", "") and names and names[0] in ("self", "cls"):
            names = names[1:]  # a method's receiver
    else:
        return None
    return names or None


def _module_entries(module: str) -> list[tuple[str, object]]:
    """Every public function and class defined in ``module``, and the public methods of its classes but those that
    override a base class's documented method (the base documents the signature)."""
    import importlib
    import inspect

    out = []
    for n, obj in vars(importlib.import_module(module)).items():
        if n.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)) or obj.__module__ != module:
            continue
        out.append((f"{module}.{n}", obj))
        if inspect.isclass(obj):
            for m, v in vars(obj).items():
                f = v.__func__ if isinstance(v, (classmethod, staticmethod)) else v
                inherited = any(getattr(getattr(base, m, None), "__doc__", None) for base in obj.__mro__[1:])
                if not m.startswith("_") and inspect.isfunction(f) and not inherited:
                    out.append((f"{module}.{n}.{m}", f))
    return out


def _package_modules() -> list[str]:
    """Every module of the package (``__main__`` runs the CLI on import: left out)."""
    import pkgutil

    import outlierscope

    return [m.name for m in pkgutil.walk_packages(outlierscope.__path__, "outlierscope.")
            if not m.name.endswith("__main__")]


def test_every_public_name_documents_each_parameter():
    """Every public function, class and method of every module (the API reference's entries among them) lists every
    parameter or field in its Args / Attributes section, in signature order, as griffe parses it (a settings field:
    its option's help; a settings class the API renders: its generated table)."""
    import importlib
    import inspect

    griffe = pytest.importorskip("griffe")
    pkg = griffe.load("outlierscope", search_paths=[str(ROOT)])
    tables = set(re.findall(r"\{\{ settings ([\w.]+) \}\}", "\n".join(p.read_text() for p in API.glob("*.md"))))
    entries = [e for m in _package_modules() for e in _module_entries(m) if e[0] not in tables]

    def function_or_class(target: str) -> bool:
        module, name = target.rsplit(".", 1)
        obj = getattr(importlib.import_module(module), name, None)
        return inspect.isfunction(obj) or inspect.isclass(obj)

    rendered = {t for t in _api_targets() if t not in tables and function_or_class(t)}
    assert rendered and rendered <= {t for t, _ in entries}  # the API reference's entries are among them
    assert len(entries) > 100
    wrong = []
    for t, obj in entries:
        want = _documented_names(obj)
        if want is None:
            continue
        doc = pkg[t.removeprefix("outlierscope.")].docstring
        sections = doc.parse("google", warn_missing_types=False) if doc else []
        got = [p.name.lstrip("*") for s in sections if s.kind.value in ("parameters", "attributes") for p in s.value]
        if got != want:
            wrong.append(f"{t}: documents {got}, takes {want}")
    assert not wrong, "\n".join(wrong)


def _tour_and_openings() -> list[str]:
    """The README's tour lines and each guide page's opening command (the first code block after its question),
    continued lines joined and comment lines left out."""
    from tests.manual import commands_joined

    lines = commands_joined(README.read_text()).split("## A short tour", 1)[1].split("```")[1].strip().splitlines()
    for page in sorted((ROOT / "docs" / "guide").glob("*.md")):
        text = commands_joined(page.read_text())
        if "**The question:**" in text:
            after = text.split("**The question:**", 1)[1]
            head = after.split("\n## ", 1)[0]
            if "```" in head:
                block = head.split("```")[1].split("\n", 1)  # (language tag or "", the lines)
                lines += block[1].strip().splitlines()
    return lines


def test_tour_and_opening_commands_parse():
    """Each of them names a verb and flags the CLI takes (parsed by its own parser; placeholders in capitals)."""
    import shlex

    from outlierscope.cli import build_parser

    lines = _tour_and_openings()
    assert len(lines) >= 25
    for line in lines:
        argv = [w for w in shlex.split(line.split("  #", 1)[0]) if not re.match(r"^[A-Z_]+=", w)]  # env set aside
        if argv[0].endswith("python") and argv[1] == "-m":  # a module of ours run as a program (the lm-eval CLI)
            import importlib.util

            assert importlib.util.find_spec(argv[2]) is not None, line
            continue
        if argv[0].endswith("python"):
            assert (ROOT / argv[1]).exists(), line
            continue
        assert argv[0].endswith("outlierscope"), line
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"the CLI refuses: {line}")
