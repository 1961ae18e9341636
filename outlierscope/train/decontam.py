"""13-gram overlap between HellaSwag validation items and training text (GPT-3 style decontamination check)."""

from __future__ import annotations

import re
from collections import defaultdict

_WS = re.compile(r"\s+")


def words(text: str) -> list[str]:
    """Lowercase and split on any whitespace (so whitespace is normalised).

    Args:
        text: the text."""
    text = text.lower().strip()
    return _WS.split(text) if text else []


def ngrams(ws: list[str], n: int):
    """The n-grams of a word list, in order.

    Args:
        ws: the words.
        n: n."""
    return (tuple(ws[i : i + n]) for i in range(len(ws) - n + 1))


class NgramIndex:
    """The n-grams of each item's segments (context, endings); ``scan`` records the items a text hits.

    Args:
        segments: item -> its segments' texts.
        n: n."""

    def __init__(self, segments: dict[int, list[str]], n: int = 13):
        self.n = n
        self.n_items = len(segments)
        self.index: dict[tuple[str, ...], set[int]] = defaultdict(set)
        for item, texts in segments.items():
            for text in texts:
                for g in ngrams(words(text), n):
                    self.index[g].add(item)
        self.index = dict(self.index)
        self.hits: set[int] = set()

    @classmethod
    def from_hellaswag(cls, items, n: int = 13) -> NgramIndex:
        """The index of HellaSwag items: each item's context and its endings.

        Args:
            items: the items.
            n: n."""
        return cls({it.index: [f"{it.ctx_a} {it.ctx_b}", *it.endings] for it in items}, n)

    def scan(self, text: str) -> None:
        """Record the items a text shares an n-gram with.

        Args:
            text: the text."""
        index = self.index
        for g in ngrams(words(text), self.n):
            items = index.get(g)
            if items:
                self.hits |= items
