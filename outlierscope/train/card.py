"""The model card (README.md) of each trained role: preset, tokens, losses, hardware, decontamination, command."""

from __future__ import annotations

from pathlib import Path

from outlierscope.models.presets import ROLES, PairConfig


def _last(rows: list[dict], role: str, key: str):
    vals = [r[key] for r in rows if r["role"] == role and r.get(key) not in (None, "")]
    return vals[-1] if vals else None


def _precision_line(precision: str) -> str:
    if precision == "bf16":
        return "bf16 autocast for the forward pass; fp32 weights, gradients and AdamW state"
    return "fp32 throughout"


def model_card(role: str, run: dict, step: int, wall: float, rows: list[dict], hardware: str) -> str:
    """The model card (``README.md``) of a trained role: its architecture, data, optimizer, losses and status.

    Args:
        role: ``transformer`` or ``diff``.
        run: the run record.
        step: the step reached.
        wall: the wall seconds.
        rows: the training log's rows.
        hardware: what it ran on."""
    cfg = PairConfig.from_dict(run["preset"])
    steps = run["steps"]
    tokens = step * run["tokens_per_step"]
    cls = "LlamaForCausalLM" if role == "transformer" else "DiffLlamaForCausalLM"
    status = "finished" if step >= steps else f"IN PROGRESS: step {step} of {steps} (resume with `--resume`)"
    vals = {r: _last(rows, r, "val_loss") for r in ROLES}
    if all(v is not None for v in vals.values()):
        a, b = float(vals["transformer"]), float(vals["diff"])
        lower = "transformer" if a < b else "diff"
        comparison = (
            f"At the last evaluation the **{lower}** model reached the lower validation loss "
            f"(transformer {a:.4f}, diff {b:.4f} nats/token; difference {abs(a - b):.4f})."
        )
    else:
        comparison = "No validation loss recorded yet."
    dc = run["decontamination"]
    dc_line = (
        f"{dc['items_with_overlap']} of {dc['items']} HellaSwag validation items share a {dc['ngram']}-gram "
        "(lowercased, whitespace-normalised words) of their context or an ending with the training text."
        if dc.get("items_with_overlap") is not None
        else dc.get("note", "not computed")
    )
    return f"""# {cfg.name}:{role}

A `{cls}` trained by `outlierscope train` as one half of the matched pair `{cfg.name}`
(Transformer and Diff Transformer with identical data order, seed, schedule and
hyperparameters; they differ in the attention class only).

| | |
|---|---|
| status | {status} |
| preset | `{cfg.name}`: {cfg.n_layers} layers, hidden {cfg.hidden_size}, {cfg.n_heads} heads of {cfg.head_dim} ({f'{cfg.n_heads // 2} differential heads' if role == 'diff' else 'standard softmax attention'}), SwiGLU {cfg.intermediate_size}, vocab {cfg.vocab_size}, context {cfg.seq_len} |
| parameters | {cfg.n_params(role):,} |
| tokens seen | {tokens:,} |
| steps | {step:,} of {steps:,} (batch {cfg.batch_size} x {cfg.seq_len} tokens) |
| optimizer | AdamW lr {cfg.lr}, betas {cfg.betas}, weight decay {cfg.weight_decay}, warmup {cfg.warmup_steps} steps, cosine to {cfg.min_lr_ratio}x, clip {cfg.grad_clip} |
| final training loss | {_last(rows, role, 'loss') or 'n/a'} nats/token |
| final validation loss | {_last(rows, role, 'val_loss') or 'n/a'} nats/token ({run['val_tokens']:,} held-out tokens) |
| wall time (both models, interleaved) | {wall / 60:.1f} min |
| hardware | {hardware} |
| precision | {_precision_line(run.get('precision', 'fp32'))} |
| decontamination | {dc_line} |
| versions | {', '.join(f'{k} {v}' for k, v in run['versions'].items())} |

{comparison}

Training data: the `text` of {run['train_pool_docs']:,} documents ({run['train_pool_tokens']:,} tokens) read in order from
{', '.join(Path(c).name for c in run['args']['corpus'])}; validation: {', '.join(Path(c).name for c in run['args']['val_corpus']) or 'none'}.
The text itself is not shipped.

Command:

```
{run['args'].get('command') or 'outlierscope train ...'}
```

The log of the run is `../train_log.csv`.
"""
