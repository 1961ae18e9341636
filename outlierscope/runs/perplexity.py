"""Perplexity and KL divergence to the unquantized model on running text, per quantization spec.

    text     = load_text(s.text)                                   # documents, with their digest
    windows  = protocol_windows(s.protocol, tokenizer, docs, length)   # gptq / llamacpp / lmeval
    for each batch of windows:                                     # the unquantized trunk once per batch,
        values[spec] += score(batch, spec) for every spec not yet done   # shared by every spec
    cell per spec (cells/<id>.npz: per-token values; <id>.json: its settings and summary, written last)
    perplexity.csv: one row per spec: PPL, ln(PPL ratio), mean / percentiles of KLD, same top, RMS dp (llama.cpp's
                    statistics) and the mean NLL change with a 95% interval from blocks of windows

With ``noise`` each quantized spec also gets a noise-floor cell: the same spec in that arithmetic (float64) as the
base, so its KLD is what rounding alone moves (the table's noise_* columns).

A rerun reads back every complete cell whose settings match and computes only the others, in one pass. A cell's
identity: the model's weights, the text's digest, the protocol and window length, the windows scored, the dtype and
device type, the spec's text, and (quantized, when not the default 1) the batch size.
"""

from __future__ import annotations

import json
import time
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path

import pandas as pd

from outlierscope.analysis.kld import summary
from outlierscope.errors import OutlierscopeError, ParamError, check_seed, warnings_to
from outlierscope.eval.perplexity import LOGPROBS, TokenScores, document_metrics, quantizes_head
from outlierscope.eval.windows import PROTOCOLS, protocol_windows
from outlierscope.io import (
    Damaged,
    git_commit,
    machine,
    output_dir,
    versions,
    write_csv,
    write_record,
    write_run_record,
    write_text,
)
from outlierscope.models.loading import (
    attn_block_option,
    check_placement,
    device_option,
    dtype_option,
    fused_option,
    trust_remote_code_option,
)
from outlierscope.parallel import Shard, World, owned_shards
from outlierscope.quant.specs.spec import QuantSpec, build_spec
from outlierscope.quant.weights.calibration import calibration_records
from outlierscope.runs.cells import cell_id, refuse_other_settings
from outlierscope.runs.text_cells import CellRun, _part, _read_part, cell_settings, token_cells
from outlierscope.settings import option

DEFAULT_LENGTH = {"gptq": 2048, "llamacpp": 512}  # lmeval: the model's max length, as lm-eval
NOISE = ("float64",)  # the arithmetics a noise-floor cell recomputes a spec in
NOISE_COLUMNS = ("noise_kld_mean", "noise_kld_unc", "noise_kld_p99.9", "noise_same_top")
COLUMNS = ("label", "quant", "bits", "tokens", "windows", "ppl", "ppl_unc", "ln_ppl_ratio", "ln_ppl_ratio_unc",
           "delta_nll", "delta_nll_ci_low", "delta_nll_ci_high", "kld_mean", "kld_unc", "kld_ci_low", "kld_ci_high",
           "kld_max", "kld_p99.9", "kld_p99", "kld_p95", "kld_p90", "kld_median", "kld_p10", "kld_p5", "kld_p1",
           "kld_p0.1", "kld_min", "same_top", "same_top_unc", "p_diff_mean", "p_diff_rms", "p_diff_rms_unc",
           "cor_ln_ppl", "ppl_base", "cell")
LMEVAL_COLUMNS = ("word_perplexity", "byte_perplexity", "bits_per_byte", "word_perplexity_base",
                  "byte_perplexity_base", "bits_per_byte_base")  # the lmeval protocol's: lm-eval's wikitext metrics


TEXT_FIELDS = ("text", "protocol", "length", "max_windows", "text_batch_size")  # the text settings of the commands
# that score items or text (sensitivity, compare-quant): what only their text metrics read


def text_option():
    """The running text (a settings field, shared by every command that scores text)."""
    return option("lambada", "lambada (offline, from `outlierscope data fetch`), a .txt/.jsonl/.parquet file, or a "
                  "dataset ORG/NAME:CONFIG:SPLIT (e.g. Salesforce/wikitext:wikitext-2-raw-v1:test)", metavar="TEXT")


