"""What every spec costs against the unquantized sdpa cell of the same model on the same tokens, in one run (#64).

Per model, the cells timed (seconds; model load, calibration and start-up excluded):

  text       each spec's NLL cell on running text: the first ``--windows`` perplexity windows (LAMBADA, gptq protocol,
             ``--length`` tokens) in batches of ``--batch``, every spec the same tokens in the same batches: the
             spec's context entered once, then per batch the trunk, the LM head and the targets' NLL (float64
             log-softmax, as ``score_windows``); the base is the model as loaded (transformers' sdpa attention).
  hellaswag  each spec's HellaSwag cell on the first ``--items`` validation items (lm-eval's requests,
             ``score_requests``, batches of 32 sequences) in the layout its arithmetic allows: ``shared`` (a context
             once, its four endings beside it) for token-local specs, ``separate`` (each context with each ending)
             for the others; the base is the sdpa model in the shared layout, so a separate spec's ratio holds the
             layout factor too, and the record states it (``layout``) with the base's own separate cell
             (``unquantized sdpa, separate``) to divide it out.
  kld        ``score_windows`` of one spec (w8a8) on the text: its NLL, the base's and the KLD per token, against the
             w8a8 text cell (goal <= 1.1x).
  profile    tokens/s of ``profile_model`` (Table 5's points, its defaults) on the text's windows against the sdpa
             forward's (goal >= 0.9x).

Every cell runs once as a warm-up, then ``--reps`` repetitions, all cells of a repetition in turn (interleaved, so a
change of the machine's load reaches all alike); the ratio is the median over the base's median. Goals (ratios to the
sdpa cell): linear schemes and attention recipes that quantize q/k/v/probs <= 1.3x; the paper's per-tensor logits
<= 1.6x. For each cell over its goal, a profile of one text cell: torch.profiler's top self-CPU entries.
Also ``16-bit, our attention``: the identity spec through outlierscope's attention function (what every cell with an
attention part, and today every quantized cell, runs instead of sdpa).
Writes bench/results/cost_MODEL.json (see bench/artifact.py).
Usage: python bench/cost.py [--model smollm2-135m] [--reps 3] [--windows 4] [--length 512] [--batch 4] [--items 50]
                            [--only SPEC ... --tag TAG] [--fused] [--kinds text hellaswag]
--fused: each quantized spec's cells also inside ``fused_kernels()`` (its quantizers compiled; the warm-up compiles),
beside the eager ones in the same run.
(--length: 512 or the model's context, whichever is shorter)
"""

from __future__ import annotations

import argparse
import contextlib
import time

from artifact import begin, interleaved, median, write  # bench/artifact.py (on sys.path as a script)
from cost_specs import BASE, CALIBRATED, GOALS, LINEAR, LOGITS, OURS, RECIPES  # bench/cost_specs.py


