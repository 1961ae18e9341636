"""Checkpoints of a training run: optimizer/scheduler/RNG state (what ``--resume`` needs), the CSV log, and
each role exported as a Hugging Face directory with its model card. Every write is atomic."""

from __future__ import annotations

import csv
from pathlib import Path

from outlierscope.errors import OutlierscopeError
from outlierscope.io import (
    Damaged,
    atomic_dir,
    atomic_path,
    check_files,
    file_digests,
    read_record,
    write_record,
    write_text,
)
from outlierscope.train.card import model_card
from outlierscope.train.tokenizer import load_tokenizer

# data_sha256: chained sha256 (first 16 hex digits) of every training input the role's model received so far
LOG_FIELDS = ["role", "step", "tokens", "loss", "lr", "tokens_per_s", "wall_s", "val_loss", "data_sha256"]


def save_state(out: Path, models: dict, opts: dict, scheds: dict, step: int, wall: float, fed: dict) -> None:
    """Everything ``--resume`` needs, swapped in as one directory (``state/``; the previous one stays until the swap).

    Args:
        out: the run's directory.
        models: role -> model.
        opts: role -> optimizer.
        scheds: role -> scheduler.
        step: the step reached.
        wall: the wall seconds so far.
        fed: role -> the digest of the data it was fed."""
    with atomic_dir(out / "state") as tmp:
        _write_state(tmp, models, opts, scheds, step, wall, fed)


def _write_state(tmp: Path, models: dict, opts: dict, scheds: dict, step: int, wall: float, fed: dict) -> None:
    import torch

    for role in models:
        torch.save(
            {
                "model": models[role].state_dict(),
                "optimizer": opts[role].state_dict(),
                "scheduler": scheds[role].state_dict(),
                "rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
            tmp / f"{role}.pt",
        )
    files = file_digests(tmp, [f"{role}.pt" for role in models])
    write_record(tmp / "meta.json", {"step": step, "wall_s": wall, "fed": fed, "files": files})


def load_state(out: Path, models: dict, opts: dict, scheds: dict, fed: dict) -> tuple[int, float, dict]:
    """The last checkpoint, loaded into the models, optimizers and schedulers.

    Args:
        out: the run's directory.
        models: role -> model.
        opts: role -> optimizer.
        scheds: role -> scheduler.
        fed: the data digests to return when there is none.

    Returns:
        ``(step, wall seconds, data digests)``; ``(0, 0.0, fed)`` without a checkpoint."""
    import torch

    state = out / "state"
    if not (state / "meta.json").exists() and (out / "state.old" / "meta.json").exists():
        state = out / "state.old"  # a crash during the swap: the previous checkpoint is complete
    if not (state / "meta.json").exists():
        return 0, 0.0, fed
    meta = read_record(state / "meta.json", ("step", "wall_s"), "training checkpoint", sealed_only=True)
    try:
        check_files(state, meta.get("files", {}))
    except Damaged as e:
        raise Damaged(f"{e}: the checkpoint is damaged; start the run again without --resume") from None
    for role in models:
        ck = _read_role(state / f"{role}.pt")
        models[role].load_state_dict(ck["model"])
        opts[role].load_state_dict(ck["optimizer"])
        scheds[role].load_state_dict(ck["scheduler"])
        torch.set_rng_state(ck["rng_cpu"])
        if ck["rng_cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(ck["rng_cuda"])
    return meta["step"], meta["wall_s"], meta.get("fed", fed)


def _read_role(path: Path) -> dict:
    """One role's resume state: tensors and plain containers only; a file holding other objects is refused."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise OutlierscopeError(f"{path} holds Python objects other than tensors and plain containers (a pickle that "
                                "could run code when loaded): refused; start the run again without --resume") from None


def read_log(path: Path, upto_step: int) -> list[dict]:
    """The training log's rows up to a step.

    Args:
        path: the log (``log.csv``).
        upto_step: the last step kept."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if int(r["step"]) <= upto_step]


def write_log(path: Path, rows: list[dict]) -> None:
    """Write the training log, atomically.

    Args:
        path: the log.
        rows: its rows."""
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=LOG_FIELDS)
        w.writeheader()
        w.writerows(rows)


def export_role(out: Path, role: str, model, run: dict, step: int, wall: float, rows: list[dict], hardware: str) -> None:
    """Save one role as a Hugging Face directory with its tokenizer and model card, atomically.

    Args:
        out: the run's directory.
        role: ``transformer`` or ``diff``.
        model: the model.
        run: the run record.
        step: the step reached.
        wall: the wall seconds.
        rows: the training log's rows.
        hardware: what it ran on, for the card."""
    with atomic_dir(out / role) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(out / "tokenizer.json").save_pretrained(tmp)
        write_text(tmp / "README.md", model_card(role, run, step, wall, rows, hardware))
