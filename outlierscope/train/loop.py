"""`outlierscope train`: both models of a preset, identical data order, seed and schedule.

The two models are trained interleaved, step by step, on the very same batches: the only
difference between them is the attention class. A run directory holds::

    tokenizer.json           byte-level BPE shared by both models
    transformer/ diff/       Hugging Face checkpoints (safetensors) + tokenizer + model card
    train_log.csv            step, tokens, loss, lr, tokens/s, wall, val_loss (one row per role and log step)
    run.json                 every setting, the corpus, token counts, decontamination
    state/                   optimizer, scheduler, RNG and step of each model: what --resume needs
    data/                    the tokenized training and validation text (uint16), not for shipping

Resume is bit-for-bit: data position is a pure function of the step (a seeded permutation
of packed sequences), and the state directory is swapped in atomically.
"""

from __future__ import annotations

import hashlib
import math
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from outlierscope.data.corpus import check_corpus, iter_documents
from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.io import output_dir, read_record, versions, write_record
from outlierscope.models.presets import ROLES, PairConfig
from outlierscope.train.checkpoint import export_role, load_state, read_log, save_state, write_log
from outlierscope.train.data import PackedData, tokenize_to_file
from outlierscope.train.decontam import NgramIndex
from outlierscope.train.tokenizer import train_bpe

PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(device: str, precision: str) -> str:
    """The training precision: ``auto`` is bf16 autocast on CUDA and fp32 on the CPU; fp32 and bf16 as given.

    Args:
        device: ``cpu`` or ``cuda``.
        precision: ``auto``, ``fp32`` or ``bf16``."""
    if precision not in PRECISIONS:
        raise ParamError("precision", f"one of {', '.join(PRECISIONS)}", precision)
    if precision == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return precision


def autocast_for(device: str, precision: str):
    """The forward pass's autocast: bf16 (weights, gradients and optimizer stay fp32), or none.

    Args:
        device: the device type.
        precision: ``fp32`` or ``bf16``."""
    import torch

    return torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16")


@dataclass(frozen=True)
class TrainArgs:
    """The settings of one training run of a matched pair (``outlierscope train``).

    Attributes:
        preset: the pair's ``PairConfig`` preset.
        corpus: the training text files.
        tokens: training tokens per model.
        out: the run's directory.
        val_corpus: held-out text files for the validation loss.
        device: ``cpu`` or ``cuda``.
        precision: ``auto`` (bf16 autocast on CUDA, fp32 on the CPU), ``fp32`` or ``bf16``.
        seed: the seed of the initialisation and the data order.
        resume: continue the run in ``out``.
        eval_every: steps between validation losses.
        val_tokens: held-out tokens.
        log_every: steps between log lines.
        ckpt_minutes: minutes between checkpoints.
        tokenizer_chars: characters the BPE tokenizer is trained on.
        stop_at_step: stop (resumably) at this step.
        time_limit_minutes: stop (resumably) after this long.
        threads: torch's CPU threads; None: its default.
        command: the command line, for the record.
        extra: settings a caller adds (not recorded)."""
    preset: str
    corpus: tuple[str, ...]
    tokens: int
    out: str
    val_corpus: tuple[str, ...] = ()
    device: str = "cpu"
    precision: str = "auto"
    seed: int = 0
    resume: bool = False
    eval_every: int = 250
    val_tokens: int = 131_072
    log_every: int = 10
    ckpt_minutes: float = 10.0
    tokenizer_chars: int = 50_000_000
    stop_at_step: int | None = None
    time_limit_minutes: float | None = None
    threads: int | None = None
    command: str = ""
    extra: dict = field(default_factory=dict)


def _lr_lambda(cfg: PairConfig, total_steps: int):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _optimizer(model, cfg: PairConfig):
    import torch

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas, eps=1e-8, fused=False, foreach=False,
    )


def _check_args(args: TrainArgs, cfg: PairConfig) -> Path:
    out = Path(args.out)
    per_step = cfg.batch_size * cfg.seq_len
    if args.tokens < per_step:
        raise ParamError("tokens", f"at least one batch ({cfg.batch_size} x {cfg.seq_len} = {per_step} tokens)", args.tokens)
    check_corpus(list(args.corpus))
    if args.val_corpus:
        check_corpus(list(args.val_corpus))
    if args.resume:
        if not (out / "run.json").exists():
            raise OutlierscopeError(f"{out} holds no training run (no run.json) to resume; start a new run there instead")
    elif out.exists() and any(out.iterdir()):
        raise OutlierscopeError(f"output directory {out} exists and is not empty; resume the run in it or choose a new output directory")
    if args.device not in ("cpu", "cuda"):
        raise ParamError("device", "cpu or cuda", args.device)
    resolve_precision(args.device, args.precision)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ParamError("device", "cpu: no CUDA device is available here", args.device)
    return out


