"""How running text is cut into scored windows: the three protocols that perplexity tables are computed with.

A ``Window`` is one forward: ``input_ids`` (T,) and the ``targets`` that its logits at positions ``first ..
first + n - 1`` predict (``logits[first + j]`` scores ``targets[j]``, the token after position ``first + j``), with
the document it belongs to (``doc``; -1 for text joined across documents). Protocols::

    gptq      documents joined with "\\n\\n", tokenized once as GPTQ's datautils does (the tokenizer's default
              special tokens: a BOS first where it adds one), cut into non-overlapping windows of seq_len; each
              window scores its tokens 1..T-1 (GPTQ / AWQ / QuaRot's eval_ppl; the remainder is dropped)
    llamacpp  the text (documents joined with "\\n\\n") tokenized once with special tokens, chunks of ctx tokens
              (the remainder dropped; at least two chunks), each chunk's first token replaced by BOS where the
              tokenizer adds one; the second half scored: positions ctx/2 .. ctx-2 predict tokens ctx/2+1 .. ctx-1
              (llama.cpp's llama-perplexity)
    lmeval    each document on its own: lm-evaluation-harness 0.4.13's loglikelihood_rolling (get_rolling_token_windows
              with context_len=1 and make_disjoint_window; the prefix token BOS, else EOS; max_length windows)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from outlierscope.errors import OutlierscopeError, ParamError

PROTOCOLS = ("gptq", "lmeval", "llamacpp")
GPTQ_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Window:
    """One forward whose logits at positions ``first .. first + len(targets) - 1`` predict ``targets``.

    Attributes:
        input_ids: the forward's token ids.
        targets: the scored tokens, each the token after its position.
        first: the position of the first scored logit.
        doc: its document (lmeval); -1 when the text was joined."""

    input_ids: tuple[int, ...]
    targets: tuple[int, ...]
    first: int
    doc: int = -1


def gptq_windows(tokenizer, docs: Sequence[str], length: int) -> list[Window]:
    """GPTQ's ``eval_ppl``: the documents joined with two newlines, tokenized once, cut in ``numel // length`` windows.

    Args:
        tokenizer: the model's tokenizer.
        docs: the documents.
        length: GPTQ's seqlen."""
    ids = tokenizer(GPTQ_SEPARATOR.join(docs))["input_ids"]
    n = len(ids) // length
    if n == 0:
        raise ParamError("length", f"at most the {len(ids)} tokens of the text (one window at least)", length,
                         "use more text or a shorter window")
    # the whole window is the input (a per-sequence scale sees all of it, as in GPTQ's forward); logits 0..T-2 score
    return [Window(tuple(ids[i * length:(i + 1) * length]), tuple(ids[i * length + 1:(i + 1) * length]), 0)
            for i in range(n)]


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer puts a BOS first when it adds special tokens (llama.cpp's ``add_bos``).

    Args:
        tokenizer: the tokenizer."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos is not None and bool(ids) and ids[0] == bos


def llamacpp_windows(tokenizer, docs: Sequence[str], length: int) -> list[Window]:
    """llama-perplexity: chunks of ``length`` tokens of the whole text, the second half of each scored.

    Args:
        tokenizer: the model's tokenizer.
        docs: the documents, joined.
        length: llama-perplexity's n_ctx (at least 4, at most half the text)."""
    ctx = length
    if ctx < 4:
        raise ParamError("length", ">= 4 (llama-perplexity scores the second half of each chunk)", ctx)
    ids = tokenizer(GPTQ_SEPARATOR.join(docs), add_special_tokens=True)["input_ids"]
    if len(ids) < 2 * ctx:
        raise ParamError("length", f"at most half the {len(ids)} tokens of the text (llama-perplexity needs two chunks)",
                         ctx, "use more text or a shorter window")
    bos = tokenizer.bos_token_id if adds_bos(tokenizer) else None
    first = ctx // 2
    out = []
    for i in range(len(ids) // ctx):
        chunk = list(ids[i * ctx:(i + 1) * ctx])
        targets = tuple(chunk[first + 1:])  # the original tokens, also where the first one became BOS
        if bos is not None:
            chunk[0] = bos
        out.append(Window(tuple(chunk), targets, first))  # the whole chunk runs; positions first .. ctx-2 score
    return out


def lmeval_prefix_token(tokenizer) -> int:
    """lm-eval's ``HFLM.prefix_token_id``: the BOS token, else the EOS token.

    Args:
        tokenizer: the tokenizer.

    Raises:
        OutlierscopeError: a tokenizer with neither."""
    tok = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if tok is None:
        raise OutlierscopeError("the tokenizer has neither a BOS nor an EOS token: lm-eval's rolling windows need one "
                                "to condition the first token on")
    return tok


def rolling_windows(tokens: list[int], prefix: int, max_len: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's ``get_rolling_token_windows(..., context_len=1)`` then ``make_disjoint_window``.

    Args:
        tokens: a document's token ids.
        prefix: the prefix token the first window conditions on.
        max_len: lm-eval's max length.

    Returns:
        ``(context, continuation)`` pairs whose continuations cover ``tokens`` once."""
    if not tokens:
        return []
    out, done = [], min(max_len, len(tokens))
    out.append(([prefix], tokens[:done]))  # the first window: every token, the prefix token before them
    while done < len(tokens):
        n = min(len(tokens) - done, max_len)  # pred_len = max_len - context_len + 1 = max_len
        end = done + n
        ctx = tokens[end - max_len - 1:end - 1]  # end > max_len here: never a negative start
        out.append((ctx[:len(ctx) - (n - 1)], tokens[end - n:end]))
        done = end
    return out


def lmeval_windows(tokenizer, docs: Sequence[str], max_len: int) -> list[Window]:
    """lm-eval's ``loglikelihood_rolling``, per document: each window one forward scoring its continuation.

    Each (context, continuation) pair is the forward ``(context + continuation)[-(max_len + 1):][:-1]``.

    Args:
        tokenizer: the model's tokenizer.
        docs: the documents.
        max_len: lm-eval's max length."""
    prefix = lmeval_prefix_token(tokenizer)
    out = []
    for d, doc in enumerate(docs):
        tokens = tokenizer(doc, add_special_tokens=False)["input_ids"]
        for ctx, cont in rolling_windows(tokens, prefix, max_len):
            whole = (ctx + cont)[-(max_len + 1):][:-1]
            out.append(Window(tuple(whole), tuple(cont), len(whole) - len(cont), d))
    return out


def protocol_windows(protocol: str, tokenizer, docs: Sequence[str], length: int) -> list[Window]:
    """The windows a perplexity protocol scores over a text.

    Args:
        protocol: ``gptq`` (the documents joined, cut in windows), ``lmeval`` (each document, rolling) or
            ``llamacpp`` (the joined text in context windows, the second half of each scored).
        tokenizer: the model's tokenizer.
        docs: the text's documents.
        length: gptq's seq_len, lmeval's max_length or llamacpp's ctx.

    Returns:
        The ``Window`` list, in order."""
    if protocol not in PROTOCOLS:
        raise ParamError("protocol", f"one of {', '.join(PROTOCOLS)}", protocol)
    if length < 2:
        raise ParamError("length", ">= 2 tokens per window", length)
    build = {"gptq": gptq_windows, "llamacpp": llamacpp_windows, "lmeval": lmeval_windows}[protocol]
    return build(tokenizer, docs, length)
