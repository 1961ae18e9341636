"""HellaSwag zero-shot scoring, identical to lm-evaluation-harness 0.4.13.

Document (lm-eval ``hellaswag.yaml`` / ``utils.process_docs``)::

    ctx     = ctx_a + " " + ctx_b.capitalize()
    query   = preprocess(activity_label + ": " + ctx)
    choices = [preprocess(e) for e in endings]
    preprocess(t) = t.strip(); " [title]" -> ". "; remove r"\\[.*?\\]"; "  " -> " "

Each choice is a loglikelihood request with context ``query`` and continuation
``" " + choice``; tokenisation follows lm-eval's ``_encode_pair`` (trailing whitespace of the
context moves to the continuation; ``whole = enc(ctx + cont)``, ``ctx_ids = enc(ctx)``,
continuation ids ``whole[len(ctx_ids):]``; an empty context becomes the EOS id).

``acc`` = argmax of the summed log-probabilities (first maximum wins), ``acc_norm`` = argmax
of the sum divided by the choice's length in characters; standard error = sample std / sqrt(n).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from outlierscope.eval.data import HellaSwagItem

_BRACKETS = re.compile(r"\[.*?\]")


def preprocess(text: str) -> str:
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = _BRACKETS.sub("", text)
    text = text.replace("  ", " ")
    return text


@dataclass(frozen=True)
class Doc:
    index: int
    query: str
    choices: tuple[str, ...]
    label: int


def build_doc(item: HellaSwagItem) -> Doc:
    ctx = item.ctx_a + " " + item.ctx_b.capitalize()
    return Doc(
        index=item.index,
        query=preprocess(item.activity_label + ": " + ctx),
        choices=tuple(preprocess(e) for e in item.endings),
        label=item.label,
    )