def protocol_option():
    return option("gptq", "gptq (joined text, windows of --length, GPTQ/AWQ tables), llamacpp (chunks of --length, "
                  "second half scored, llama-perplexity) or lmeval (each document rolling, lm-eval's "
                  "loglikelihood_rolling)", choices=PROTOCOLS)


def length_option():
    return option(None, "tokens per window (gptq: 2048, capped at the model's maximum; llamacpp: 512; lmeval: the "
                  "model's maximum)")


def max_windows_option():
    return option(None, "score only the first N windows (default: all)")


def text_batch_size_option():
    return option(1, "windows per forward of the text cells (a quantized cell's values depend on it by float32 "
                  "rounding: part of its identity when not 1)")


def check_text_fields(s) -> None:
    """Check the text settings every text-scoring command shares, before anything loads.

    Args:
        s: settings with ``protocol``, ``length``, ``max_windows`` and, where present, ``text_batch_size``."""
    if s.protocol not in PROTOCOLS:
        raise ParamError("protocol", f"one of {', '.join(PROTOCOLS)}", s.protocol)
    for name, low in (("length", 2), ("max_windows", 1), ("text_batch_size", 1)):
        value = getattr(s, name, None)
        if value is not None and value < low:
            raise ParamError(name, f">= {low}", value)


@dataclass(frozen=True)
class PerplexitySettings:
    """Settings of a perplexity / KL-divergence run (``outlierscope perplexity``): one model, its specs and the
    unquantized reference scored on the same windows of running text. Each field is a CLI flag of the same name (its
    help is the field's ``option`` text) and is written to the run's record."""

    model: str = option(MISSING, "Hub id (ORG/NAME[@REVISION]), HF model directory, .gguf file, preset role or fetched "
                        "model", metavar="SPEC")
    bits: tuple[int, ...] = option((16,), "the paper's logits (int, per_tensor) at these bit widths; 16: the "
                                   "unquantized model (its row is always written)")
    quant: tuple[str, ...] = option((), "also: a recipe or spec (see `outlierscope recipes`); repeat",
                                    flag="--quant", repeat=True, metavar="RECIPE_OR_SPEC")
    text: str = text_option()
    protocol: str = protocol_option()
    length: int | None = length_option()
    max_windows: int | None = max_windows_option()
    batch_size: int = option(1, "windows per forward; quantized values depend on it by float32 rounding (part of a "
                             "quantized cell's identity when not 1)")
    noise: str | None = option(None, "also recompute each quantized spec in this arithmetic and report the KL "
                               "divergence between the two runs: the noise floor under which a spec's KLD to the "
                               "unquantized model is rounding, not quantization (a second copy of the model)",
                               choices=NOISE)
    logprobs: str = option("float64", "how each token's NLL is taken from its logits: float64 (exact) or lmeval "
                           "(lm-eval 0.4.13's float32 log-softmax and per-window float32 sums: its digits, for "
                           "dtype float32; the KLD stays float64)", choices=LOGPROBS)
    seed: int = option(0, "seeds the bootstrap over windows")
    dtype: str = dtype_option()
    device: str = device_option()
    attn_block: int | None = attn_block_option()
    fused: bool = fused_option()
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self):
        check_seed(self.seed)
        object.__setattr__(self, "bits", tuple(self.bits))
        object.__setattr__(self, "quant", tuple(self.quant))
        for b in self.bits:
            build_spec(b)
        texts = [str(sp) for sp in self.specs()]
        dup = sorted({t for t in texts if texts.count(t) > 1})
        if dup:
            raise ParamError("quant", "distinct specs", list(self.quant), f"{dup[0]} is given twice")
        check_text_fields(self)
        if self.batch_size < 1:
            raise ParamError("batch_size", ">= 1", self.batch_size)
        if self.logprobs == "lmeval" and (self.dtype != "float32" or self.noise is not None):
            raise ParamError("logprobs", "float64 unless dtype=float32 and no noise (lm-eval's arithmetic is that of "
                             "a float32 model)", self.logprobs)
        if self.noise is not None and self.noise == self.dtype:
            raise ParamError("noise", f"an arithmetic other than dtype={self.dtype}", self.noise)
        if self.noise is not None and any(quantizes_head(sp) for sp in self.specs()):
            raise ParamError("noise", "specs that leave the LM head unquantized", self.noise,
                             "the noise floor of a quantized lm_head is not computed")
        check_placement(self.device, self.dtype, None, self.attn_block, self.fused)

    def specs(self) -> list[QuantSpec]:
        """The unquantized model first, then the logits' bit widths, then each ``quant``."""
        out = [QuantSpec()] + [build_spec(b) for b in self.bits if b != 16]
        return out + [QuantSpec.parse(q) for q in self.quant]


