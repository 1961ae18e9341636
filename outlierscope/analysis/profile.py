"""Profile activation outliers of one or more models (``outlierscope profile``)."""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch

from outlierscope.analysis.outliers import KIND_LABEL, TABLE5_RANKS, OutlierStats
from outlierscope.analysis.text import pack_sequences, shuffled, text_documents
from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.capture import capture
from outlierscope.io import ensure_writable_dir, versions, write_csv, write_json, write_text


@dataclass(frozen=True)
class ProfileSettings:
    tokens: int = 400_000
    text: str = "hellaswag"
    seq_len: int | None = None  # None: min(model context, 256)
    batch_size: int = 8
    seed: int = 0
    k: int = 100
    points: tuple[str, ...] = ("layers.*.attn.logits", "layers.*.hidden")
    dtype: str = "float32"  # of the weights and activations (load_model)


def resolve_seq_len(model, seq_len: int | None) -> int:
    ctx = getattr(model.config, "max_position_embeddings", None) or 2048
    if seq_len is None:
        return min(ctx, 256)
    if seq_len <= 0:
        raise OutlierscopeError(f"--seq-len must be positive, got {seq_len}")
    if seq_len > ctx:
        raise OutlierscopeError(f"--seq-len {seq_len} exceeds the model's context of {ctx} tokens")
    return seq_len


@torch.no_grad()
def profile_model(lm, settings: ProfileSettings, progress: bool = True) -> tuple[OutlierStats, dict]:
    """Stream ``settings.tokens`` tokens of text through ``lm`` and return its statistics and run facts."""
    from tqdm.auto import tqdm

    if settings.tokens <= 0:
        raise OutlierscopeError(f"--tokens must be positive, got {settings.tokens}")
    if settings.batch_size <= 0:
        raise OutlierscopeError(f"--batch-size must be positive, got {settings.batch_size}")
    seq_len = resolve_seq_len(lm.model, settings.seq_len)
    seqs = pack_sequences(lm.tokenizer, shuffled(text_documents(settings.text), settings.seed), seq_len, settings.tokens)
    stats = OutlierStats.for_model(lm.model, seq_len, k=settings.k)
    n_tok = seqs.numel()
    t0 = time.time()
    with tqdm(total=n_tok, desc=f"profile {lm.name}", unit="tok", unit_scale=True, disable=not progress or None) as bar:
        with capture(lm.model, list(settings.points), reducers=[stats]):
            for i in range(0, len(seqs), settings.batch_size):
                batch = seqs[i : i + settings.batch_size]
                lm.model(input_ids=batch, attention_mask=torch.ones_like(batch), use_cache=False)
                bar.update(batch.numel())
    wall = time.time() - t0
    facts = {"spec": lm.spec, "path": str(lm.path), "model_type": lm.model_type, "weights_sha256": lm.weights_sha256(),
             "tokens": n_tok, "sequences": len(seqs), "seq_len": seq_len, "tokens_requested": settings.tokens,
             "seconds": round(wall, 2), "tokens_per_s": round(n_tok / max(wall, 1e-9), 1),
             "n_layers": stats.n_layers, "n_heads": stats.n_heads, "is_diff": stats.is_diff}
    return stats, facts


def table5_frame(results: dict[str, OutlierStats]) -> pd.DataFrame:
    frames = []
    for name, st in results.items():
        df = st.table5()
        df.insert(0, "model", name)
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def table5_markdown(df: pd.DataFrame, facts: dict) -> str:
    head = "| Model | Activation Type | " + " | ".join(f"Top-{r}" for r in TABLE5_RANKS) + " | Median |"
    lines = [head, "|" + "---|" * (len(TABLE5_RANKS) + 3)]
    for _, r in df.iterrows():
        vals = " | ".join(f"{r[f'top{k}']:.2f}" for k in TABLE5_RANKS)
        lines.append(f"| {r['model']} | {r['activation']} | {vals} | {r['median']:.3f} |")
    ntok = ", ".join(f"{m}: {f['tokens']:,} tokens" for m, f in facts.items())
    return (
        "Largest |activation| values (k-th largest, pooled over all layers, heads and valid positions) "
        f"and the median |activation| ({ntok}).\n"
        "Attention logits are pre-softmax (q k^T * scaling, both maps of each differential head); masked (future) "
        "entries are excluded. Hidden states are the decoder layers' outputs after both residual additions. "
        "Medians come from a log-spaced histogram (relative error <= 0.5%).\n\n" + "\n".join(lines) + "\n"
    )


