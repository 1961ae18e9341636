"""Evaluation cells: one ``evaluate`` run, named by what its numbers depend on and cached in
``cells/`` (``<cell>.csv`` per item, ``<cell>.json`` settings and metrics, written last: it marks the cell complete;
side tables such as ``<cell>.attn_error.csv`` before it). ``sweep`` and ``sensitivity`` share this identity and cache:
a rerun reads back every complete cell whose settings match and computes the others.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from outlierscope.analysis.attention_error import AttentionErrorStats
from outlierscope.errors import OutlierscopeError, Refused
from outlierscope.eval.evaluate import EvalResult
from outlierscope.io import Damaged, check_file_targets, check_seal
from outlierscope.parallel import Shard, World

DEFAULT_BATCH = 32  # sequences per forward; a quantized cell at another batch size is another cell (float32 rounding)


# settings that change how fast or in what memory, never the numbers (fused: tested; attn_block: blocked attention is
# exact, tested in tests/hooks): a run resumed with another value is the same run
SPEED_ONLY = ("fused", "attn_block")


def refuse_other_settings(prev: Path, now: dict, defaults: dict, what: str, force: bool, upgrade=dict,
                          cells: bool = True) -> None:
    """Refuse to replace the tables of a run whose record holds other settings, or is damaged, unless forced.

    ``SPEED_ONLY`` settings are not compared.

    Args:
        prev: the earlier run's record.
        now: this run's settings as a record holds them (JSON values).
        defaults: the settings' defaults (a setting an older record lacks counts as its default).
        what: the run, for the error (``a sweep``, ``an export``).
        force: replace them.
        upgrade: the record's settings with today's keys.
        cells: whether the run keeps cells, which are reused either way (said in the error)."""
    if force or not prev.exists():
        return
    reused = " (cells with matching settings are reused)" if cells else ""
    try:
        rec = check_seal(json.loads(prev.read_text(encoding="utf-8")), prev, required=False)
        old = upgrade(rec["settings"])
    except (ValueError, UnicodeDecodeError, KeyError, AttributeError, TypeError, Damaged) as e:
        why = e if isinstance(e, Damaged) else f"{prev}: not a readable record"
        raise Refused(f"{why}; the record of {what} in {prev.parent} is damaged: {{fix}} to replace its tables{reused}, "
                      "or choose another output directory") from None
    diff = sorted(k for k in now if k not in SPEED_ONLY and old.get(k, defaults.get(k)) != now[k])
    if diff:
        raise Refused(f"{prev.parent} holds {what} with other settings ({', '.join(diff)} differ); choose another "
                      f"output directory, or {{fix}} to replace its tables{reused}")


def cell_id(settings: dict) -> str:
    """A cell's name: ``<model>_b<bits>_<10 hex digits of the settings' sha256>``; the same settings, the same name.

    Args:
        settings: the cell's identity."""
    blob = json.dumps(settings, sort_keys=True).encode()
    slug = f"{settings['model'].replace(':', '-').replace('/', '_')}_b{settings['bits']}"
    return f"{slug}_{hashlib.sha256(blob).hexdigest()[:10]}"


def revised(*specs) -> dict:
    """Keys a cell's identity gains where the arithmetic behind a spec's text changed: older cells are never read back.

    Each format's and transform's ``identity`` (NVFP4's scales in compressed-tensors' order of operations, a
    rotation's signs on its input side, ``rotate:``'s two Hadamard factors, GPTQ's damping as the mean of a contiguous
    copy of the Hessian's diagonal).

    Args:
        *specs: the cell's specs."""
    keys = {}
    for sp in specs:
        for item in (*getattr(sp, "parts", ()), *getattr(sp, "transforms", ())):
            keys.update(item.fmt.identity if hasattr(item, "fmt") else item.identity)
    return keys


def cached_cell(cells_dir: Path, settings: dict, compute: Callable[[], tuple[EvalResult, dict | None]], desc: str,
                log=print, tables: tuple[str, ...] = (), shard: Shard | None = None,
                world: World | None = None) -> tuple[EvalResult | None, str]:
    """A cell read back when complete with these settings, else computed on every rank and written atomically by rank 0.

    Args:
        cells_dir: the cells' directory.
        settings: the cell's identity.
        compute: ``compute()`` -> (result, side tables by name).
        desc: the cell's label, for the log.
        log: where progress lines go.
        tables: the side tables it has.
        shard: a partial shard's part of the cell.
        world: the ``torchrun`` processes.

    Returns:
        ``(result, cell id)``; side tables in ``result.extra``; None for the result on ranks other than 0."""
    shard, world = shard or Shard(), world or World()
    cid = cell_id(settings)
    name = cid if shard.whole else f"{cid}.{shard.tag}"
    res = _readable_cell(cells_dir, name, settings, tables, desc, log) if world.is_main else None
    ends = () if res is not None else (".csv", ".json", *(f".{t}.csv" for t in tables))
    _check_targets(world, [f"{name}{end}" for end in ends], cells_dir)  # every rank: a collective
    if world.broadcast(res is not None):
        log(f"{desc}: done earlier, skipped ({name})")
        return res, cid
    res, side = compute()
    if world.is_main:
        res.save_cell(cells_dir, name, settings, side)
        log(f"{desc}: {len(res.items)} items in {res.seconds:.0f} s ({name})")
    return res, cid


