"""Per-token cells of running text, computed over virtual shards and saved so that any split resumes them (the
machinery perplexity, sensitivity's text metrics and compare-quant's text pairs share).

    settings = cell_settings(ident, spec, batch_size)      # a cell's identity: the model, text, windows, spec
    have     = token_cells(lm, windows, specs, settings, CellRun(...))
      each cell read back if complete and undamaged, else:
      for each virtual shard this process owns: score the missing specs on its windows (one pass per
          SPECS_PER_PASS specs: the unquantized trunk once per batch) -> cells/<id>.part-VV-of-16.npz
      rank 0 assembles a cell once all 16 parts are there (then the parts go) -> cells/<id>.npz + <id>.json

The bytes of a cell do not depend on the split: each virtual shard's windows are scored alone, in order.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from outlierscope.analysis.kld import summary
from outlierscope.errors import OutlierscopeError
from outlierscope.eval.perplexity import TokenScores, score_windows
from outlierscope.eval.windows import Window
from outlierscope.io import Damaged, check_file_targets, write_record
from outlierscope.parallel import VIRTUAL_SHARDS, Shard, World, owned_shards
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.runs.cells import cell_id, revised

SPECS_PER_PASS = 16  # specs scored together: each holds one batch's hidden states (tokens x hidden) until the head


def cell_settings(ident: dict, spec: QuantSpec, batch_size: int, logprobs: str = "float64") -> dict:
    """A perplexity cell's identity: what every cell of the run shares, the spec's text and how its NLL is taken.

    Args:
        ident: what every cell of the run shares (model, text, windows ...).
        spec: the cell's spec.
        batch_size: windows per forward (part of a quantized cell's identity: it can change the scores).
        logprobs: how each NLL is taken; recorded when not ``float64``."""
    out = {**ident, "bits": spec.bits, "quant": str(spec), **revised(spec)}
    if logprobs != "float64":
        out["logprobs"] = logprobs
    if not spec.is_identity and batch_size != 1:
        out["batch_size"] = batch_size
    return out


def read_cell(cells: Path, cid: str, settings: dict | None = None) -> TokenScores:
    """A cell read back: its record's seal, its settings and its values' digest checked.

    Args:
        cells: the cells' directory.
        cid: the cell's id.
        settings: the settings it must have; None: those its id is the digest of.

    Raises:
        Damaged: a cell whose files do not hold what was written."""
    from outlierscope.io import check_files, check_seal

    meta = cells / f"{cid}.json"
    try:
        rec = check_seal(json.loads(meta.read_text()), meta)
    except FileNotFoundError:
        raise Damaged(f"{meta}: missing") from None
    except (ValueError, UnicodeDecodeError):
        raise Damaged(f"{meta}: not readable JSON (cut or changed)") from None
    cell = rec.get("cell")
    if not isinstance(cell, dict) or cell_id(cell) != cid or settings is not None and cell != settings:
        raise Damaged(f"{meta}: holds the record of another cell (swapped or renamed)")
    check_files(cells, rec.get("files") or {f"{cid}.npz": ""})
    return TokenScores.load(cells / f"{cid}.npz")


def _load_cell(cells: Path, settings: dict, log=print) -> TokenScores | None:
    """The complete cell of ``settings``, or None: absent, or damaged (one line says so; it is computed again)."""
    cid = cell_id(settings)
    if not (cells / f"{cid}.json").exists():
        return None
    try:
        return read_cell(cells, cid, json.loads(json.dumps(settings)))
    except Damaged as e:
        log(f"cell {cid} is damaged ({e}); computing it again")
        return None


def _save_cell(cells: Path, settings: dict, tokens: TokenScores, stats: dict) -> str:
    """The per-token values, then the settings, summary and the values' digest (written last, sealed: they mark the
    cell complete)."""
    from outlierscope.io import atomic_path, file_digests

    cid = cell_id(settings)
    with atomic_path(cells / f"{cid}.npz") as tmp:
        with open(tmp, "wb") as f:
            tokens.save(f)
    write_record(cells / f"{cid}.json", {"cell": settings, "summary": stats, "files": file_digests(cells, [f"{cid}.npz"])})
    return cid


def _read_part(path: Path) -> TokenScores:
    """One virtual shard's part of a cell, its digest and identity checked: the cell and virtual shard its name says,
    with the settings that cell's id is the digest of (``Damaged`` otherwise)."""
    from outlierscope.io import read_checked_ident

    ident, payload = read_checked_ident(path)
    cid, _, rest = path.name.partition(".part-")
    want = {"cell": cid, "part": int(rest[:2]) if rest[:2].isdigit() else None, "of": VIRTUAL_SHARDS}
    settings = ident.get("settings")
    if any(ident.get(k) != v for k, v in want.items()) or not isinstance(settings, dict) or cell_id(settings) != cid:
        raise Damaged(f"{path}: holds part {ident.get('part')} of cell {ident.get('cell')}, not part {want['part']} of "
                      f"cell {cid} (swapped or renamed)")
    return TokenScores.from_bytes(payload)


