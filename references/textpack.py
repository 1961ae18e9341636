"""Token ids packed from a text file's documents: shared by the scripts that run in other venvs
(gptq_oneshot.py, packed_nll.py; this folder is on sys.path when they run as scripts) and bench/gptq_cost.py. Imports nothing of
outlierscope."""

from __future__ import annotations

import json
import lzma


def packed_ids(tok, path: str, seqs: int, length: int):
    """``seqs`` rows of ``length`` token ids (N, T), packed from the documents of ``path`` (.jsonl[.xz] of
    {"text": ...}) in order, EOS between them."""
    import torch

    opener = lzma.open if path.endswith(".xz") else open
    ids: list[int] = []
    with opener(path, "rt") as f:
        for line in f:
            ids += tok(json.loads(line)["text"])["input_ids"] + [tok.eos_token_id]
            if len(ids) >= seqs * length:
                break
    if len(ids) < seqs * length:
        raise SystemExit(f"{path}: {len(ids)} tokens, fewer than {seqs} x {length} = {seqs * length}")
    return torch.tensor(ids[: seqs * length]).reshape(seqs, length)  # (N, T)
