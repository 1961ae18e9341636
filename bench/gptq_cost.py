"""What GPTQ of a whole model costs in outlierscope against GPT-QModel 7.6 on the same machine (issue #49's goal:
within 2x), on the same calibration rows (``--calib-seqs`` x ``--calib-len`` tokens packed from ``--calib-text`` by
references/textpack.py, as references/gptq_oneshot.py gives GPT-QModel), 4 bits, groups of 64, damp 0.05, no act order, the
model in ``--dtype`` on both sides (default bfloat16: what GPT-QModel's loader picks on a CPU by itself, "Auto dtype
(CPU + Torch Fused)"; its layer forwards then run in bfloat16, its Hessians and updates in float32, as ours) and
``--threads`` torch threads on both sides (default: all cores).

    ours    outlierscope's ``gptq_model`` on the float model (its calibration alone: no load, no save), per
            repetition in this process;
    theirs  GPT-QModel's ``model.quantize`` (its calibration alone: loaded before the clock starts, not saved) in its
            own venv (``make gptq-venv``), one fresh process per repetition (``--theirs``: this script, which then
            imports nothing of outlierscope).

Interleaved (ours, theirs, ours, ...), ``--reps`` each (median of >= 3); peak RSS of each side's process. Writes
bench/results/gptq_cost.json (bench/artifact.py). Usage (a quiet machine: about 30 min for SmolLM2 on 2 cores):

    .venv/bin/python bench/gptq_cost.py --model smollm2-135m --calib-text ../shared/corpus/wiki-train-00.jsonl.xz
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "references"))  # textpack, shared with GPT-QModel's venv
from textpack import packed_ids  # noqa: E402 - references/textpack.py

BITS, GROUP, DAMP = 4, 64, 0.05
GPTQ_PYTHON = Path(__file__).resolve().parent.parent / ".venv-gptq" / "bin" / "python"


def theirs(model_dir: str, text: str, seqs: int, length: int, dtype: str, threads: int) -> None:
    """One GPT-QModel quantization, timed without loading or saving; prints SECONDS and PEAK_RSS_MB."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, ((os.cpu_count() or 1) + 1) // 2)))
    import resource

    import torch

    torch.set_num_threads(threads)
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    rows = packed_ids(AutoTokenizer.from_pretrained(model_dir), text, seqs, length)  # (N, T)
    calib = [{"input_ids": r[None], "attention_mask": torch.ones(1, length, dtype=torch.long)} for r in rows]
    cfg = QuantizeConfig(bits=BITS, group_size=GROUP, sym=True, desc_act=False, act_group_aware=False,
                         damp_percent=DAMP)
    model = GPTQModel.load(model_dir, cfg, device="cpu", dtype=getattr(torch, dtype))
    assert next(model.model.parameters()).dtype == getattr(torch, dtype), "GPT-QModel loaded another dtype"
    t0 = time.perf_counter()
    model.quantize(calib, batch_size=1)
    print("SECONDS", time.perf_counter() - t0)
    print("PEAK_RSS_MB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def ours(lm, rows) -> float:
    from outlierscope.quant.linears.sites import linear_sites
    from outlierscope.quant.specs.spec import QuantSpec
    from outlierscope.quant.weights.gptq_model import gptq_model

    spec = QuantSpec.parse(f"w=fint{BITS}/per_group:{GROUP}; gptq:damp={DAMP}")
    t0 = time.perf_counter()
    gptq_model(lm.model, rows, spec, linear_sites(lm.model, spec), progress=False)
    return time.perf_counter() - t0


def _theirs_once(model_dir: str, a) -> tuple[float, float]:
    r = subprocess.run([str(GPTQ_PYTHON), __file__, "--theirs", "--model-dir", model_dir, "--calib-text", a.calib_text,
                        "--calib-seqs", str(a.calib_seqs), "--calib-len", str(a.calib_len), "--dtype", a.dtype,
                        "--threads", str(a.threads)],
                       capture_output=True, text=True, check=True)
    got = dict(line.split()[:2] for line in r.stdout.splitlines() if line.startswith(("SECONDS", "PEAK_RSS_MB")))
    return float(got["SECONDS"]), float(got["PEAK_RSS_MB"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="outlierscope's model name (ours)")
    ap.add_argument("--model-dir", help="the float model's directory (theirs; default: the fetched model's)")
    ap.add_argument("--calib-text", required=True)
    ap.add_argument("--calib-seqs", type=int, default=128)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the model's dtype on both sides (default: GPT-QModel's own choice on a CPU)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads on both sides")
    ap.add_argument("--theirs", action="store_true", help="(internal) one GPT-QModel run, in its venv")
    a = ap.parse_args()
    if a.theirs:
        return theirs(a.model_dir, a.calib_text, a.calib_seqs, a.calib_len, a.dtype, a.threads)
    from artifact import begin, median, write

    from outlierscope.io import peak_rss_mb
    from outlierscope.models.loading import load_model

    start = begin()
    import torch

    torch.set_num_threads(a.threads)
    lm = load_model(a.model, dtype=a.dtype)
    model_dir = a.model_dir or str(lm.path)  # the directory outlierscope loaded the float model from
    if not (Path(model_dir) / "config.json").exists() or not GPTQ_PYTHON.exists():
        sys.exit(f"error: {model_dir} is not a model directory (give --model-dir), or GPT-QModel's venv is missing "
                 "(make gptq-venv)")
    rows = packed_ids(lm.tokenizer, a.calib_text, a.calib_seqs, a.calib_len)  # (N, T): the rows GPT-QModel gets
    raw = {"ours_s": [], "theirs_s": [], "theirs_peak_rss_mb": []}
    for rep in range(a.reps):
        raw["ours_s"].append(round(ours(lm, rows), 2))
        s, rss = _theirs_once(model_dir, a)
        raw["theirs_s"].append(round(s, 2))
        raw["theirs_peak_rss_mb"].append(round(rss))
        print(f"rep {rep}: ours {raw['ours_s'][-1]} s, GPT-QModel {raw['theirs_s'][-1]} s", flush=True)
    raw["ours_peak_rss_mb"] = round(peak_rss_mb())
    derived = {"ours_median_s": median(raw["ours_s"]), "theirs_median_s": median(raw["theirs_s"]),
               "ours_vs_theirs": round(median(raw["ours_s"]) / median(raw["theirs_s"]), 2),
               "calibration": {"text": a.calib_text, "sequences": a.calib_seqs, "tokens_each": a.calib_len,
                               "bits": BITS, "group": GROUP, "damp": DAMP},
               "dtype": a.dtype, "threads_each": a.threads,
               "versions_theirs": json.loads(subprocess.run(
                   [str(GPTQ_PYTHON), "-c", "import json; from importlib.metadata import version as v; "
                    "print(json.dumps({p: v(p) for p in ('gptqmodel', 'torch', 'transformers')}))"],
                   capture_output=True, text=True, check=True).stdout)}
    write("gptq_cost", raw, derived, start, notes="goal: ours_vs_theirs <= 2 (issue #49)")


if __name__ == "__main__":
    main()
