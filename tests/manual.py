"""The manual's text, for the tests that run or check what it says: the README, every page of the documentation
site's guide (docs/guide/) and each study's records page (docs/*/README.md), in that order. A test finds its block
by the words around it, wherever the block lives."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide"


def manual() -> str:
    """README.md, each guide page, then each study page (each sorted by name), joined by blank lines; in code blocks,
    a command continued with ``\\`` is one line and a comment-only line is left out (the pages wrap their commands)."""
    pages = [ROOT / "README.md", *sorted(GUIDE.glob("*.md")), *sorted((ROOT / "docs").glob("*/README.md"))]
    return "\n\n".join(commands_joined(p.read_text()) for p in pages)


def commands_joined(text: str) -> str:
    """``text`` with its code blocks' continued lines joined and their comment-only lines left out."""
    out, fence = [], False
    for line in text.replace("\\\n", " ").split("\n"):
        if line.strip().startswith("```"):
            fence = not fence
        elif fence and line.lstrip().startswith("#"):
            continue
        out.append(line)
    return "\n".join(out)