def window_length(s: PerplexitySettings, config, tokenizer) -> int:
    """The protocol's window length: the one given, or its default (gptq's capped at the model's maximum).

    Args:
        s: the settings.
        config: the model's config.
        tokenizer: its tokenizer."""
    from outlierscope.eval.requests import lmeval_max_length

    top = lmeval_max_length(config, tokenizer)
    if s.length is not None:
        if s.length > top + (s.protocol == "lmeval"):
            raise ParamError("length", f"at most the model's {top} positions", s.length)
        return s.length
    return top if s.protocol == "lmeval" else min(DEFAULT_LENGTH[s.protocol], top)


def prepare_windows(s, record):
    """The text, the window length and the windows, everything the tokenizer alone decides, before any weights load.

    Args:
        s: settings with ``text``, ``protocol``, ``length`` and ``max_windows``.
        record: the model's ``inspect_model``.

    Returns:
        ``(text, length, windows)``."""
    from outlierscope.data.running_text import load_text

    text = load_text(s.text)
    length = window_length(s, record.config, record.tokenizer)
    return text, length, protocol_windows(s.protocol, record.tokenizer, text.docs, length)[: s.max_windows]


def text_ident(s, lm, text, length: int, windows, model: str | None = None) -> dict:
    """What every text cell of a model shares: weights, text, protocol, window length and count, dtype (and device).

    Args:
        s: the settings.
        lm: the loaded model.
        text: the ``RunningText``.
        length: the window length.
        windows: the windows.
        model: the model's name; None: ``s.model``."""
    ident = {"model": model or s.model, "weights_sha256": lm.weights_sha256(), "text_sha256": text.sha256,
             "protocol": s.protocol, "length": length, "windows": len(windows), "dtype": lm.dtype}
    if lm.device.split(":")[0] != "cpu":
        ident["device"] = lm.device.split(":")[0]
    return ident


def _prepare(s: PerplexitySettings, log, device: str, record=None):
    """The model, its text and windows, what every cell shares, and the tokenizer's record. Everything but the
    weights is checked first (the specs against the config, the text and its windows with the tokenizer alone), on
    the model inspected once (``record``: the caller's ``inspect_model``, if any)."""
    from outlierscope.models.loading import inspect_model, load_model
    from outlierscope.quant.apply import check_spec

    record = record or inspect_model(s.model, s.trust_remote_code)
    for spec in s.specs():  # the specs fit the model's shape: before it loads
        check_spec(spec, record.config)
    text, length, windows = prepare_windows(s, record)
    lm = load_model(s.model, dtype=s.dtype, device=device, trust_remote_code=s.trust_remote_code, record=record)
    tok = record.tokenizer_files
    ident = text_ident(s, lm, text, length, windows)
    log(windows_said(s, text, length, windows))
    return lm, text, windows, length, ident, tok


def windows_said(s, text, length: int, windows) -> str:
    """One line: the model, its windows, their length and scored tokens, and the text's source.

    Args:
        s: the settings.
        text: the ``RunningText``.
        length: the window length.
        windows: the windows."""
    return (f"{s.model}: {len(windows)} {s.protocol} windows of {length} tokens, "
            f"{sum(len(w.targets) for w in windows):,} scored tokens of {text.source}")


