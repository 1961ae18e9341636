"""A GPTQ / AWQ checkpoint decoded by outlierscope against the same checkpoint run by GPT-QModel's kernels: the
per-sequence negative log-likelihood of held-out text, and the float model's and an RTN emulation's beside them.

Two runs of this one script write one JSON each, then a third compares them:

    # GPT-QModel's venv (make gptq-venv): transformers loads the checkpoint with GPT-QModel's CPU kernels
    .venv-gptq/bin/python references/packed_nll.py --model CKPT --loader transformers --text T --out A.json
    # the project's venv: outlierscope decodes the packed weights (models.packed); --quant: also the float model
    # under that emulation, --float: also the float model itself
    .venv/bin/python references/packed_nll.py --model CKPT --loader outlierscope --float FLOAT --quant SPEC --text T --out B.json
    .venv/bin/python references/packed_nll.py --compare A.json B.json --out C.json

Sequences: the first ``--seqs`` runs of ``--len`` tokens packed from the documents of ``--text`` (.jsonl[.xz] of
{"text": ...}; EOS between documents), the same ids in both runs (the checkpoint's tokenizer).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib.metadata import version
from pathlib import Path

from textpack import packed_ids  # references/textpack.py (this folder is on sys.path when run as a script)


def nll(model, ids) -> list[float]:
    """Mean next-token NLL (nats) of each sequence, one forward each."""
    import torch

    out = []
    with torch.no_grad():
        for row in ids:
            logits = model(row[None]).logits.float()  # (1, T, V)
            out.append(torch.nn.functional.cross_entropy(logits[0, :-1], row[1:]).item())
    return out


def measure(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = AutoTokenizer.from_pretrained(a.model)
    ids = packed_ids(tok, a.text, a.seqs, a.len)
    res = {}
    if a.loader == "transformers":
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
        kernel = type(model.model.layers[0].self_attn.q_proj).__name__
        res["real"] = {"loader": f"transformers + GPT-QModel ({kernel})", "nll": nll(model, ids)}
    else:
        from outlierscope.models.loading import load_model
        from outlierscope.quant.apply import quantize_model

        lm = load_model(a.model, device="cpu")
        res["real"] = {"loader": "outlierscope (packed weights decoded)", "packed_weights": lm.decoded,
                       "nll": nll(lm.model, ids)}
        if a.float:
            plain = load_model(a.float, device="cpu")
            res["float"] = {"loader": "outlierscope", "nll": nll(plain.model, ids)}
            for spec in a.quant or ():
                with quantize_model(plain.model, spec):
                    res[f"emulated: {spec}"] = {"loader": "outlierscope", "nll": nll(plain.model, ids)}
    return {"model": a.model, "text": a.text, "seqs": a.seqs, "len": a.len, "ids_sum": int(ids.sum()), "runs": res,
            "versions": {p: version(p) for p in ("torch", "transformers")},
            "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
            "command": " ".join(["references/packed_nll.py", *sys.argv[1:]])}


def compare(paths: list[str]) -> dict:
    """Every run of both files side by side: mean NLL, and each against the first file's real run per sequence."""
    import numpy as np

    recs = [json.loads(Path(p).read_text()) for p in paths]
    if len({(r["ids_sum"], r["seqs"], r["len"]) for r in recs}) != 1:
        raise SystemExit("the files scored different token sequences")
    ref = np.array(recs[0]["runs"]["real"]["nll"])
    rows = []
    for p, r in zip(paths, recs):
        for name, run in r["runs"].items():
            x = np.array(run["nll"])
            rows.append({"file": p, "run": name, "loader": run["loader"], "mean_nll": float(x.mean()),
                         "vs_first_real_mean": float((x - ref).mean()), "vs_first_real_max_abs": float(np.abs(x - ref).max())})
    return {"files": paths, "rows": rows, "command": " ".join(["references/packed_nll.py", *sys.argv[1:]])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--loader", choices=("transformers", "outlierscope"))
    ap.add_argument("--float", help="the float model (outlierscope loader): scored too")
    ap.add_argument("--quant", action="append", help="an emulation of the float model (repeat)")
    ap.add_argument("--text")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--len", type=int, default=512)
    ap.add_argument("--compare", nargs="+", help="JSON files of earlier runs")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rec = compare(a.compare) if a.compare else measure(a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    from textpack import write_sealed

    write_sealed(a.out, rec)
    for row in rec.get("rows", []):
        print(f"{row['run']:<40} {row['loader']:<45} {row['mean_nll']:.4f} {row['vs_first_real_mean']:+.5f} "
              f"{row['vs_first_real_max_abs']:.5f}")


if __name__ == "__main__":
    main()