def _args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--length", type=int, default=None, help="tokens per window (default: 512, or the model's context)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--items", type=int, default=50)
    ap.add_argument("--only", nargs="*", help="these specs only (with --tag: a record of its own)")
    ap.add_argument("--tag", help="write cost_MODEL_TAG.json (a run of --only specs beside the full record)")
    ap.add_argument("--fused", action="store_true", help="also time each quantized spec's cells inside fused_kernels() "
                    "(cells '<kind> <spec>, fused'; compiled in the warm-up)")
    ap.add_argument("--kinds", nargs="+", choices=("text", "hellaswag"), default=("text", "hellaswag"),
                    help="which cells per spec (default both); the kld and profile cells come with text and no --only")
    a = ap.parse_args()
    if a.only and not a.tag:
        ap.error("--only measures a subset: give --tag NAME so that it does not replace the full cost_MODEL.json")
    return a


def _specs(a, lm) -> dict:
    """name -> (QuantSpec or None: the sdpa model, calibration or None); calibration runs here, before any timing
    (GPTQ / AWQ layers cached under runs/bench-cost/: a rerun reads them)."""
    import hashlib

    from artifact import ROOT

    from outlierscope.quant.apply import check_spec
    from outlierscope.quant.specs.spec import QuantSpec
    from outlierscope.quant.weights.calibration import calibration_for

    names = [*LOGITS, *RECIPES, *LINEAR, *CALIBRATED]
    if a.only:
        names = [n for n in names if n in a.only]
    out = {BASE: (None, None), OURS: (QuantSpec.parse("none"), None)}
    for name in names:
        spec = QuantSpec.parse(name)
        check_spec(spec, lm.model.config)  # before any calibration or timing
        t0 = time.perf_counter()
        cache = ROOT / "runs" / "bench-cost" / a.model.replace(":", "-") / hashlib.sha256(str(spec).encode()).hexdigest()[:16]
        out[name] = (spec, calibration_for(lm.model, lm.tokenizer, spec, cache))
        if time.perf_counter() - t0 > 1:
            print(f"calibrated {name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def _context(lm, spec, calib, fused: bool = False):
    from outlierscope.quant.apply import quantize_model
    from outlierscope.quant.numerics.fused import fused_kernels

    if spec is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(fused_kernels(fused))
    stack.enter_context(quantize_model(lm.model, spec, calibration=calib))
    return stack


def text_cell(lm, batches, spec, calib, fused: bool = False) -> float:
    """One spec's NLL cell on the batches (rows of perplexity windows); returns the summed NLL (a check)."""
    import torch

    from outlierscope.eval.perplexity import F64_ROWS
    from outlierscope.eval.scorer import HEAD_ROWS, gathered_hidden, lm_head

    total = 0.0
    with torch.no_grad(), _context(lm, spec, calib, fused):
        head = lm_head(lm.model)
        for rows in batches:
            h, _, tgt = gathered_hidden(lm.model, rows)
            t = torch.tensor(tgt)
            for s in range(0, len(t), HEAD_ROWS):
                logits = head(h[s:s + HEAD_ROWS])  # (n, V)
                for r in range(0, len(logits), F64_ROWS):
                    lq = torch.log_softmax(logits[r:r + F64_ROWS].double(), dim=-1)  # (m, V)
                    total -= float(lq.gather(1, t[s + r:s + r + F64_ROWS, None]).sum())
    return total


def hellaswag_cell(lm, requests, spec, calib, layout: str, fused: bool = False) -> None:
    from outlierscope.eval.scorer import score_requests

    with _context(lm, spec, calib, fused):
        score_requests(lm.model, requests, layout, 32)


def kld_cell(lm, windows, batch: int, spec, calib) -> None:
    from outlierscope.eval.perplexity import score_windows

    score_windows(lm.model, windows, [spec], batch_size=batch, calibrations=[calib])


def profile_cell(lm, seqs, batch: int) -> None:
    """``profile_model`` with its defaults (Table 5's points) on as many tokens, in sequences of the same length and
    batches of the same size as :func:`forward_cell`'s."""
    from outlierscope.runs.profile import ProfileSettings, profile_model

    profile_model(lm, settings=ProfileSettings(tokens=int(seqs.numel()), seq_len=seqs.shape[1], batch_size=batch),
                  progress=False)


def forward_cell(lm, seqs, batch: int) -> None:
    """The sdpa model's plain forward of ``seqs`` (N, T) in batches of ``batch``."""
    import torch

    with torch.no_grad():
        for i in range(0, len(seqs), batch):
            lm.model(input_ids=seqs[i:i + batch], use_cache=False)


def _cells(a, lm, specs) -> dict:
    """name -> a function that runs one timed cell."""
    from outlierscope.data.hellaswag import load_hellaswag
    from outlierscope.data.running_text import load_text
    from outlierscope.eval.evaluate import layout_for
    from outlierscope.eval.perplexity import _rows
    from outlierscope.eval.requests import build_requests, lmeval_max_length
    from outlierscope.eval.windows import protocol_windows

    windows = protocol_windows("gptq", lm.tokenizer, load_text().docs[: 40 * a.windows], a.length)[: a.windows]
    batches = [_rows(windows[i:i + a.batch]) for i in range(0, len(windows), a.batch)]
    requests = build_requests(load_hellaswag()[: a.items], lm.tokenizer, lmeval_max_length(lm.model, lm.tokenizer))
    cells = {}
    for name, (spec, calib) in specs.items():
        layout = "shared" if spec is None else layout_for(spec)
        for fused in (False, True) if a.fused and spec is not None and not spec.is_identity else (False,):
            tag = ", fused" if fused else ""
            if "text" in a.kinds:
                cells[f"text {name}{tag}"] = lambda s=spec, c=calib, f=fused: text_cell(lm, batches, s, c, f)
            if "hellaswag" in a.kinds:
                cells[f"hellaswag {name}{tag}"] = lambda s=spec, c=calib, lay=layout, f=fused: hellaswag_cell(
                    lm, requests, s, c, lay, f)
    if "hellaswag" in a.kinds:
        cells[f"hellaswag {BASE}, separate"] = lambda: hellaswag_cell(lm, requests, None, None, "separate")
    if "w8a8" in specs and "text" in a.kinds:
        cells["kld w8a8"] = lambda: kld_cell(lm, windows, a.batch, *specs["w8a8"])
    import torch

    seqs = torch.stack([torch.as_tensor(w.input_ids) for w in windows])  # (N, T)
    if "text" in a.kinds and not a.only:
        cells["forward sdpa"] = lambda: forward_cell(lm, seqs, a.batch)
        cells["profile"] = lambda: profile_cell(lm, seqs, a.batch)
    return cells


def _top_entries(cell, rows: int = 8) -> list[str]:
    from torch.profiler import profile

    with profile() as p:
        cell()
    table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return table.splitlines()


def derive(raw: dict, specs: dict) -> dict:
    med = {k: median(v) for k, v in raw.items()}
    out = {"median_s": {k: round(v, 3) for k, v in med.items()}, "ratio": {}, "goal": {}, "over_goal": []}
    for kind in ("text", "hellaswag"):
        if f"{kind} {BASE}" not in med:
            continue
        base = med[f"{kind} {BASE}"]
        for name in specs:
            for cell in (f"{kind} {name}", f"{kind} {name}, fused"):
                if cell not in med:
                    continue
                r = out["ratio"][cell] = round(med[cell] / base, 3)
                if name in GOALS:
                    out["goal"][cell] = GOALS[name]
                    if r > GOALS[name]:
                        out["over_goal"].append(cell)
    if "kld w8a8" in med:
        out["kld_vs_nll_cell"] = round(med["kld w8a8"] / med["text w8a8"], 3)
    if "profile" in med:
        out["profile_vs_sdpa_forward"] = round(med["forward sdpa"] / med["profile"], 3)  # tokens/s, as many tokens
    if f"hellaswag {BASE}, separate" in med:
        out["hellaswag_layout_factor"] = round(med[f"hellaswag {BASE}, separate"] / med[f"hellaswag {BASE}"], 3)
    return out


def main() -> None:
    start = begin()
    a = _args()
    from outlierscope.eval.evaluate import layout_for
    from outlierscope.io import peak_rss_mb
    from outlierscope.models.loading import load_model

    # the base cells are transformers' sdpa attention: load_model's default is eager (the records before 2026-12-06 17:30
    # UTC named this eager base "sdpa"); every quantized cell switches to outlierscope's function and back
    lm = load_model(a.model, attn_implementation="sdpa")
    a.length = a.length or min(512, getattr(lm.model.config, "max_position_embeddings", 512) or 512)
    specs = _specs(a, lm)
    cells = _cells(a, lm, specs)
    raw = interleaved(cells, a.reps, decimals=3)
    derived = derive(raw, specs)
    derived["layout"] = {n: ("shared" if s is None else layout_for(s)) for n, (s, _) in specs.items()}
    derived["profiles_over_goal"] = {k: _top_entries(cells[k]) for k in derived["over_goal"] if k.startswith("text")}
    derived["peak_rss_mb"] = round(peak_rss_mb())
    derived["base_attention"] = lm.model.config._attn_implementation  # after every cell: each context restored it
    write(f"cost_{a.model.replace(':', '-')}" + (f"_{a.tag}" if a.tag else ""), {"model": a.model, "windows": a.windows, "length": a.length,
                                                 "batch": a.batch, "items": a.items, "fused": a.fused,
                                                 "kinds": list(a.kinds), "seconds": raw}, derived,
          start=start, notes="seconds per cell, calibration and model load excluded; median of the repetitions; "
          "ratio = cell / the same kind's unquantized sdpa cell; profile_vs_sdpa_forward: tokens/s of the profile "
          "over the sdpa forward's (as many tokens, the same shapes); peak RSS of the process (VmHWM)")


if __name__ == "__main__":
    main()