def cached_cells(cells_dir: Path, settings: list[dict], descs: list[str],
                 compute: Callable[[list[int]], list[EvalResult | None]], log=print, shard: Shard | None = None,
                 world: World | None = None) -> list[tuple[EvalResult | None, str]]:
    """``cached_cell`` of several cells whose missing ones are computed together.

    Args:
        cells_dir: the cells' directory.
        settings: each cell's identity.
        descs: each cell's label.
        compute: ``compute(indices)`` -> the missing cells' results in that order (every rank calls it).
        log: where progress lines go.
        shard: a partial shard's part of each cell.
        world: the ``torchrun`` processes.

    Returns:
        ``(result, cell id)`` per cell, in order; None for a result on ranks other than 0."""
    shard, world = shard or Shard(), world or World()
    cids = [cell_id(st) for st in settings]
    names = [cid if shard.whole else f"{cid}.{shard.tag}" for cid in cids]
    found = [_readable_cell(cells_dir, name, st, (), desc, log) if world.is_main else None
             for name, st, desc in zip(names, settings, descs)]
    have = world.broadcast([res is not None for res in found])
    missing = [n for n, h in enumerate(have) if not h]
    _check_targets(world, [f"{names[n]}{end}" for n in missing for end in (".csv", ".json")], cells_dir)
    for n in (n for n, h in enumerate(have) if h):
        log(f"{descs[n]}: done earlier, skipped ({names[n]})")
    for n, res in zip(missing, compute(missing) if missing else []):
        if world.is_main:
            res.save_cell(cells_dir, names[n], settings[n])
            log(f"{descs[n]}: {len(res.items)} items in {res.seconds:.0f} s, with {len(missing)} together "
                f"({names[n]})")
        found[n] = res
    return list(zip(found, cids))


def _check_targets(world: World, names: list[str], cells_dir: Path) -> None:
    """Rank 0 checks that no directory stands where the files ``names`` go; every rank raises its error."""
    error = None
    if world.is_main:
        try:
            check_file_targets(cells_dir / n for n in names)
        except OutlierscopeError as e:
            error = e
    world.agree(error)


def _readable_cell(cells_dir: Path, name: str, settings: dict, tables: tuple[str, ...], desc: str, log):
    """The complete cell ``name`` with ``settings``, or None: absent, other settings, or damaged or claiming another
    cell (one line says so; the caller computes it again and its files are replaced)."""
    try:
        if (cells_dir / f"{name}.json").exists():
            check_claim(cells_dir, name, EvalResult.load(cells_dir, name))
        return EvalResult.load_cell(cells_dir, name, settings, tables)
    except Damaged as e:
        log(f"{desc}: cell {name} is damaged: {e}; computing it again")
        return None


def check_claim(cells_dir: Path, name: str, res: EvalResult | None) -> None:
    """Check that a cell's record holds the settings its id is the digest of.

    Args:
        cells_dir: the cells' directory.
        name: the cell's (or part's) file stem.
        res: the result read back.

    Raises:
        Damaged: a record of another cell (swapped or renamed)."""
    cid = name.partition(".")[0]
    claimed = res.extra.get("cell") if res is not None else None
    try:
        held = cell_id(claimed)
    except (TypeError, KeyError, AttributeError):
        held = None
    if res is not None and held != cid:
        raise Damaged(f"{cells_dir / name}.json: holds the record of cell {held}, not of {cid} (swapped or renamed)")


def merged_cell(cell: str, dirs: list[Path], desc: str) -> tuple[EvalResult, dict]:
    """One cell of a ``--shard`` run from its parts: the whole result and its side tables (merged exactly).

    Args:
        cell: the cell's id.
        dirs: the shards' run directories (shard i in ``dirs[i]/cells``).
        desc: the cell's label."""
    from outlierscope.analysis.linear_error import LinearErrorStats
    from outlierscope.eval.evaluate import merge_results

    n, parts, sides, seen = len(dirs), [], {"attn_error": [], "linear_error": []}, set()
    for i, d in enumerate(dirs):
        name = f"{cell}.shard-{i}-of-{n}"
        try:
            res = EvalResult.load(d / "cells", name)
            check_claim(d / "cells", name, res)
        except Damaged as e:
            raise OutlierscopeError(f"part {i}/{n} of cell {cell}: {e}; rerun that shard (it resumes), then merge "
                                    "again") from None
        found = {key: d / "cells" / f"{name}.{key}.csv" for key in sides}
        found = {key: f for key, f in found.items() if f.exists()}
        if res is None or res_measured(res) and not found or i and set(found) != seen:
            raise OutlierscopeError(f"{d / 'cells'}: part {i}/{n} of cell {cell} is missing or incomplete; "
                                    f"rerun that shard (it resumes), then merge again")
        seen = set(found)
        parts.append(res)
        for key, f in found.items():
            sides[key].append(pd.read_csv(f, float_precision="round_trip"))
    merged = merge_results(parts, desc=desc)
    merged.extra["cell"] = parts[0].extra["cell"]
    out = {}
    for key, cls in (("attn_error", AttentionErrorStats), ("linear_error", LinearErrorStats)):
        if sides[key]:
            layers = 1 + max((int(t["layer"].max()) for t in sides[key] if len(t)), default=0)
            out[key] = cls.from_shard_tables(sides[key], layers).table()
    return merged, out


def res_measured(res: EvalResult) -> bool:
    """Whether a cell was computed with its errors measured (``attn_error`` in its settings).

    Args:
        res: the cell's result."""
    return bool(res.extra.get("cell", {}).get("attn_error"))
