"""Blocked attention: peak memory and time of one forward at 2,048 tokens, unblocked vs blocked.

Random models of real shapes (weights seeded, nothing downloaded):

* ``smollm2-135m``: 30 layers, hidden 576, 9 query and 3 KV heads of 64 (SmolLM2-135M's shape);
* ``llama3-8b-2l``: Llama-3-8B's layer shape (hidden 4096, 32 query and 8 KV heads of 128, MLP 14336),
  2 layers.

Vocabulary 1,024 and the decoder trunk only (``model.model``): the LM head does not depend on how the
attention is computed, and its (T, V) logits would hide the attention's memory. Each (shape, mode) runs
in a fresh process; memory is the peak above the memory held before the forward (CPU: resident set sampled
every millisecond, with ``MALLOC_MMAP_THRESHOLD_`` fixed so freed tensors return to the system; CUDA:
``torch.cuda.max_memory_allocated``), for the whole forward and for the attention modules alone (the
peak while a layer's attention runs, above the memory held when it started). Modes: transformers' eager attention; ours unblocked (one block);
ours blocked (``--rows`` query rows per block); each unquantized and with 8-bit per_tensor logits (two
passes when blocked). Goal (issue 14): attention memory down >= 8x at <= 1.15x the time.

Usage: python bench/attention_memory.py [--device cpu|cuda] [--rows 128] [--reps 3] [--dry-run]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time

SHAPES = {
    "smollm2-135m": dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, rope_theta=1e5),
    "llama3-8b-2l": dict(num_hidden_layers=2, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, rope_theta=5e5),
}
MODES = ("eager", "ours_unblocked", "ours_blocked", "quant8_unblocked", "quant8_blocked")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _model(shape: str, device: str, tokens: int):
    """A random model of ``shape`` (weights seeded, eager attention) and one batch of ``tokens`` random ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, max_position_embeddings=max(tokens, 2048), **SHAPES[shape])
    model = LlamaForCausalLM(cfg).eval().to(device)
    model.set_attn_implementation("eager")
    return model, torch.randint(0, 1024, (1, tokens), device=device)  # (B=1, T)


def _mode_context(model, mode: str, rows: int, tokens: int):
    """A factory of the context one forward in ``mode`` runs under (unblocked: one block of all rows)."""
    from outlierscope.hooks.attention import attention_stages
    from outlierscope.quant.apply import quantize_model
    from outlierscope.quant.specs.spec import QuantSpec

    block = rows if mode.endswith("_blocked") else tokens
    if mode == "eager":
        return contextlib.nullcontext
    if mode.startswith("quant8"):
        return lambda: quantize_model(model, QuantSpec.logits(bits=8, granularity="per_tensor"), block_rows=block)
    return lambda: attention_stages(model, lambda c, x: x, block_rows=block)


