"""A GPTQ or AWQ checkpoint of a float model, made by GPT-QModel itself on this machine's CPU (docs/checkpoints).

Runs in GPT-QModel's own venv (``make gptq-venv``), imports nothing of outlierscope. Calibration: the first
``--calib-seqs`` sequences of ``--calib-len`` tokens packed from the documents of ``--calib-text`` (a .jsonl or
.jsonl.xz of {"text": ...}, e.g. the shared Wikipedia corpus: read, not copied). GPTQ: act_group_aware off and
desc_act as given (the classic algorithm); AWQ: gemm layout, packed by GPT-QModel's portable torch kernel (its
default needs CUDA). Writes the checkpoint (with the float model's tokenizer) into ``--out`` and what was done to
``gptq_oneshot.json`` there and, with ``--record``, a copy of that record (the checkpoint itself is not committed).

Usage: .venv-gptq/bin/python references/gptq_oneshot.py --model DIR --method gptq --bits 4
       --group 64 --calib-text ../shared/corpus/wiki-train-00.jsonl.xz --out runs/checkpoints/NAME --record FILE
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from importlib.metadata import version
from pathlib import Path

from textpack import packed_ids  # references/textpack.py (this folder is on sys.path when run as a script)


def calibration(tok, path: str, seqs: int, length: int) -> list[dict]:
    """``seqs`` rows of ``length`` token ids packed from the file's documents, as GPT-QModel's calibration rows."""
    import torch

    rows = packed_ids(tok, path, seqs, length)  # (N, T)
    return [{"input_ids": r[None], "attention_mask": torch.ones(1, length, dtype=torch.long)} for r in rows]


def main() -> None:
    # GPT-QModel's default CPU pool, (cores + 1) // 2 workers, is smaller than the 2 its model loader asks for on a
    # 2-core machine (ValueError); the environment variable is its own override
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, ((os.cpu_count() or 1) + 1) // 2)))
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.utils.backend import BACKEND
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the float model's directory")
    ap.add_argument("--method", choices=("gptq", "awq"), required=True)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128, help="inputs per group (-1: one per output channel)")
    ap.add_argument("--asym", action="store_true", help="zero points (GPTQ sym=False; AWQ zero_point)")
    ap.add_argument("--desc-act", action="store_true", help="GPTQ act order")
    ap.add_argument("--calib-text", required=True)
    ap.add_argument("--calib-seqs", type=int, default=128)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--out", required=True)
    ap.add_argument("--record", help="also write the record here (e.g. docs/checkpoints/NAME/gptq_oneshot.json)")
    a = ap.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    calib = calibration(tok, a.calib_text, a.calib_seqs, a.calib_len)
    args = dict(bits=a.bits, group_size=a.group, sym=not a.asym)
    if a.method == "gptq":
        args.update(desc_act=a.desc_act, act_group_aware=False)
    else:
        args.update(quant_method="awq", format="gemm")
    backend = BACKEND.AWQ_TORCH if a.method == "awq" else BACKEND.AUTO
    t0 = time.time()
    model = GPTQModel.load(a.model, QuantizeConfig(**args), device="cpu", backend=backend)
    model.quantize(calib, batch_size=1, backend=backend)
    model.save(a.out)
    tok.save_pretrained(a.out)
    written = json.loads((Path(a.out) / "config.json").read_text())["quantization_config"]
    record = {"model": a.model, "out": a.out, "method": a.method, "quantize_config": args,
              "calibration": {"text": a.calib_text, "sequences": a.calib_seqs, "tokens_each": a.calib_len},
              "quantization_config": {k: v for k, v in written.items() if k != "meta"},
              "seconds": round(time.time() - t0, 1),
              "versions": {p: version(p) for p in ("gptqmodel", "optimum", "transformers", "torch")},
              "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                          "threads": torch.get_num_threads()},
              "command": " ".join(["references/gptq_oneshot.py", *map(shlex.quote, sys.argv[1:])])}
    from textpack import write_sealed

    text = write_sealed(Path(a.out) / "gptq_oneshot.json", record)
    if a.record:
        write_sealed(a.record, record)
    print(text)


if __name__ == "__main__":
    main()
