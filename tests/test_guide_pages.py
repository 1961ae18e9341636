"""The guide reads through: each page opens with its question and a command, stays short (about 1,000 words,
paragraphs of about 120), speaks of the toolkit as it is (no project history) and links each glossary term at its
first use."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


GLOSSARY = {  # glossary anchor -> the words that use the term (case-sensitive where an acronym)
    "pair": r"\b[Tt]he (?:bundled |matched )?pair\b", "spec": r"\b[Ss]pecs?\b", "ptq": r"\bPTQ\b",
    "absmax": r"\babsmax\b", "granularity": r"\bper-(?:token|tensor)\b", "kld": r"\bKLD\b",
    "noise-floor": r"\bnoise floor\b", "cell": r"\b[Cc]ells?\b", "record": r"\b[Rr]ecords?\b",
}
HISTORY = r"(?<![\w/&])#\d+\b|\b(?:bench|tests)/|\b[Rr]e-?run (?:for|at|after|with)\b|\b(?:was|were) fixed\b"


def _guide_pages() -> list[Path]:
    return [ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]


def _prose(text: str) -> str:
    """``text`` without its code blocks, generated benchmark tables, HTML comments and attribute lists."""
    text = re.sub(r"^```.*?^```|<!-- bench:\w+ -->.*?<!-- /bench -->", "", text, flags=re.S | re.M)
    return re.sub(r"<!--.*?-->|\{ [#.:][^}]*\}", "", text, flags=re.S)


def _paragraphs(prose: str) -> list[str]:
    """Blocks of prose: a list item or a table cell is one (a table row's cells are its blocks)."""
    blocks = []
    for block in re.split(r"\n\s*\n|\n(?=\s*(?:[-*+]|\d+\.) )", prose):
        if block.lstrip().startswith("|"):
            blocks += [c for row in block.splitlines() for c in row.split("|")]
        elif block.strip() and not block.lstrip().startswith("#"):
            blocks.append(block)
    return blocks


def _words(text: str) -> int:
    return len(re.findall(r"[A-Za-z0-9][\w.'-]*", text))


@pytest.mark.parametrize("page", _guide_pages(), ids=lambda p: p.stem)
def test_a_guide_page_reads_through(page):
    """At most about 1,000 words of prose (code aside), paragraphs of at most about 120, no project history (issue
    numbers, what was re-run or fixed when, the authors' bench/ and tests/ folders)."""
    prose = _prose(page.read_text())
    assert _words(prose) <= 1050, f"{page.name}: {_words(prose)} words"
    long = [p[:80] for p in _paragraphs(prose) if _words(p) > 125]
    assert not long, f"{page.name}: paragraphs over 120 words: {long}"
    history = sorted({m.group(0) for m in re.finditer(HISTORY, prose)})
    assert not history, f"{page.name}: project history on a guide page: {history}"


@pytest.mark.parametrize("page", [p for p in _guide_pages() if p.name != "glossary.md"], ids=lambda p: p.stem)
def test_glossary_terms_are_linked_at_first_use(page):
    """The first use of each glossary term in a page's prose (code spans, headings and the opening question aside) is,
    or follows, a link to its glossary entry, and every glossary link names an entry that exists."""
    glossary = (ROOT / "docs" / "guide" / "glossary.md").read_text()
    prose = re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group(0)), _prose(page.read_text()))
    prose = re.sub(r"^#+ .*$|^\*\*The question:\*\*.*$", lambda m: " " * len(m.group(0)), prose, flags=re.M)  # headings and the question aside
    links = [(m.start(), m.end(), m.group(2)) for m in re.finditer(r"\[([^\]]*)\]\(([^)]*)\)", prose)]
    for *_, target in links:
        if "glossary.md#" in target:
            assert "{ #" + target.split("#", 1)[1] + " }" in glossary, f"{page.name}: no glossary entry {target}"
    unlinked = []
    for anchor, words in GLOSSARY.items():
        if m := re.search(words, prose):
            if not any(s <= m.start() and t.endswith(f"glossary.md#{anchor}") for s, _, t in links):
                unlinked.append(f"{m.group(0)!r} (#{anchor})")
    assert not unlinked, f"{page.name}: first use not linked to the glossary: {unlinked}"


def test_guide_pages_open_with_their_question_and_a_command():
    """Each guide page but the index and the glossary says the question it answers, then one runnable command."""
    for page in (ROOT / "docs" / "guide").glob("*.md"):
        if page.name in ("index.md", "glossary.md"):
            continue
        text = page.read_text()
        assert "**The question:**" in text, page.name
        head = text.split("**The question:**", 1)[1].split("\n## ", 1)[0]
        assert "```" in head, f"{page.name}: no command after its question"


def _commands(page: Path) -> list[str]:
    """The ``outlierscope`` command lines of ``page``'s code blocks, continued lines joined, comments left out."""
    from tests.manual import commands_joined

    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", commands_joined(page.read_text()), re.S | re.M)
    lines = [line.split("  #", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("outlierscope ")]


@pytest.mark.parametrize("page", _guide_pages(), ids=lambda p: p.stem)
def test_every_command_parses(page):
    """Each ``outlierscope`` command on a page names a verb and flags the CLI takes (its own parser; a placeholder
    in capitals stands for a value)."""
    import shlex

    from outlierscope.cli import build_parser

    for line in _commands(page):
        try:
            build_parser().parse_args(shlex.split(line)[1:])
        except SystemExit:
            pytest.fail(f"{page.name}: the CLI refuses: {line}")


def test_home_tables_are_rows_of_their_records():
    """Each table on the home page sits under a ``<!-- rows from: PATH -->`` comment and is rows of that committed
    file, verbatim (no number typed by hand)."""
    source, tables = None, 0
    for line in (ROOT / "docs" / "index.md").read_text().splitlines():
        if m := re.match(r"<!-- rows from: (\S+) -->", line):
            source, tables = (ROOT / m.group(1)).read_text().splitlines(), tables + 1
        elif line.startswith("|"):
            assert source is not None, f"a home table row with no record named above it: {line}"
            assert line in source, f"not a row of its record: {line}"
        elif line.strip():
            source = None
    assert tables == 2
