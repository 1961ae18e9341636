"""The one item type every evaluation scores: a ``TaskDoc``, one ``(context, continuation)`` request per choice.

A HellaSwag item and a zero-shot task row both become one (``item.doc()``); both also say how many choices they have
(``n_choices``) and what identifies their content (``digest_fields()``: what a run's items digest is made of, so a
cell's identity does not depend on how the item is represented in memory).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskDoc:
    """One row of a task as requests.

    Attributes:
        index: the row's index.
        requests: ``(context, continuation)`` for each choice.
        gold: the gold choice.
        choice_chars: each choice's length without the delimiter, for acc_norm."""

    index: int
    requests: tuple[tuple[str, str], ...]
    gold: int
    choice_chars: tuple[int, ...]

    def json(self) -> dict:
        return {"doc_id": self.index, "requests": [list(r) for r in self.requests], "gold": self.gold}

    def doc(self) -> TaskDoc:
        return self

    @property
    def n_choices(self) -> int:
        return len(self.requests)

    def digest_fields(self) -> list:
        return [self.json(), list(self.choice_chars)]
