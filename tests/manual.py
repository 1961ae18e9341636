"""The manual's text, for the tests that run or check what it says: the README and every page of the documentation
site's guide (docs/guide/), in that order. A test finds its block by the words around it, wherever the block lives."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide"


def manual() -> str:
    """README.md, then each guide page (sorted by name), joined by blank lines."""
    pages = [ROOT / "README.md", *sorted(GUIDE.glob("*.md"))]
    return "\n\n".join(p.read_text() for p in pages)