def _noise_model(s: PerplexitySettings, lm):
    """The model again in the noise arithmetic (``s.noise``), on the same device."""
    from outlierscope.models.loading import load_model

    return load_model(s.model, dtype=s.noise, device=lm.device, trust_remote_code=s.trust_remote_code, record=lm.record)


def perplexity(s: PerplexitySettings, out: str | Path, log=print, shard: Shard | None = None,
               world: World | None = None, force: bool = False, record=None) -> pd.DataFrame | None:
    """Run (or resume) a perplexity and KLD study into ``out``: cells, tables, figures and the sealed record.

    Work is saved per virtual shard of the windows, so an interrupted run resumes at its shard; the run that finds
    every part assembles the cells and writes ``perplexity.csv``, ``perplexity.md``, ``figures/`` and
    ``perplexity.json``. A second run of the same shard into ``out`` while one runs is refused at once.

    Args:
        s: the study's settings.
        out: the output directory.
        log: where progress lines go.
        shard: compute only this share's parts (``--shard i/N``).
        world: the ``torchrun`` processes (``World.from_env()``); rank 0 assembles and writes.
        force: replace a run (or this shard's record) with other settings in ``out``.
        record: the model's ``inspect_model``, where the caller made it already.

    Returns:
        The table (one row per spec); None until every part is there, and on ranks other than 0."""
    import contextlib

    from outlierscope.io import run_lock
    from outlierscope.quant.numerics.fused import fused_kernels

    out, shard, world = Path(out), shard or Shard(), world or World()
    say = log if world.is_main else (lambda *a, **k: None)
    with output_dir(out), output_dir(out / "cells") as cells, contextlib.ExitStack() as held, fused_kernels(s.fused), \
            warnings_to(say):
        with world.failing_together():
            if world.is_main:
                check_previous(out, s, force, shard)
                held.enter_context(run_lock(out, "whole" if shard.whole else shard.tag, "perplexity run"))
            lm, text, windows, length, ident, tok = _prepare(s, say, world.device(s.device), record)
        specs = s.specs()
        settings = [cell_settings(ident, spec, s.batch_size, s.logprobs) for spec in specs]
        noisy = [i for i, spec in enumerate(specs) if s.noise is not None and not spec.is_identity]
        noise_settings = [{**settings[i], "noise": s.noise} for i in noisy]
        started = time.perf_counter()
        c = CellRun(cells, s.batch_size, s.attn_block, s.seed, shard, world, say, s.logprobs)
        have = token_cells(lm, windows, specs, settings, c)
        noise = token_cells(lm, windows, [specs[i] for i in noisy], noise_settings, c, lambda: _noise_model(s, lm),
                            f"noise-floor ({s.noise}) ") if noisy else []
        if not world.is_main:
            return None
        if have is None or noise is None:
            if not shard.whole:
                _write_shard(out, s, shard, settings + noise_settings)
            say(f"{shard.tag}: parts written to {cells}; the run that finds every shard's parts there (same --out) "
                "assembles the cells and writes the tables (shards written to other directories: `outlierscope "
                "merge DIR...` first)")
            return None
        docs = text.docs if s.protocol == "lmeval" else None
        table = _table(specs, settings, have, s.seed, windows, docs, s.logprobs,
                       dict(zip(noisy, zip(noise_settings, noise))) if s.noise is not None else None)
        noise_cells = {f"{specs[i].label} (noise {s.noise})": cell_id(st) for i, st in zip(noisy, noise_settings)}
        record = {"settings": asdict(s), "text": text.record(), "tokenizer": tok, "length": length,
                  "windows": len(windows),
                  "scored_tokens": int(sum(len(w.targets) for w in windows)),
                  "model_source": lm.provenance(ident["weights_sha256"]), "processes": world.size,
                  "seconds": round(time.perf_counter() - started, 1), "versions": versions(), "machine": machine(),
                  "git_commit": git_commit(), "cells": {**dict(zip(table["label"], table["cell"])), **noise_cells},
                  "calibration": calibration_records(specs, lm.model, lm.tokenizer)}
        write_csv(out / "perplexity.csv", table)
        write_figures(out / "figures", table, {spec.label: tokens.kld for spec, tokens in zip(specs, have)})
        write_text(out / "perplexity.md", perplexity_markdown(table))
        write_run_record(out / "perplexity.json", record, ["perplexity.csv", "perplexity.md"])
    say(perplexity_markdown(table))
    return table


