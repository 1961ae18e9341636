"""What a KL-divergence cell costs against a plain NLL cell of the same scheme on the same tokens (issue #48's goal).

One process, a model and the first N windows of the offline text (LAMBADA, gptq protocol); per repetition, after one
warm-up of each, interleaved so that a change of the machine's load reaches both alike:
  plain NLL  for each of k schemes: its trunk on the windows, its head and log-softmax, the targets' NLL (what a
             perplexity-only tool computes for that scheme);
  KLD run    ``score_windows`` with the same k schemes: the unquantized trunk once per batch, the base's
             log-probabilities once per block of positions shared by every scheme, and per token NLL, base NLL,
             KLD, same top token and dp of every scheme.
Goal: KLD run / plain NLL <= 1.15 at k = 8 (median of the repetitions). k = 1 and 4 are reported too: at k = 1 the
unquantized trunk is a second forward, so about 2x by construction; it is shared by every scheme of a run. What
schemes cost once the base is paid for: (KLD run at k = 8 - at k = 4) / (plain at k = 8 - at k = 4).
Peak RSS of the KLD run, each in a fresh process (ru_maxrss): the model's own vocabulary, and (--vocab 262144) a random
Llama of the same shape with a 262,144-token vocabulary on one window of --length tokens.
Writes bench/results/perplexity_cost[_MODEL].json (see bench/artifact.py).
Usage: python bench/perplexity_cost.py [--model pair-tiny:diff] [--windows 16] [--length 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from artifact import begin, median, write  # bench/artifact.py (this folder is on sys.path when run as a script)

SCHEMES = ("logits=int8/per_tensor", "logits=int4/per_tensor", "w8a8", "fp8-dynamic", "kivi-4bit", "sage1",
           "w=fint4/per_group:64", "w4a4")


def _windows(lm, n: int, length: int):
    from outlierscope.data.running_text import load_text
    from outlierscope.eval.windows import protocol_windows

    return protocol_windows("gptq", lm.tokenizer, load_text().docs[: 40 * n], length)[:n]


def plain_nll(model, windows, specs) -> float:
    """Each spec's mean NLL over the windows from its own trunk and head alone (the cost a KLD cell is held to)."""
    import torch

    from outlierscope.eval.perplexity import F64_ROWS, _rows
    from outlierscope.eval.scorer import HEAD_ROWS, gathered_hidden, lm_head
    from outlierscope.quant.apply import quantize_model

    total = 0.0
    with torch.no_grad():
        for spec in specs:
            for w in windows:
                with quantize_model(model, spec):
                    h, _, tgt = gathered_hidden(model, _rows([w]))
                    head, t = lm_head(model), torch.tensor(tgt)
                    for s in range(0, len(t), HEAD_ROWS):
                        logits = head(h[s:s + HEAD_ROWS])  # (n, V), float64 in blocks of F64_ROWS as score_windows
                        for r in range(s, min(s + HEAD_ROWS, len(t)), F64_ROWS):
                            lq = torch.log_softmax(logits[r - s:r - s + F64_ROWS].double(), dim=-1)  # (m, V)
                            total -= float(lq.gather(1, t[r:r + F64_ROWS, None]).sum())
    return total


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timings(a) -> dict:
    from outlierscope.eval.perplexity import score_windows
    from outlierscope.models.loading import load_model
    from outlierscope.quant.specs.spec import QuantSpec

    lm = load_model(a.model)
    windows = _windows(lm, a.windows, a.length)
    raw = {}
    for k in (1, 4, 8):
        specs = [QuantSpec.parse(t) for t in SCHEMES[:k]]
        runs = {"plain": lambda specs=specs: plain_nll(lm.model, windows, specs),
                "kld": lambda specs=specs: score_windows(lm.model, windows, specs)}
        for fn in runs.values():
            fn()  # warm-up
        for _ in range(a.reps):
            for name, fn in runs.items():
                raw.setdefault(f"k{k}_{name}_s", []).append(round(_time(fn), 3))
    return {"windows": len(windows), "tokens": sum(len(w.targets) for w in windows), **raw}


def rss_child(a) -> None:
    """One KLD run of two schemes in this process; prints its peak RSS in MB."""
    import resource

    import torch

    from outlierscope.eval.perplexity import score_windows
    from outlierscope.eval.windows import Window
    from outlierscope.models.loading import load_model
    from outlierscope.quant.specs.spec import QuantSpec

    lm = load_model(a.model)
    model = lm.model
    if a.vocab:
        from transformers import AutoModelForCausalLM

        cfg = model.config.__class__.from_dict({**model.config.to_dict(), "vocab_size": a.vocab})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ids = torch.randint(0, model.config.vocab_size, (a.length,), generator=torch.Generator().manual_seed(0)).tolist()
    window = Window(tuple(ids), tuple(ids[1:]), 0, -1)
    score_windows(model, [window], [QuantSpec.parse(t) for t in SCHEMES[:2]])
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def rss(a, vocab: int | None) -> float:
    cmd = [sys.executable, __file__, "--rss-child", "--model", a.model, "--length", str(a.rss_length)]
    out = subprocess.run(cmd + (["--vocab", str(vocab)] if vocab else []), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="pair-tiny:diff")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rss-length", type=int, default=None, help="tokens of the peak-RSS window (default --length)")
    p.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    a.rss_length = a.rss_length or a.length
    if a.rss_child:
        a.length = a.rss_length
        return rss_child(a)
    start = begin()
    raw = timings(a)
    raw["peak_rss_mb"] = [rss(a, None)]
    raw["peak_rss_262k_vocab_mb"] = [rss(a, 262144)]
    derived = {f"k{k}_ratio": round(median(raw[f"k{k}_kld_s"]) / median(raw[f"k{k}_plain_s"]), 3) for k in (1, 4, 8)}
    extra = {name: median(raw[f"k8_{name}_s"]) - median(raw[f"k4_{name}_s"]) for name in ("plain", "kld")}
    derived["k4_to_k8_ratio"] = round(extra["kld"] / extra["plain"], 3)  # 4 more schemes, the base already shared
    derived.update(goal_k8_ratio=1.15, peak_rss_mb=round(raw["peak_rss_mb"][0]),
                   peak_rss_262k_vocab_mb=round(raw["peak_rss_262k_vocab_mb"][0]))
    name = "perplexity_cost" + ("" if a.model == "pair-tiny:diff" else "_" + a.model.replace(":", "-"))
    write(name, {"model": a.model, "length": a.length, "rss_length": a.rss_length, **raw}, derived, start=start,
          notes="seconds of k schemes over the windows (plain: each scheme's own NLL; kld: score_windows with the "
          "shared unquantized base), median of the repetitions after one warm-up; ratio = kld / plain; peak RSS of "
          "a KLD run of 2 schemes on one window, each in a fresh process")


if __name__ == "__main__":
    main()
