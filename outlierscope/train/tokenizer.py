"""Byte-level BPE trained on the training files (one tokenizer shared by both models of a pair)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"


def train_bpe(documents: Iterable[str], vocab_size: int, max_chars: int = 50_000_000):
    """Train a byte-level BPE on the first characters of some documents; ``<|endoftext|>`` gets id 0.

    It separates documents and pads.

    Args:
        documents: the documents.
        vocab_size: the vocabulary's size.
        max_chars: the characters read.

    Returns:
        A ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def limited():
        n = 0
        for doc in documents:
            yield doc
            n += len(doc)
            if n >= max_chars:
                return

    tok.train_from_iterator(limited(), trainer=trainer)
    assert tok.token_to_id(EOS_TOKEN) == 0
    return wrap(tok)


def wrap(tok):
    """A trained ``tokenizers`` tokenizer as a ``PreTrainedTokenizerFast`` (EOS and pad ``<|endoftext|>``, no BOS).

    Args:
        tok: the ``tokenizers.Tokenizer``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, bos_token=None, unk_token=None,
        model_max_length=1_000_000, clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path: str | os.PathLike):
    """A run's tokenizer from its ``tokenizer.json``.

    Args:
        path: the file."""
    from tokenizers import Tokenizer

    return wrap(Tokenizer.from_file(str(Path(path))))


def batched(it: Iterable, n: int):
    """An iterable in lists of ``n`` (the last shorter).

    Args:
        it: the iterable.
        n: the list size."""
    it = iter(it)
    while chunk := list(itertools.islice(it, n)):
        yield chunk