def _hardware(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def prepare(args: TrainArgs, cfg: PairConfig, out: Path) -> dict:
    """The tokenizer, token files and decontamination of a new run.

    Args:
        args: the run's settings.
        cfg: the pair's config.
        out: the run's directory.

    Returns:
        The run record."""
    from outlierscope.data.hellaswag import hellaswag_path, load_hellaswag

    if next(iter_documents(list(args.corpus)), None) is None:
        raise OutlierscopeError(f"the corpus ({', '.join(args.corpus)}) holds no text, only blank lines or empty "
                                "documents; pass files with text")
    out.mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(exist_ok=True)
    t0 = time.time()
    tok = train_bpe(iter_documents(list(args.corpus)), cfg.vocab_size, args.tokenizer_chars)
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    steps = math.ceil(args.tokens / (cfg.batch_size * cfg.seq_len))
    need = steps * cfg.batch_size * (cfg.seq_len + 1)

    index = None
    if hellaswag_path().exists():
        index = NgramIndex.from_hellaswag(load_hellaswag())
    n_train, n_docs = tokenize_to_file(
        tok, iter_documents(list(args.corpus)), out / "data" / "train.bin", need, on_doc=index.scan if index else None
    )
    n_val = n_val_docs = 0
    if args.val_corpus:
        n_val, n_val_docs = tokenize_to_file(tok, iter_documents(list(args.val_corpus)), out / "data" / "val.bin", args.val_tokens)
    for path, n in ((out / "data" / "train.bin", n_train), (out / "data" / "val.bin", n_val)):
        if n or path.name == "train.bin":
            PackedData(path, cfg.seq_len, cfg.batch_size, args.seed)  # at least one batch, checked before run.json exists
    decontam = (
        {"ngram": index.n, "items_with_overlap": len(index.hits), "items": index.n_items, "overlap_items": sorted(index.hits)}
        if index
        else {"ngram": 13, "items_with_overlap": None, "note": "not computed: HellaSwag data not cached (run `outlierscope data fetch`)"}
    )
    run = {
        "preset": cfg.to_dict(),
        "args": {k: v for k, v in asdict(args).items() if k not in ("resume", "extra")},
        "precision": resolve_precision(args.device, args.precision),
        "steps": steps,
        "tokens_per_step": cfg.batch_size * cfg.seq_len,
        "train_pool_tokens": n_train,
        "train_pool_docs": n_docs,
        "val_tokens": n_val,
        "val_docs": n_val_docs,
        "decontamination": decontam,
        "prepare_seconds": round(time.time() - t0, 1),
        "versions": versions(),
    }
    write_record(out / "run.json", run)
    return run


def _open_run(args: TrainArgs, cfg: PairConfig, out: Path) -> dict:
    """The run record: read back (and checked against ``args``) on --resume, else prepared from the corpus."""
    if not args.resume:
        with output_dir(out):
            try:
                return prepare(args, cfg, out)
            except BaseException:
                for child in out.iterdir():  # nothing half-written: --out is empty again (or gone, if it was new)
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
                raise
    run = read_record(out / "run.json", ("preset", "args"), "training run record", sealed_only=True)
    if run["preset"] != cfg.to_dict() or run["args"]["tokens"] != args.tokens or run["args"]["seed"] != args.seed:
        raise OutlierscopeError(
            f"--resume: {out} was started with another preset, --tokens or --seed; resume with the same settings"
        )
    started, now = run.get("precision", "fp32"), resolve_precision(args.device, args.precision)
    if now != started:
        raise ParamError("precision", f"{started}, the precision {out} was trained with", now)
    return run


class _Pair:
    """Both models of a pair with their optimizers and schedulers, stepped on the same batches."""

    def __init__(self, cfg: PairConfig, seed: int, steps: int, device: str, precision: str):
        import torch

        self.cfg, self.precision = cfg, precision
        self.dev = torch.device(device)
        self.models, self.opts, self.scheds = {}, {}, {}
        self.fed = {role: "" for role in ROLES}  # chained sha256 of every training input each model received
        for role in ROLES:
            self.models[role] = cfg.build(role, seed=seed).to(self.dev).train()
            self.opts[role] = _optimizer(self.models[role], cfg)
            self.scheds[role] = torch.optim.lr_scheduler.LambdaLR(self.opts[role], _lr_lambda(cfg, steps))

    def loss(self, role: str, batch: np.ndarray, record: bool = False):
        import torch

        x = torch.from_numpy(batch).to(self.dev)  # (B, S+1)
        inputs = x[:, :-1]  # (B, S)
        if record:  # what this model is fed, chained over steps: proves both roles saw the same data
            self.fed[role] = hashlib.sha256(self.fed[role].encode() + inputs.cpu().numpy().tobytes()).hexdigest()
        with autocast_for(self.dev.type, self.precision):
            logits = self.models[role](input_ids=inputs).logits  # (B, S, V)
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))  # (B*S, V)

    def step(self, batch: np.ndarray) -> dict[str, float]:
        """One optimizer step of each model on ``batch``; returns the training losses."""
        import torch

        losses = {}
        for role in ROLES:
            loss = self.loss(role, batch, record=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.models[role].parameters(), self.cfg.grad_clip)
            self.opts[role].step()
            self.scheds[role].step()
            self.opts[role].zero_grad(set_to_none=True)
            losses[role] = loss.item()
        return losses

    def evaluate(self, role: str, val: PackedData) -> float:
        """Mean validation loss over the fixed validation batches."""
        import torch

        model = self.models[role]
        n = val.n_seq // self.cfg.batch_size
        model.eval()
        with torch.no_grad():
            total = sum(self.loss(role, val.in_order(i)).item() for i in range(n))
        model.train()
        return total / max(1, n)

    def lr(self, role: str) -> float:
        return self.scheds[role].get_last_lr()[0]


