"""Text for profiling: HellaSwag contexts with their gold endings, or any corpus file, packed into sequences."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

import torch

from outlierscope.errors import ParamError


def hellaswag_documents(path=None) -> Iterator[str]:
    """Each HellaSwag validation item as lm-eval's query followed by its gold continuation.

    Args:
        path: the HellaSwag file; None: the cache."""
    from outlierscope.data.hellaswag import build_doc, load_hellaswag

    for item in load_hellaswag(path):
        doc = build_doc(item)
        yield doc.query + " " + doc.choices[doc.label]


LAMBADA_TAIL = "lambada-tail"  # GPTQ's default calibration text (outlierscope.quant.weights.gptq_model)


def text_documents(source: str) -> Iterator[str]:
    """The documents of a calibration source.

    Args:
        source: ``hellaswag``, ``lambada-tail`` (LAMBADA's test passages from the last one back: text that neither a
            task nor the perplexity default's first windows read) or a .txt / .jsonl(.xz/.gz) file."""
    if source == "hellaswag":
        return hellaswag_documents()
    if source == LAMBADA_TAIL:
        from outlierscope.data.running_text import load_text

        return iter(load_text("lambada").docs[::-1])
    from outlierscope.data.corpus import iter_documents

    return iter_documents([source])


def shuffled(docs: Iterable[str], seed: int, buffer: int = 1000) -> Iterator[str]:
    """A seeded shuffle through a bounded buffer (memory bounded for any corpus size).

    Args:
        docs: the documents.
        seed: the seed.
        buffer: the buffer's size."""
    rng = random.Random(seed)
    buf: list[str] = []
    for d in docs:
        buf.append(d)
        if len(buf) >= buffer:
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


def pack_sequences(tokenizer, docs: Iterable[str], seq_len: int, n_tokens: int) -> torch.Tensor:
    """Tokenize documents (EOS between them) and cut them into ``ceil(n_tokens / seq_len)`` sequences of ``seq_len``.

    Args:
        tokenizer: the tokenizer.
        docs: the documents.
        seq_len: tokens per sequence.
        n_tokens: tokens wanted.

    Returns:
        ``(N, seq_len)`` int64; fewer sequences if the text runs out.

    Raises:
        OutlierscopeError: a text in which not even one sequence fits."""
    if seq_len <= 0:
        raise ParamError("seq_len", ">= 1", seq_len)
    if n_tokens <= 0:
        raise ParamError("tokens", ">= 1", n_tokens)
    n_seq = -(-n_tokens // seq_len)
    need = n_seq * seq_len
    eos = tokenizer.eos_token_id
    buf: list[int] = []
    for d in docs:
        ids = tokenizer(d, add_special_tokens=False)["input_ids"]
        buf.extend(ids)
        if eos is not None:
            buf.append(eos)
        if len(buf) >= need:
            break
    have = len(buf) // seq_len
    if have == 0:
        raise ParamError("seq_len", f"at most the {len(buf)} tokens the text gives (fewer than one sequence)", seq_len, "or use more text")
    n = min(have, n_seq)
    return torch.tensor(buf[: n * seq_len], dtype=torch.int64).view(n, seq_len)  # (N, T)


DELIMITERS = frozenset(".,;:!?")


def delimiter_ids(tokenizer) -> frozenset[int]:
    """The token ids of delimiters: tokens that decode to one punctuation mark or to whitespace holding a newline.

    Sun et al. 2024: massive activations sit on the first token and on delimiters such as "." and "\\n".

    Args:
        tokenizer: the tokenizer."""
    vocab = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(vocab)])
    return frozenset(i for i, t in enumerate(texts) if t.strip() in DELIMITERS or ("\n" in t and not t.strip()))