def _part_done(path: Path, log) -> bool:
    """Whether the part ``path`` is there and intact; a damaged one is removed with one line (it is computed again)."""
    if not path.exists():
        return False
    try:
        _read_part(path)
        return True
    except Damaged as e:
        log(f"{e}; computing that part again")
        path.unlink()
        return False


def _files(cells: Path, settings: dict) -> list[Path]:
    """Every file a cell of ``settings`` writes: its parts, values and record."""
    cid = cell_id(settings)
    return [*(_part(cells, settings, v) for v in range(VIRTUAL_SHARDS)), cells / f"{cid}.npz", cells / f"{cid}.json"]


def _part(cells: Path, settings: dict, v: int) -> Path:
    return cells / f"{cell_id(settings)}.part-{v:02d}-of-{VIRTUAL_SHARDS}.npz"


def _write_part(cells: Path, settings: dict, v: int, tokens: TokenScores) -> None:
    """One virtual shard's part of a cell, behind its digest and its identity (the cell, the shard, the settings)."""
    from outlierscope.io import write_checked

    ident = {"cell": cell_id(settings), "part": v, "of": VIRTUAL_SHARDS, "settings": settings}
    write_checked(_part(cells, settings, v), tokens.to_bytes(), ident)


def _scorer(lm, ref, windows: list[Window], specs: list[QuantSpec], batch_size: int, attn_block: int | None,
            ref_specs: list[QuantSpec] | None = None, calibration_dir=None, logprobs: str = "float64"):
    """``score(indices, shard)``: the ``TokenScores`` of ``specs[indices]`` on one virtual shard's windows,
    against the unquantized model, or (``ref``: another model, or this one in the noise arithmetic) against ``ref``
    under ``ref_specs`` (default: the same spec). ``calibration_dir``: where GPTQ/AWQ keep their calibrated layers."""
    from outlierscope.quant.weights.calibration import calibration_for

    if ref is not None:
        ref_specs = ref_specs if ref_specs is not None else specs
        return _pair_scorer({"model": lm, "ref": ref}, windows,
                            [(("ref", r), ("model", q)) for q, r in zip(specs, ref_specs)], batch_size, attn_block,
                            calibration_dir, logprobs)
    cals = [calibration_for(lm.model, lm.tokenizer, spec, calibration_dir) for spec in specs]

    def group(idx: list[int], shard: int) -> list[TokenScores]:
        return score_windows(lm.model, windows, [specs[j] for j in idx], batch_size, [cals[j] for j in idx],
                             attn_block, shards=[shard], logprobs=logprobs)

    return _in_passes(group)


def _pair_scorer(models: dict, windows: list[Window], pairs: list[tuple[tuple[str, QuantSpec], tuple[str, QuantSpec]]],
                 batch_size: int, attn_block: int | None, calibration_dir=None, logprobs: str = "float64"):
    """``score(indices, shard)``: the ``TokenScores`` of ``pairs[indices]`` (each ``((model key, spec) of the
    base, (model key, spec) of the other)``, ``models``: key -> loaded model) on one virtual shard's windows, each
    distinct forward once per batch (``score_sides``)."""
    from outlierscope.eval.perplexity import Side, score_sides
    from outlierscope.quant.weights.calibration import calibration_for

    cals: dict[tuple[str, str], object] = {}  # (model key, spec text) -> its calibration, computed once

    def side(key: str, spec: QuantSpec) -> Side:
        if (key, str(spec)) not in cals:
            lm = models[key]
            cals[key, str(spec)] = calibration_for(lm.model, lm.tokenizer, spec, calibration_dir)
        return Side(key, spec, cals[key, str(spec)])

    others = [side(*b) for _, b in pairs]  # the compared sides calibrated before the bases: the order they always had
    sides = [(side(*a), o) for (a, _), o in zip(pairs, others)]
    trunks = {k: lm.model for k, lm in models.items()}

    def group(idx: list[int], shard: int) -> list[TokenScores]:
        return score_sides(trunks, windows, [sides[j] for j in idx], batch_size, attn_block, shards=[shard],
                           logprobs=logprobs)

    return _in_passes(group, sides=2)