def train(args: TrainArgs) -> dict:
    """Train (or resume) both models of a preset on the same batches.

    Args:
        args: the run's settings.

    Returns:
        A summary: the steps done and planned, the wall time, why it stopped, the directory."""
    import torch
    import transformers
    from tqdm.auto import tqdm

    transformers.utils.logging.disable_progress_bar()

    cfg = PairConfig.from_name(args.preset)
    out = _check_args(args, cfg)
    if args.threads:
        torch.set_num_threads(args.threads)
    run = _open_run(args, cfg, out)
    steps = run["steps"]
    data = PackedData(out / "data" / "train.bin", cfg.seq_len, cfg.batch_size, args.seed)
    val = PackedData(out / "data" / "val.bin", cfg.seq_len, cfg.batch_size, args.seed) if run["val_tokens"] else None
    pair = _Pair(cfg, args.seed, steps, args.device, run.get("precision", "fp32"))
    start, wall0, pair.fed = load_state(out, pair.models, pair.opts, pair.scheds, pair.fed)
    log_path = out / "train_log.csv"
    rows = read_log(log_path, start)
    hardware = _hardware(args.device)
    stop = min(steps, args.stop_at_step) if args.stop_at_step is not None else steps
    tokens_per_step = cfg.batch_size * cfg.seq_len

    def checkpoint(step: int, wall: float) -> None:
        save_state(out, pair.models, pair.opts, pair.scheds, step, wall, pair.fed)
        for role in ROLES:
            export_role(out, role, pair.models[role], run, step, wall, rows, hardware)

    t_start = last_ckpt = t_log = time.time()
    acc = {r: 0.0 for r in ROLES}  # summed training losses since the last log row
    n_acc = 0
    bar = tqdm(total=steps, initial=start, desc=f"train {cfg.name}", unit="step", dynamic_ncols=True, disable=None)
    step = start
    reason = "finished"
    try:
        while step < stop:
            for role, loss in pair.step(data.batch(step)).items():
                acc[role] += loss
            n_acc += 1
            step += 1
            bar.update(1)
            do_eval = val is not None and (step % args.eval_every == 0 or step == steps)
            if step % args.log_every == 0 or step == stop or do_eval:
                now = time.time()
                tps = n_acc * tokens_per_step * len(ROLES) / max(now - t_log, 1e-9)
                vals = {r: pair.evaluate(r, val) for r in ROLES} if do_eval else {}
                rows += [{
                    "role": role, "step": step, "tokens": step * tokens_per_step,
                    "loss": f"{acc[role] / n_acc:.5f}", "lr": f"{pair.lr(role):.6g}",
                    "tokens_per_s": f"{tps:.0f}", "wall_s": f"{wall0 + now - t_start:.1f}",
                    "val_loss": f"{vals[role]:.5f}" if role in vals else "",
                    "data_sha256": pair.fed[role][:16],
                } for role in ROLES]
                write_log(log_path, rows)
                bar.set_postfix({**{f"loss_{r[0]}": f"{acc[r] / n_acc:.3f}" for r in ROLES}, "tok/s": f"{tps:.0f}"})
                acc, n_acc, t_log = {r: 0.0 for r in ROLES}, 0, time.time()
            if time.time() - last_ckpt > args.ckpt_minutes * 60 and step < stop:
                checkpoint(step, wall0 + time.time() - t_start)
                last_ckpt = time.time()
            if args.time_limit_minutes is not None and time.time() - t_start > args.time_limit_minutes * 60:
                reason = "time limit"
                break
        if step < steps and reason == "finished":
            reason = "stop-at-step"
    except KeyboardInterrupt:
        reason = "interrupted"
    finally:
        bar.close()
    wall = wall0 + time.time() - t_start
    if step > start or not (out / "state").exists():
        checkpoint(step, wall)
    return {"out": str(out), "step": step, "steps": steps, "reason": reason, "wall_s": wall}


def main_argv() -> str:
    return " ".join(["outlierscope", *sys.argv[1:]])
