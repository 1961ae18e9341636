"""Loglikelihood requests of zero-shot multiple-choice items, tokenised exactly as lm-evaluation-harness 0.4.13 does.

Every item (a HellaSwag item or a task row) is a ``TaskDoc`` (``item.doc()``): one
request per choice, ``(context, continuation)``; HellaSwag's document (lm-eval ``hellaswag.yaml`` /
``utils.process_docs``) is ``outlierscope.data.hellaswag.build_doc``, with continuation ``" " + choice``.
Tokenisation follows lm-eval's ``_encode_pair`` (trailing whitespace of the context moves to the continuation;
``whole = enc(ctx + cont)``, ``ctx_ids = enc(ctx)``, continuation ids ``whole[len(ctx_ids):]``; an empty context
becomes the EOS id).

``acc`` = argmax of the summed log-probabilities (first maximum wins), ``acc_norm`` = argmax
of the sum divided by the choice's length in characters; standard error = sample std / sqrt(n).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

# -- requests and tokenisation (lm-eval HFLM rules) ------------------------------------------


@dataclass(frozen=True)
class Request:
    """One item's token ids: the context and each choice's continuation.

    The model reads ``inputs(j)`` for choice j, ``(ctx + cont_j)[-(max_length + 1):][:-1]`` (lm-eval's left
    truncation); the continuation's log-probabilities are read at its last ``len(conts[j])`` positions.

    Attributes:
        index: the item's index in its task.
        label: the gold choice.
        ctx: the context shared by the choices.
        conts: each choice's continuation.
        choice_chars: each choice's length in characters (acc_norm's divisor).
        max_length: lm-eval's max length.
        ctxs: one context per choice (WinoGrande's partial scoring); None: ``ctx`` for all."""

    index: int
    label: int
    ctx: tuple[int, ...]
    conts: tuple[tuple[int, ...], ...]
    choice_chars: tuple[int, ...]
    max_length: int
    ctxs: tuple[tuple[int, ...], ...] | None = None

    def context(self, j: int) -> tuple[int, ...]:
        """The token ids of a choice's context.

        Args:
            j: the choice."""
        return self.ctx if self.ctxs is None else self.ctxs[j]

    def inputs(self, j: int) -> list[int]:
        """A choice's forward as lm-eval cuts it: of context + continuation, the last ``max_length + 1`` but the last.

        Args:
            j: the choice."""
        return list(self.context(j) + self.conts[j])[-(self.max_length + 1) :][:-1]

    @property
    def truncated(self) -> bool:
        return any(len(self.context(j)) + len(c) > self.max_length + 1 for j, c in enumerate(self.conts))


def lmeval_max_length(model, tokenizer=None) -> int:
    """lm-eval's ``resolve_max_length``: n_positions, max_position_embeddings, n_ctx, the tokenizer's, else 2048.

    Args:
        model: a model or its config.
        tokenizer: the tokenizer (its ``model_max_length``)."""
    config = getattr(model, "config", model)
    cfg = getattr(config, "text_config", None) or config
    for attr in ("n_positions", "max_position_embeddings", "n_ctx"):
        v = getattr(cfg, attr, None)
        if v is not None:
            return int(v)
    mml = getattr(tokenizer, "model_max_length", None)
    if mml is not None and mml < 1e29:
        return int(mml)
    return 2048


def move_trailing_space(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's ``_encode_pair``: the context's trailing whitespace moves to the front of the continuation.

    Args:
        context: the context's text.
        continuation: the continuation's text."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces == 0:
        return context, continuation
    return context[:-n_spaces], context[-n_spaces:] + continuation


class Encoder:
    """lm-eval's ``tok_encode`` and ``_encode_pair`` for a causal model (the tokenizer's default special tokens).

    Args:
        tokenizer: the model's tokenizer."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.prefix_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        self.prefix_str = tokenizer.decode(self.prefix_id) if self.prefix_id is not None else None

    def encode(self, text: str) -> list[int]:
        """lm-eval's ``tok_encode``: special tokens added unless the text starts with the prefix token's text.

        Args:
            text: the text."""
        kw = {}
        if self.prefix_str and text.startswith(self.prefix_str):
            kw["add_special_tokens"] = False
        return self.tok.encode(text, **kw)

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's ``_encode_pair``: the context's ids, and the continuation's (what the whole adds after them).

        Args:
            context: the context's text (empty: the prefix token is the context).
            continuation: the continuation's text."""
        if context == "":
            cont = self.tok.encode(continuation, add_special_tokens=False)
            return ([self.prefix_id], cont) if self.prefix_id != cont[0] else (cont[:1], cont[1:])
        context, continuation = move_trailing_space(context, continuation)
        whole = self.encode(context + continuation)
        ctx = self.encode(context)
        return ctx, whole[len(ctx) :]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of many texts, one batched tokenizer call per special-token setting.

        Args:
            texts: the texts."""
        no_special = [bool(self.prefix_str) and t.startswith(self.prefix_str) for t in texts]
        out: list = [None] * len(texts)
        for flag in (False, True):
            idx = [i for i, f in enumerate(no_special) if f == flag]
            if idx:
                kw = {"add_special_tokens": False} if flag else {}
                for i, ids in zip(idx, self.tok([texts[i] for i in idx], **kw)["input_ids"]):
                    out[i] = ids
        return out

    def pairs(self, pairs: Sequence[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
        """``pair`` of many (context, continuation): the same ids, each distinct text encoded once, batched.

        Args:
            pairs: ``(context, continuation)`` texts."""
        split = []  # (context, context + continuation) after moving trailing spaces, None for an empty context
        for context, continuation in pairs:
            if context == "":
                split.append(None)
                continue
            context, continuation = move_trailing_space(context, continuation)
            split.append((context, context + continuation))
        texts = sorted({t for sp in split if sp for t in sp})
        ids = dict(zip(texts, self.encode_batch(texts)))
        out = []
        for (context, continuation), sp in zip(pairs, split):
            if sp is None:
                out.append(self.pair(context, continuation))
            else:
                ctx = ids[sp[0]]
                out.append((ctx, ids[sp[1]][len(ctx) :]))
        return out


class Requests(list):
    """The requests of some items (a list of ``Request``), with what they were built from.

    Args:
        requests: the ``Request`` list.
        items_sha256: the items' digest (``items_digest``).
        tokenizer_sha256: the tokenizer's (``tokenizer_digest``).
        max_length: lm-eval's max length."""

    def __init__(self, requests, items_sha256: str, tokenizer_sha256: str, max_length: int):
        super().__init__(requests)
        self.items_sha256, self.tokenizer_sha256, self.max_length = items_sha256, tokenizer_sha256, max_length


def items_digest(items) -> str:
    """The sha256 of the items' content (``item.digest_fields()``).

    Args:
        items: HellaSwag items (their fields) or task rows (their requests, gold and choice lengths)."""
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps(it.digest_fields()).encode())
    return h.hexdigest()


def tokenizer_digest(tokenizer) -> str:
    """The sha256 of what a tokenizer encodes with.

    Args:
        tokenizer: a fast tokenizer (its whole definition), else one with a vocabulary (it and the special tokens),
            else any object (the object itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        blob = backend.to_str()
    elif hasattr(tokenizer, "get_vocab"):
        blob = json.dumps([sorted(tokenizer.get_vocab().items()), str(getattr(tokenizer, "special_tokens_map", ""))])
    else:
        blob = f"object {id(tokenizer)}"
    eos = getattr(tokenizer, "eos_token_id", None)
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{eos}\n{blob}".encode()).hexdigest()


def build_requests(items, tokenizer, max_length: int) -> Requests:
    """The requests of any items, tokenised by lm-eval's rules; a context shared by every choice is kept once.

    Args:
        items: HellaSwag items or task rows (each ``item.doc()``; any number of choices, shared or per-choice
            contexts).
        tokenizer: the model's tokenizer.
        max_length: lm-eval's max length (``lmeval_max_length``).

    Returns:
        The ``Requests`` (a list of ``Request``), carrying the digests of the items and the tokenizer."""
    docs = [it.doc() for it in items]
    enc = Encoder(tokenizer)
    encoded = enc.pairs([r for doc in docs for r in doc.requests])
    out, at = [], 0
    for doc in docs:
        pairs, at = encoded[at : at + len(doc.requests)], at + len(doc.requests)
        ctxs = tuple(tuple(p[0]) for p in pairs)
        shared = all(c == ctxs[0] for c in ctxs)
        out.append(Request(doc.index, doc.gold, ctxs[0] if shared else (), tuple(tuple(p[1]) for p in pairs),
                           tuple(doc.choice_chars), max_length, None if shared else ctxs))
    return Requests(out, items_digest(items), tokenizer_digest(tokenizer), max_length)


def check_requests(requests: Sequence[Request], items, tokenizer, max_length: int) -> None:
    """``requests`` are ``build_requests`` of ``items`` with ``tokenizer`` at ``max_length``, else a ParamError
    naming the mismatch.

    Args:
        requests: what the caller built.
        items: the items to score.
        tokenizer: the model's tokenizer.
        max_length: the model's lm-eval max length."""
    from outlierscope.errors import ParamError

    want = f"build_requests of these {len(items)} items"
    if not isinstance(requests, Requests):
        raise ParamError("requests", f"{want} (its value, which holds the digests of its items and tokenizer)",
                         f"a {type(requests).__name__} of {len(requests)} requests")
    if requests.items_sha256 != items_digest(items):
        raise ParamError("requests", f"{want} (items sha256 {items_digest(items)[:12]})",
                         f"{len(requests)} requests of other items (sha256 {requests.items_sha256[:12]})")
    if requests.tokenizer_sha256 != tokenizer_digest(tokenizer):
        raise ParamError("requests", f"{want} built with this model's tokenizer",
                         f"requests of another tokenizer (sha256 {requests.tokenizer_sha256[:12]})")
    if requests.max_length != max_length:
        raise ParamError("requests", f"requests built at the model's lm-eval max length {max_length}",
                         f"max length {requests.max_length}")


# -- metrics -------------------------------------------------------------------------------


def predictions(scores, choice_chars):
    """The acc and acc_norm predictions from summed log-likelihoods; the first maximum wins ties.

    Args:
        scores: ``(N, C)`` summed log-probabilities (NaN where an item has fewer choices).
        choice_chars: each item's choices' lengths in characters (acc_norm's divisor)."""
    import numpy as np

    scores = np.asarray(scores, dtype=np.float64)
    chars = np.ones(scores.shape)
    for i, c in enumerate(choice_chars):  # ragged: items with fewer choices than columns have NaN scores there
        chars[i, : len(c)] = c
    scores = np.where(np.isnan(scores), -np.inf, scores)
    pred = scores.argmax(1)
    pred_norm = (scores / chars).argmax(1)
    return pred, pred_norm