def check_previous(out: Path, s: PerplexitySettings, force: bool, shard: Shard) -> None:
    """Refuse to replace the tables (or this shard's record) of a perplexity run with other settings, unless forced.

    Cells with matching settings are reused either way; a setting an older record lacks counts as its default.

    Args:
        out: the output directory.
        s: this run's settings.
        force: replace them.
        shard: this run's shard."""
    prev = out / ("perplexity.json" if shard.whole else f"perplexity.{shard.tag}.json")
    now = json.loads(json.dumps(asdict(s)))
    defaults = json.loads(json.dumps(asdict(PerplexitySettings(model=s.model))))
    refuse_other_settings(prev, now, defaults, "a perplexity run", force)


def _write_shard(out: Path, s: PerplexitySettings, shard: Shard, settings: list[dict]) -> None:
    """A --shard run's record (``perplexity.shard-i-of-N.json``): its settings and the part files it owns, for
    ``merge_perplexity``."""
    owned = owned_shards(shard, World())  # every rank's parts of this shard
    write_record(out / f"perplexity.{shard.tag}.json",
               {"settings": asdict(s), "shard": [shard.index, shard.count],
                "parts": sorted(_part(Path("cells"), st, v).as_posix() for st in settings for v in owned),
                "versions": versions(), "machine": machine(), "git_commit": git_commit()})


def merge_perplexity(dirs: list[str | Path], out: str | Path | None = None, log=print) -> Path:
    """Gather the parts of the ``--shard i/N`` runs of one perplexity run into one directory's cells.

    The same command without ``--shard`` then assembles the cells and writes the tables, the bytes one process writes.
    Every record and part is checked before anything is copied; a part already there must hold the same bytes.

    Args:
        dirs: the directories holding the shards.
        out: where the parts go; None: the first directory.
        log: where progress lines go.

    Returns:
        The directory."""
    import shutil

    from outlierscope.io import atomic_path, read_record
    from outlierscope.parallel import find_shards

    files = find_shards([Path(d) for d in dirs], "perplexity", ".json", "perplexity")
    recs = [(f.parent, read_record(f, ("settings", "parts"), "perplexity shard record")) for f in files]
    if any(r["settings"] != recs[0][1]["settings"] for _, r in recs[1:]):
        raise OutlierscopeError("the shards were run with different settings; merge only the shards of one "
                                "perplexity run")
    out = Path(out) if out is not None else Path(dirs[0])
    todo = []
    for d, r in recs:
        for name in r["parts"]:
            src, dst = d / name, out / name
            if not src.exists():
                raise OutlierscopeError(f"{src} is missing (its shard's run did not finish); rerun that shard, then "
                                        "merge again")
            try:
                _read_part(src)
            except Damaged as e:
                raise OutlierscopeError(f"{e}; rerun that shard (delete the file first), then merge again") from None
            if dst.exists() and dst.resolve() != src.resolve() and dst.read_bytes() != src.read_bytes():
                raise OutlierscopeError(f"{dst} exists with other values than {src}; merge into an empty directory")
            todo.append((src, dst))
    with output_dir(out), output_dir(out / "cells"):
        for src, dst in todo:
            if not dst.exists():
                with atomic_path(dst) as tmp:
                    shutil.copyfile(src, tmp)
    log(f"merged the parts of {len(recs)} perplexity shards into {out / 'cells'}; now run the same `outlierscope "
        f"perplexity` command with --out {out} and without --shard (it assembles the cells and writes the tables)")
    return out