def _in_passes(group, sides: int = 1):
    """``score(indices, shard)`` from ``group``, SPECS_PER_PASS forwards' worth of indices at a time (each index
    holds up to ``sides`` batches of hidden states until the head: bounded memory)."""

    def score(idx: list[int], shard: int) -> list[TokenScores]:
        n = max(1, SPECS_PER_PASS // sides)
        return [t for g in range(0, len(idx), n) for t in group(idx[g:g + n], shard)]

    return score


def _compute_parts(score, settings: list[dict], cells: Path, owned: tuple[int, ...], log=print) -> None:
    """Every missing part (one virtual shard of the windows) of each cell: the unit of resume and of --shard.
    ``score``: ``_scorer``'s (the unquantized model runs once per shard for the specs that still need it).
    Without a terminal (a log file), one line per shard says where the run is."""
    import sys

    from tqdm.auto import tqdm

    started = time.perf_counter()
    for n, v in enumerate(tqdm(owned, desc=f"{len(settings)} cells", unit="shard", disable=None)):
        missing = [j for j, st in enumerate(settings) if not _part_done(_part(cells, st, v), log)]
        if not missing:
            continue
        for j, tokens in zip(missing, score(missing, v)):
            _write_part(cells, settings[j], v, tokens)
        if not sys.stderr.isatty():
            log(f"shard {v:02d} of {VIRTUAL_SHARDS} done ({n + 1} of {len(owned)} this run, "
                f"{time.perf_counter() - started:.0f} s)")


@dataclass(frozen=True)
class CellRun:
    """How a set of text cells is computed.

    Attributes:
        cells: the cells' directory.
        batch_size: windows per forward.
        attn_block: query rows per attention block; None: whole.
        seed: the summaries' bootstrap seed.
        shard: this job's ``--shard``.
        world: the ``torchrun`` processes.
        log: rank 0's progress lines.
        logprobs: how each NLL is taken (``LOGPROBS``)."""

    cells: Path
    batch_size: int = 1
    attn_block: int | None = None
    seed: int = 0
    shard: Shard = field(default_factory=Shard)
    world: World = field(default_factory=World)
    log: object = print
    logprobs: str = "float64"


def token_cells(lm, windows, specs: list[QuantSpec], settings: list[dict], c: CellRun, ref_model=None,
                kind: str = "", ref_specs: list[QuantSpec] | None = None) -> list[TokenScores] | None:
    """Each spec's ``TokenScores`` on the windows (``cells_of``), against the unquantized model or a reference.

    Args:
        lm: the ``LoadedModel``.
        windows: the ``Window`` list.
        specs: the specs.
        settings: each cell's identity (``cell_settings``).
        c: how the cells are computed.
        ref_model: None for cells against the unquantized model; else a function loading the reference (the model in
            another arithmetic, or another model), called only when a cell is missing.
        kind: a word for the log line (``noise-floor``, ...).
        ref_specs: the reference's spec of each cell; None: each spec itself."""

    def scorer(todo: list[int]):
        ref = ref_model() if ref_model is not None else None
        return _scorer(lm, ref, windows, [specs[i] for i in todo], c.batch_size, c.attn_block,
                       [ref_specs[i] for i in todo] if ref_specs is not None else None, c.cells.parent / "calibration",
                       c.logprobs)

    return cells_of(settings, c, scorer, kind)


def pair_cells(models: dict, windows, pairs: list[tuple[tuple[str, QuantSpec], tuple[str, QuantSpec]]],
               settings: list[dict], c: CellRun, kind: str = "") -> list[TokenScores] | None:
    """Each pair's ``TokenScores`` on the windows (``cells_of``); every distinct forward of the missing cells runs once.

    Args:
        models: key -> loaded model.
        windows: the ``Window`` list.
        pairs: ``((model key, spec) of the base, (model key, spec) of the other)``.
        settings: each cell's identity.
        c: how the cells are computed.
        kind: a word for the log line."""

    def scorer(todo: list[int]):
        return _pair_scorer(models, windows, [pairs[i] for i in todo], c.batch_size, c.attn_block,
                            c.cells.parent / "calibration", c.logprobs)

    return cells_of(settings, c, scorer, kind)


def cells_of(settings: list[dict], c: CellRun, scorer, kind: str = "") -> list[TokenScores] | None:
    """Cells read back when complete, else computed per virtual shard (resumable) and assembled from every part.

    Args:
        settings: each cell's identity.
        c: how the cells are computed.
        scorer: ``scorer(missing indices)``, whose ``score`` computes a shard's parts.
        kind: a word for the log line.

    Returns:
        The cells on rank 0 when all are complete; else None."""
    have = [_load_cell(c.cells, st, c.log) for st in settings]
    todo = [i for i, h in enumerate(have) if h is None]
    check_file_targets(p for i in todo for p in _files(c.cells, settings[i]))  # before any part is scored
    c.log(f"{len(settings) - len(todo)} {kind}cells done earlier, {len(todo)} to compute")
    with c.world.failing_together():  # then every rank's parts are written
        if todo:
            _compute_parts(scorer(todo), [settings[i] for i in todo], c.cells, owned_shards(c.shard, c.world), c.log)
    if not c.world.is_main:
        return None
    have = [h if h is not None else _assemble(c.cells, st, c.seed) for h, st in zip(have, settings)]
    return None if any(h is None for h in have) else have


def _assemble(cells: Path, settings: dict, seed: int) -> TokenScores | None:
    """The cell from its parts once every virtual shard's is there (then the parts are removed); else None."""
    paths = [_part(cells, settings, v) for v in range(VIRTUAL_SHARDS)]
    if not all(p.exists() for p in paths):
        return None
    parts = []
    for p in paths:
        try:
            parts.append(_read_part(p))
        except Damaged as e:  # another process's part (this one's were checked before it scored)
            p.unlink()
            raise OutlierscopeError(f"{e}; removed: run again (it resumes and computes that part again)") from None
    tokens = TokenScores.concat(parts)
    _save_cell(cells, settings, tokens, summary(tokens, seed))
    for p in paths:
        p.unlink()
    return tokens
