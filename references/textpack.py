"""What the scripts of references/ share (this folder is on sys.path when they run as scripts, in other venvs too): token
ids packed from a text file's documents (gptq_oneshot.py, packed_nll.py, bench/gptq_cost.py) and sealed records
(outlierscope.io, imported from this checkout: it needs the standard library only)."""

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


def write_sealed(path, record: dict) -> str:
    """Write ``record`` to ``path`` as a sealed record (``outlierscope.io.write_record``); returns the text written."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from outlierscope.io import write_record

    write_record(path, record)
    return Path(path).read_text()