def write_profile(out: str | Path, results: dict[str, OutlierStats], facts: dict, settings: ProfileSettings) -> Path:
    """Write every result file into ``out``: staged in a temporary directory, then moved in file by file
    (each rename atomic), ``profile.json`` last."""

    out = ensure_writable_dir(out)
    stage = Path(tempfile.mkdtemp(prefix=".profile-", dir=out))
    try:
        t5 = table5_frame(results)
        write_csv(stage / "table5.csv", t5)
        write_text(stage / "table5.md", table5_markdown(t5, facts))
        for fname, getter in [("per_layer.csv", "per_layer"), ("per_head.csv", "per_head"),
                              ("per_channel.csv", "per_channel"), ("histograms.csv", "histograms"),
                              ("outlier_features.csv", "outlier_features"), ("massive_activations.csv", "massive_activations")]:
            frames = []
            for name, st in results.items():
                df = getattr(st, getter)()
                if not df.empty:
                    df.insert(0, "model", name)
                    frames.append(df)
            write_csv(stage / fname, pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({"model": []}))
        for kind, fname in (("attn.logits", "topk_logits.csv"), ("hidden", "topk_hidden.csv")):
            frames = []
            for name, st in results.items():
                df = st.topk_frame(kind)
                if not df.empty:
                    df.insert(0, "model", name)
                    frames.append(df)
            if frames:
                write_csv(stage / fname, pd.concat(frames, ignore_index=True))
        lam = lambda_frame(facts)
        if not lam.empty:
            write_csv(stage / "lambda.csv", lam)
        meta = {"settings": asdict(settings), "models": facts, "versions": versions(),
                "median_rel_error_bound": next(iter(results.values())).bins.rel_error_bound,
                "activation_types": KIND_LABEL, "excluded": "masked (future/padding/out-of-window) logits, padding tokens"}
        write_json(stage / "profile.json", meta)
        for f in sorted(stage.iterdir(), key=lambda p: p.name == "profile.json"):
            f.replace(out / f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def lambda_frame(facts: dict) -> pd.DataFrame:
    """lambda_init and learned lambda per layer for the Diff models among the profiled ones."""
    rows = []
    for name, f in facts.items():
        for layer, (lam_init, lam) in enumerate(f.get("lambda", [])):
            rows.append({"model": name, "layer": layer, "lambda_init": lam_init, "lambda": lam})
    return pd.DataFrame(rows)


@torch.no_grad()
def diff_lambdas(model) -> list[tuple[float, float]]:
    """(lambda_init, lambda_full) per layer of a DiffLlama model; empty for other models."""
    from outlierscope.hooks.points import decoder_layers

    out = []
    for layer in decoder_layers(model):
        a = getattr(layer, "self_attn", None)
        if a is None or not hasattr(a, "lambda_q1"):
            return []
        lam = (torch.exp((a.lambda_q1 * a.lambda_k1).sum()) - torch.exp((a.lambda_q2 * a.lambda_k2).sum()) + a.lambda_init)
        out.append((float(a.lambda_init), float(lam)))
    return out


def profile(specs: list[str], settings: ProfileSettings, out: str | Path, progress: bool = True) -> tuple[pd.DataFrame, dict]:
    """Load and profile each model, write the results into ``out``; returns Table 5 and the per-model facts."""
    from outlierscope.models.loading import load_model

    if not specs:
        raise OutlierscopeError("no model given; pass --model SPEC (e.g. pair-tiny:diff or a model directory)")
    ensure_writable_dir(out)
    results, facts = {}, {}
    for spec in specs:
        lm = load_model(spec, dtype=settings.dtype)
        stats, f = profile_model(lm, settings, progress)
        f["lambda"] = diff_lambdas(lm.model)
        name = lm.name if lm.name not in results else spec
        results[name], facts[name] = stats, f
    write_profile(out, results, facts, settings)
    return table5_frame(results), facts