def write_figures(out: Path, table: pd.DataFrame, kld: dict, against: str = "the unquantized model") -> None:
    """Draw ``kld_distribution`` and ``nll_and_kld`` of a table of text cells into a directory.

    Args:
        out: the figures' directory.
        table: the text cells' table.
        kld: label -> per-token KLD.
        against: what the KLD is taken against, for the titles."""
    import matplotlib

    from outlierscope.io import ensure_writable_dir
    from outlierscope.report.markdown import save_figure
    from outlierscope.report.perplexity_plots import kld_distribution, nll_and_kld

    matplotlib.use("Agg")
    ensure_writable_dir(out)
    save_figure(kld_distribution(kld, against), out, "kld_distribution")
    save_figure(nll_and_kld(table, against), out, "nll_and_kld")


def _table(specs, settings, have, seed: int, windows, docs, logprobs: str = "float64",
           noise: dict | None = None) -> pd.DataFrame:
    """One row per spec: its statistics, with ``docs`` (lmeval) lm-eval's document metrics, and with ``noise`` (spec
    index -> (settings, TokenScores) of its noise-floor cell) the KLD between the two arithmetics."""
    rows = []
    for i, (spec, st, tokens) in enumerate(zip(specs, settings, have)):
        extra = document_metrics(tokens, windows, docs, logprobs) if docs is not None else {}
        if noise is not None:
            extra.update(_noise_columns(noise[i][1], seed) if i in noise else {})
        rows.append({"label": spec.label, "quant": str(spec), "bits": spec.bits, **summary(tokens, seed), **extra,
                     "cell": cell_id(st)})
    columns = list(COLUMNS) + (list(LMEVAL_COLUMNS) if docs is not None else [])
    return pd.DataFrame(rows).reindex(columns=columns + (list(NOISE_COLUMNS) if noise is not None else []))


def _noise_columns(tokens: TokenScores, seed: int) -> dict:
    stats = summary(tokens, seed)
    return {"noise_kld_mean": stats["kld_mean"], "noise_kld_unc": stats["kld_unc"],
            "noise_kld_p99.9": stats["kld_p99.9"], "noise_same_top": stats["same_top"]}


def perplexity_markdown(table: pd.DataFrame, first: str = "spec") -> str:
    """One row per spec, as llama.cpp's quantization tables are read.

    PPL and ln PPL ratio with llama.cpp's uncertainties, the NLL change and the mean KLD with 95% intervals over
    whole windows (llama.cpp's per-token uncertainty of the mean KLD, in the csv as kld_unc, treats a window's tokens
    as independent: on the pair about half as wide), the 99.9% KLD, same top token and RMS dp.

    Args:
        table: the run's table.
        first: the first column's heading.

    Raises:
        OutlierscopeError: an empty table."""
    if table.empty:
        raise OutlierscopeError("no spec was scored")
    noise = "noise_kld_mean" in table.columns
    head = (f"| {first} | PPL | ln(PPL/PPL base) | ΔNLL [95% CI] | mean KLD [95% CI] | 99.9% KLD | same top | RMS Δp |"
            + (" noise KLD | noise same top |" if noise else "") + "\n|---|---|---|---|---|---|---|---|"
            + ("---|---|" if noise else "") + "\n")
    lines = [f"| {r['label']} | {r['ppl']:.4f} ± {r['ppl_unc']:.4f} | {r['ln_ppl_ratio']:+.5f} ± "
             f"{r['ln_ppl_ratio_unc']:.5f} | {r['delta_nll']:+.5f} [{r['delta_nll_ci_low']:+.5f}, "
             f"{r['delta_nll_ci_high']:+.5f}] | {r['kld_mean']:.6f} [{r['kld_ci_low']:.6f}, {r['kld_ci_high']:.6f}] | "
             f"{r['kld_p99.9']:.5f} | "
             f"{100 * r['same_top']:.2f} ± {100 * r['same_top_unc']:.2f}% | {100 * r['p_diff_rms']:.3f}% |"
             + (_noise_cells(r) if noise else "") for r in table.to_dict("records")]
    return head + "\n".join(lines) + "\n"


def _noise_cells(r: dict) -> str:
    if pd.isna(r["noise_kld_mean"]):
        return " - | - |"
    return f" {r['noise_kld_mean']:.2e} ± {r['noise_kld_unc']:.1e} | {100 * r['noise_same_top']:.2f}% |"