@contextlib.contextmanager
def _attention_peaks(model, cuda: bool):
    """Hooks around every layer's attention module, removed in ``finally``; yields a dict whose ``max`` is the
    largest memory above a module's start while it runs (CPU: ``peak`` is fed by :func:`_rss_peak` while ``on``)
    and whose ``fwd`` keeps the forward's CUDA peak, which the hooks reset to count each module's own."""
    import torch

    attn = {"base": 0, "peak": 0, "on": False, "max": 0, "fwd": 0}

    def pre(mod, args, kwargs):
        if cuda:  # keep the forward's peak so far, then count the attention's own
            torch.cuda.synchronize()
            attn["fwd"] = max(attn["fwd"], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            attn["base"] = torch.cuda.memory_allocated()
        else:
            attn["base"] = attn["peak"] = _rss()
        attn["on"] = True

    def post(mod, args, kwargs, out):
        if cuda:
            torch.cuda.synchronize()
            attn["max"] = max(attn["max"], torch.cuda.max_memory_allocated() - attn["base"])
            attn["fwd"] = max(attn["fwd"], torch.cuda.max_memory_allocated())
        else:
            attn["max"] = max(attn["max"], max(attn["peak"], _rss()) - attn["base"])
        attn["on"] = False

    layers = model.model.layers
    handles = [la.self_attn.register_forward_pre_hook(pre, with_kwargs=True) for la in layers]
    handles += [la.self_attn.register_forward_hook(post, with_kwargs=True) for la in layers]
    try:
        yield attn
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _rss_peak(attn: dict):
    """CPU: the resident set sampled every millisecond by a thread while the block runs (into ``attn["peak"]`` too
    while an attention module runs); yields ``{"base", "peak"}``, the peak final once the block has ended (the
    thread is stopped in ``finally``)."""
    st = {"base": _rss()}
    st["peak"] = st["base"]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            r = _rss()
            st["peak"] = max(st["peak"], r)
            if attn["on"]:
                attn["peak"] = max(attn["peak"], r)
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield st
    finally:
        stop.set()
        t.join()
        st["peak"] = max(st["peak"], _rss())


def _forward(model, ids, ctx, cuda: bool, attn: dict) -> tuple[float, int]:
    """Seconds of one forward of the decoder trunk under ``ctx()``, and its peak memory above its start."""
    import torch

    attn["max"] = attn["fwd"] = 0
    with contextlib.nullcontext() if cuda else _rss_peak(attn) as rss:
        t0 = time.perf_counter()
        with torch.no_grad(), ctx():
            if cuda:  # the whole forward's peak: the attention hooks reset the counter, so it is tracked in attn["fwd"]
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            model.model(input_ids=ids, use_cache=False)
            if cuda:
                torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    if cuda:
        return seconds, max(attn["fwd"], torch.cuda.max_memory_allocated()) - base
    return seconds, rss["peak"] - rss["base"]


def measure(shape: str, mode: str, device: str, tokens: int, rows: int, reps: int) -> dict:
    """One (shape, mode) in this process: the forward's peak memory above the start, the attention modules' own
    peak, and the seconds; ``reps`` repetitions after a warm-up."""
    model, ids = _model(shape, device, tokens)
    ctx, cuda = _mode_context(model, mode, rows, tokens), device.startswith("cuda")
    times, peaks, attn_peaks = [], [], []
    with _attention_peaks(model, cuda) as attn:
        for _ in range(reps + 1):  # the first is a warm-up
            seconds, peak = _forward(model, ids, ctx, cuda, attn)
            times.append(seconds)
            peaks.append(peak)
            attn_peaks.append(attn["max"])
    return {"seconds": times[1:], "peak_bytes": peaks[1:], "attention_peak_bytes": attn_peaks[1:]}


def main() -> int:
    from artifact import begin, write

    start = begin()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rows", type=int, default=128, help="query rows per block in the blocked modes (default 128)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, no record (for the tests)")
    p.add_argument("--child", nargs=2, metavar=("SHAPE", "MODE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.dry_run:  # in the children too: they build the model
        SHAPES.update({k: {**v, "num_hidden_layers": 1} for k, v in SHAPES.items()})
        a.tokens, a.rows, a.reps, a.shapes = 512, 64, 1, ["smollm2-135m"]
    if a.child:
        print(json.dumps(measure(*a.child, a.device, a.tokens, a.rows, a.reps)))
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")])}
    raw = {"device": a.device, "tokens": a.tokens, "rows": a.rows, "reps": a.reps, "runs": {}}
    derived = {}
    for shape in a.shapes:
        for mode in MODES:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", shape, mode, "--device", a.device,
                   "--tokens", str(a.tokens), "--rows", str(a.rows), "--reps", str(a.reps), *(["--dry-run"] * a.dry_run)]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if r.returncode:
                sys.exit(f"{shape} {mode} failed:\n{r.stderr[-3000:]}")
            raw["runs"][f"{shape}/{mode}"] = json.loads(r.stdout.strip().splitlines()[-1])
            print(shape, mode, raw["runs"][f"{shape}/{mode}"], flush=True)
        run = {m: raw["runs"][f"{shape}/{m}"] for m in MODES}
        mb = {m: round(statistics.median(v["peak_bytes"]) / 2**20, 1) for m, v in run.items()}
        amb = {m: round(statistics.median(v["attention_peak_bytes"]) / 2**20, 1) for m, v in run.items()}
        sec = {m: round(statistics.median(v["seconds"]), 3) for m, v in run.items()}
        for m in MODES:
            derived[f"{shape}_{m}_peak_mb"], derived[f"{shape}_{m}_s"] = mb[m], sec[m]
            derived[f"{shape}_{m}_attention_mb"] = amb[m]
        for q in ("ours", "quant8"):
            derived[f"{shape}_{q}_memory_ratio"] = round(amb[f"{q}_unblocked"] / max(amb[f"{q}_blocked"], 0.1), 1)
            derived[f"{shape}_{q}_forward_memory_ratio"] = round(mb[f"{q}_unblocked"] / max(mb[f"{q}_blocked"], 0.1), 1)
            derived[f"{shape}_{q}_time_ratio"] = round(sec[f"{q}_blocked"] / sec[f"{q}_unblocked"], 2)
    if a.dry_run:
        print(json.dumps(derived))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    name = "attention_memory" if a.device == "cpu" else "attention_memory_cuda"
    write(name, raw, derived, start=start, notes="forward of the decoder trunk, batch 1; memory is the peak above the "
          "memory held before the forward, median over repetitions; time the median over repetitions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
