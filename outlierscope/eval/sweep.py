"""Quantization sweep over bit widths (Figure 8): every cell is a full HellaSwag evaluation.

For each model and setting (bits, format, granularity, weights) a cell records acc, acc_norm and
their standard errors, and against the same model at 16 bits (unquantized): the accuracy
difference with a 95% paired bootstrap interval, the exact McNemar p-value, the flip rate (share
of items whose choice changed) and the mean |score change|; optionally the language-model loss
on held-out text. Each cell is written atomically when it finishes; a rerun skips cells whose
settings match and recomputes those whose settings changed.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from outlierscope.errors import OutlierscopeError
from outlierscope.eval.data import N_VALIDATION, load_hellaswag
from outlierscope.eval.hellaswag import accuracy, build_requests, lmeval_max_length, predictions
from outlierscope.eval.scorer import score_requests
from outlierscope.io import ensure_writable_dir, versions, write_csv, write_json
from outlierscope.models.loading import check_dtype
from outlierscope.quant.apply import WEIGHT_MODES, quantize_attention, quantize_weights
from outlierscope.quant.spec import QuantSpec

BOOTSTRAP_REPS = 2000
METRICS = ("acc", "acc_norm")


@dataclass(frozen=True)
class SweepSettings:
    models: tuple[str, ...] = ("pair-tiny:transformer", "pair-tiny:diff")
    bits: tuple[int, ...] = (16, 8, 6, 4)
    format: str = "int"
    granularity: str = "per_tensor"
    weights: str = "none"
    layers: tuple[int, ...] | None = None
    limit: int | None = None
    sample: int | None = None
    seed: int = 0
    data: str | None = None  # HellaSwag file; None: the cached validation set
    text: str | None = None  # held-out text for LM loss
    text_tokens: int = 65_536
    batch_size: int = 32
    dtype: str = "float32"  # of the weights and activations (load_model)

    def __post_init__(self):
        if not self.models:
            raise OutlierscopeError("no model given; pass --model SPEC (twice for a side-by-side sweep)")
        dup = sorted({m for m in self.models if self.models.count(m) > 1})
        if dup:
            raise OutlierscopeError(f"model {dup[0]} given twice; pass each --model once")
        check_dtype(self.dtype)
        if self.weights not in WEIGHT_MODES:
            raise OutlierscopeError(f"--weights must be one of {', '.join(WEIGHT_MODES)}, got {self.weights!r}")
        for n, v in (("--limit", self.limit), ("--sample", self.sample)):
            if v is not None and not 0 < v <= N_VALIDATION:
                raise OutlierscopeError(f"{n} must be in 1..{N_VALIDATION}, got {v}")
        if self.limit is not None and self.sample is not None:
            raise OutlierscopeError("--limit and --sample exclude each other; pass one")
        if self.batch_size <= 0:
            raise OutlierscopeError(f"--batch-size must be positive, got {self.batch_size}")
        if self.text_tokens <= 0:
            raise OutlierscopeError(f"--text-tokens must be positive, got {self.text_tokens}")
        for b in self.bits:  # validate every spec up front: nothing runs with a bad one
            try:
                self.spec(b)
            except ValueError as e:
                raise OutlierscopeError(str(e)) from None

    def spec(self, bits: int) -> QuantSpec:
        if bits == 16:  # unquantized: format, granularity and layers do not apply
            return QuantSpec(bits=16)
        return QuantSpec(bits=bits, format=self.format, granularity=self.granularity, layers=self.layers)


def layout_for(spec: QuantSpec) -> str:
    """Prefix sharing is exact only when each attention row depends on its own keys alone."""
    return "shared" if spec.is_identity or spec.granularity == "per_row" else "separate"


def cell_settings(model: str, weights_sha: str, spec: QuantSpec, s: SweepSettings, items_sha: str) -> dict:
    ident = spec.is_identity
    return {"model": model, "weights_sha256": weights_sha, "bits": spec.bits, "format": None if ident else spec.format,
            "granularity": None if ident else spec.granularity, "layers": list(spec.layers) if spec.layers else None,
            "weights": s.weights, "dtype": s.dtype, "items_sha256": items_sha, "text": s.text,
            "text_tokens": s.text_tokens if s.text else None}


def cell_id(settings: dict) -> str:
    blob = json.dumps(settings, sort_keys=True).encode()
    slug = f"{settings['model'].replace(':', '-').replace('/', '_')}_b{settings['bits']}"
    return f"{slug}_{hashlib.sha256(blob).hexdigest()[:10]}"


def select_items(s: SweepSettings):
    items = load_hellaswag(s.data)
    if s.limit is not None:
        if s.limit > len(items):
            raise OutlierscopeError(f"--limit {s.limit} exceeds the {len(items)} items available")
        items = items[: s.limit]
    elif s.sample is not None:
        if s.sample > len(items):
            raise OutlierscopeError(f"--sample {s.sample} exceeds the {len(items)} items available")
        idx = np.sort(np.random.default_rng(s.seed).choice(len(items), s.sample, replace=False))
        items = [items[i] for i in idx]
    return items


def items_digest(items) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps([it.index, it.activity_label, it.ctx_a, it.ctx_b, list(it.endings), it.label]).encode())
    return h.hexdigest()


# -- statistics --------------------------------------------------------------------------------


def paired_bootstrap(a: np.ndarray, b: np.ndarray, reps: int = BOOTSTRAP_REPS, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of mean(b - a) over items resampled with replacement (seeded)."""
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(reps)
    for i in range(0, reps, 200):
        k = min(200, reps - i)
        idx = rng.integers(0, len(d), (k, len(d)))
        means[i : i + k] = d[idx].mean(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def mcnemar_exact(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided exact McNemar p-value for paired 0/1 outcomes (binomial test on discordant pairs)."""
    from scipy.stats import binomtest

    a, b = np.asarray(a, bool), np.asarray(b, bool)
    n01 = int((a & ~b).sum())
    n10 = int((~a & b).sum())
    if n01 + n10 == 0:
        return 1.0
    return float(binomtest(n01, n01 + n10, 0.5).pvalue)


def cell_metrics(res: pd.DataFrame, base: pd.DataFrame | None, seed: int) -> dict:
    out = {}
    for m, pcol in (("acc", "pred"), ("acc_norm", "pred_norm")):
        correct = (res[pcol] == res["label"]).to_numpy()
        out[m], out[f"{m}_stderr"] = accuracy(correct)
        if base is not None:
            bc = (base[pcol] == base["label"]).to_numpy()
            out[f"{m}_delta"] = float(correct.mean() - bc.mean())
            out[f"{m}_ci_low"], out[f"{m}_ci_high"] = paired_bootstrap(bc, correct, seed=seed)
            out[f"{m}_mcnemar_p"] = mcnemar_exact(bc, correct)
            out[f"flip_rate{'' if m == 'acc' else '_norm'}"] = float((res[pcol].to_numpy() != base[pcol].to_numpy()).mean())
    if base is not None:
        cols = [f"score{j}" for j in range(4)]
        out["mean_abs_score_change"] = float(np.abs(res[cols].to_numpy() - base[cols].to_numpy()).mean())
    return out


# -- running -----------------------------------------------------------------------------------


def lm_loss(model, seqs, batch_size: int) -> float:
    """Mean next-token loss (nats/token) over packed sequences (N, T)."""
    import torch

    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(seqs), batch_size):
            x = seqs[i : i + batch_size]
            logits = model(input_ids=x, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),  # (B*(T-1), V)
                                                       x[:, 1:].reshape(-1), reduction="sum").item()  # (B*(T-1),)
            n += x[:, 1:].numel()
    return total / n


@dataclass
class SweepRun:
    settings: SweepSettings
    out: Path
    cells: list[dict] = field(default_factory=list)


def run_cell(lm, requests, spec: QuantSpec, s: SweepSettings, text_seqs, desc: str, progress: bool) -> tuple[pd.DataFrame, dict]:
    from tqdm.auto import tqdm

    layout = layout_for(spec)
    t0 = time.time()
    with tqdm(total=len(requests), desc=desc, unit="item", disable=not progress or None, dynamic_ncols=True) as bar:
        def tick(done):
            bar.update(done - bar.n)

        with quantize_attention(lm.model, spec):
            scores = score_requests(lm.model, requests, layout, s.batch_size, tick)
            loss = lm_loss(lm.model, text_seqs, s.batch_size) if text_seqs is not None else None
    wall = time.time() - t0
    bad = np.flatnonzero(~np.isfinite(scores).all(axis=1))
    if len(bad):
        raise OutlierscopeError(
            f"{desc}: {len(bad)} of {len(requests)} items got non-finite log-likelihoods (first: item "
            f"{requests[bad[0]].index}); the model outputs NaN or inf: check its weights and dtype"
        )
    lens = [[len(c) for c in r.conts] for r in requests]
    chars = [r.choice_chars for r in requests]
    pred, pred_norm = predictions(scores, chars)
    df = pd.DataFrame({"index": [r.index for r in requests], "label": [r.label for r in requests]})
    for j in range(4):
        df[f"score{j}"] = scores[:, j]
    for j in range(4):
        df[f"tokens{j}"] = [ln[j] for ln in lens]
    df["pred"], df["pred_norm"] = pred, pred_norm
    return df, {"seconds": round(wall, 2), "items_per_s": round(len(requests) / max(wall, 1e-9), 2),
                "layout": layout, "lm_loss": loss}


def _load_or_run_cell(lm, requests, spec: QuantSpec, s: SweepSettings, text_seqs, settings: dict, cells_dir: Path,
                      progress: bool, log) -> tuple[pd.DataFrame, dict]:
    """A cell's per-item results and facts: read back when a complete cell with these settings exists, else run."""
    cid = cell_id(settings)
    meta_path, res_path = cells_dir / f"{cid}.json", cells_dir / f"{cid}.csv"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() and res_path.exists() else None
    if meta is not None and meta.get("settings") == settings:
        log(f"{settings['model']} {spec.label}: done earlier, skipped ({cid})")
        return pd.read_csv(res_path), {**meta, "cell": cid}
    res, facts = run_cell(lm, requests, spec, s, text_seqs, f"{settings['model']} {spec.label}", progress)
    write_csv(res_path, res)
    meta = {"settings": settings, "label": spec.label, **facts}
    write_json(meta_path, meta)  # written last: marks the cell complete
    return res, {**meta, "cell": cid}


def _tidy_rows(model: str, bits: int, spec: QuantSpec, s: SweepSettings, metrics: dict, n_items: int, cid: str) -> list[dict]:
    """One row per metric (value, stderr, change vs 16 bits with its interval and McNemar p)."""
    rows = []
    for m, v in metrics.items():
        if m.endswith(("_stderr", "_ci_low", "_ci_high", "_mcnemar_p", "_delta")):
            continue
        rows.append({"model": model, "bits": bits, "label": spec.label, "format": spec.format,
                     "granularity": spec.granularity if bits != 16 else "none", "weights": s.weights,
                     "metric": m, "value": v, "stderr": metrics.get(f"{m}_stderr"),
                     "delta_vs_16": metrics.get(f"{m}_delta"), "ci_low": metrics.get(f"{m}_ci_low"),
                     "ci_high": metrics.get(f"{m}_ci_high"), "mcnemar_p": metrics.get(f"{m}_mcnemar_p"),
                     "n_items": n_items, "cell": cid})
    return rows


def sweep(s: SweepSettings, out: str | Path, progress: bool = True, log=print) -> pd.DataFrame:
    """Run (or resume) a sweep into ``out``; returns the tidy result table (also written as sweep.csv)."""
    from outlierscope.analysis.text import pack_sequences, text_documents
    from outlierscope.models.loading import load_model

    out = ensure_writable_dir(out)
    cells_dir = out / "cells"
    cells_dir.mkdir(exist_ok=True)
    items = select_items(s)
    digest = items_digest(items)
    rows, cell_index = [], []
    for spec_str in s.models:
        lm = load_model(spec_str, dtype=s.dtype)
        if s.weights != "none":
            quantize_weights(lm.model, s.weights)
        wsha = lm.weights_sha256()
        requests = build_requests(items, lm.tokenizer, lmeval_max_length(lm.model, lm.tokenizer))
        text_seqs = None
        if s.text:
            from outlierscope.analysis.profile import resolve_seq_len

            text_seqs = pack_sequences(lm.tokenizer, text_documents(s.text), resolve_seq_len(lm.model, None), s.text_tokens)
        base = None
        for b in sorted(set(s.bits) | {16}, key=lambda b: -b):  # the 16-bit reference first
            spec = s.spec(b)
            settings = cell_settings(spec_str, wsha, spec, s, digest)
            res, meta = _load_or_run_cell(lm, requests, spec, s, text_seqs, settings, cells_dir, progress, log)
            if b == 16:
                base = res
            metrics = cell_metrics(res, None if b == 16 else base, s.seed)
            if meta.get("lm_loss") is not None:
                metrics["lm_loss"] = meta["lm_loss"]
            cell_index.append({"cell": meta["cell"], "model": spec_str, "bits": b, "label": spec.label, **metrics,
                               "seconds": meta["seconds"], "items_per_s": meta["items_per_s"]})
            rows += _tidy_rows(spec_str, b, spec, s, metrics, len(items), meta["cell"])
    table = pd.DataFrame(rows)
    write_csv(out / "sweep.csv", table)
    write_json(out / "sweep.json", {"settings": asdict(s), "n_items": len(items), "items_sha256": digest,
                                    "bootstrap_reps": BOOTSTRAP_REPS, "cells": cell_index, "versions": versions(),
                                    "note": "bits 16 = unquantized"})
    return table


def sweep_table(table: pd.DataFrame) -> str:
    """Markdown: one row per model and bit width with acc, acc_norm (stderr), change vs 16 bits, CI, p, flips."""
    lines = ["| Model | Bits | acc | acc_norm | Δacc_norm vs 16 [95% CI] | McNemar p | flip rate | mean abs Δscore |"
             + (" LM loss |" if "lm_loss" in set(table["metric"]) else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if "lm_loss" in set(table["metric"]) else "")]
    for (model, bits), g in table.groupby(["model", "bits"], sort=False):
        m = {r["metric"]: r for _, r in g.iterrows()}
        acc, accn = m["acc"], m["acc_norm"]
        if bits == 16:
            delta, p, flip, ds = "reference", "", "", ""
        else:
            delta = f"{accn['delta_vs_16'] * 100:+.2f} [{accn['ci_low'] * 100:+.2f}, {accn['ci_high'] * 100:+.2f}]"
            p = f"{accn['mcnemar_p']:.3g}"
            flip = f"{m['flip_rate_norm']['value'] * 100:.2f}%"
            ds = f"{m['mean_abs_score_change']['value']:.3g}"
        line = (f"| {model} | {acc['label']} | {acc['value'] * 100:.2f} ± {acc['stderr'] * 100:.2f} | "
                f"{accn['value'] * 100:.2f} ± {accn['stderr'] * 100:.2f} | {delta} | {p} | {flip} | {ds} |")
        if "lm_loss" in m:
            line += f" {m['lm_loss']['value']:.4f} |"
        lines.append(line)
    return "\n".join(lines) + "\n"
