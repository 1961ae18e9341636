"""Training data on disk: documents tokenized into a uint16 token file, cut into packed sequences whose
order is a pure function of (seed, step), so that a resumed run reads exactly the batches it would have read."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from outlierscope.errors import OutlierscopeError
from outlierscope.io import atomic_path
from outlierscope.models.presets import EOS_ID
from outlierscope.train.tokenizer import batched


def tokenize_to_file(tokenizer, docs, path: Path, limit: int, on_doc=None) -> tuple[int, int]:
    """Tokenize documents (EOS after each) into a uint16 file until a number of tokens, atomically.

    Args:
        tokenizer: the tokenizer.
        docs: the documents.
        path: the file.
        limit: the tokens wanted.
        on_doc: called with each document used (decontamination's scan).

    Returns:
        ``(tokens, documents)`` written."""
    n_tok = n_doc = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for chunk in batched(docs, 64):
            enc = tokenizer(chunk, add_special_tokens=False)["input_ids"]
            for doc, ids in zip(chunk, enc):
                if n_tok >= limit:
                    break
                if on_doc:
                    on_doc(doc)
                arr = np.asarray(ids + [EOS_ID], dtype=np.uint16)[: limit - n_tok]
                f.write(arr.tobytes())
                n_tok += len(arr)
                n_doc += 1
            if n_tok >= limit:
                break
    return n_tok, n_doc


class PackedData:
    """Sequences of ``seq_len + 1`` tokens packed from a token file; a step's batch is a pure function of the step.

    Args:
        path: the token file.
        seq_len: tokens per training sequence.
        batch_size: sequences per batch.
        seed: the permutation's seed (one permutation per epoch).

    Raises:
        OutlierscopeError: a corpus that gives fewer sequences than one batch."""

    def __init__(self, path: Path, seq_len: int, batch_size: int, seed: int):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq = seq_len + 1
        self.batch_size = batch_size
        self.n_seq = len(self.tokens) // self.seq
        if self.n_seq < batch_size:
            raise OutlierscopeError(
                f"the corpus gives {self.n_seq} sequences of {self.seq} tokens, fewer than one batch ({batch_size}); "
                "add text, or choose a preset with a smaller batch (see `outlierscope info`)"
            )
        self.seed = seed
        self._perm_epoch = -1
        self._perm = None

    def _perm_for(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_seq)
            self._perm_epoch = epoch
        return self._perm

    def batch(self, step: int) -> np.ndarray:
        """The batch of a step: its sequences in the epoch's seeded permutation.

        Args:
            step: the step."""
        idx = []
        for i in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, j = divmod(i, self.n_seq)
            idx.append(self._perm_for(epoch)[j])
        return self._rows(idx)

    def in_order(self, i: int) -> np.ndarray:
        """Batch ``i`` in file order (no permutation): validation sees the same sequences every time.

        Args:
            i: the batch."""
        return self._rows(range(i * self.batch_size, (i + 1) * self.batch_size))

    def _rows(self, idx) -> np.ndarray:
        return np.stack([self.tokens[k * self.seq : (k + 1) * self.seq] for k in idx]).astype(np.int64)  # (B, S+1)
