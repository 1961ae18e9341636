"""``load_run``: every table a profile, sweep or reproduce run wrote, read back and validated
(``tables`` by file stem, ``cells`` the per-item results of each sweep cell).

A run directory holds a profile (``profile.json``, ``table5.csv``, ``per_layer.csv``, ...) and/or a
sweep (``sweep.json``, ``sweep.csv``), at its top level or in ``profile/`` and ``sweep/``
subdirectories (the layout of ``reproduce``). A damaged table (truncated, binary, missing columns,
no rows) is a one-line error naming the file, never a figure drawn from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from outlierscope.errors import OutlierscopeError
from outlierscope.io import read_record, vouched

SWEEP_COLUMNS = ["model", "task", "bits", "label", "format", "granularity", "weights", "metric", "value", "stderr",
                 "delta_vs_16", "ci_low", "ci_high", "mcnemar_p", "n_items", "chance", "cell"]
# file stem -> (required columns, numeric columns); tables a run may lack are simply absent
PROFILE_TABLES = {
    "table5": (["model", "activation", "top1", "top2", "top3", "top10", "top100", "median"],
               ["top1", "top2", "top3", "top10", "top100", "median"]),
    "per_layer": (["model", "point", "layer", "top1", "top3", "median"], ["layer", "top1", "top3", "median"]),
    "per_head": (["model", "layer", "head", "max"], ["layer", "head", "max"]),
    "per_channel": (["model", "layer", "channel", "max"], ["layer", "channel", "max"]),
    "histograms": (["model", "point", "layer", "head", "lo", "hi", "count"], ["lo", "hi", "count"]),
    "outlier_features": (["model"], []),
    "massive_activations": (["model"], []),
    "topk_logits": (["model", "rank", "value", "layer", "head", "seq", "query", "key"], ["value"]),
    "topk_hidden": (["model", "rank", "value", "layer", "channel", "seq", "token"], ["value"]),
    "lambda": (["model", "layer", "lambda_init", "lambda"], ["lambda_init", "lambda"]),
    "channels": (["model", "point", "layer", "channel", "absmax", "mean_abs"], ["layer", "channel", "absmax", "mean_abs"]),
    "positions": (["model", "point", "layer", "position", "absmax_max"], ["layer", "position", "absmax_max"]),
    "massive": (["model", "point", "layer", "seq", "token", "channel", "position_kind", "value"], ["value"]),
    "massive_recurrence": (["model", "point", "layer", "channel", "position_kind", "share_of_sequences"],
                           ["share_of_sequences"]),
    "int8_features": (["model", "point", "channel"], []),
    "sinks": (["model", "point", "layer", "head", "mass_first", "mass_first_k"], ["mass_first", "mass_first_k"]),
}
SWEEP_TABLES = {"sweep": (["model", "bits", "label", "granularity", "metric", "value", "stderr", "n_items"],
                          ["bits", "value"]),
                "attn_error": (["model", "task", "bits", "label", "layer", "head", "rows", "kl_mean", "kl_max",
                                "argmax_change_rate"], ["layer", "head", "rows", "kl_mean", "argmax_change_rate"]),
                "linear_error": (["model", "task", "label", "layer", "linear", "tokens", "rel_err_mean", "rel_err_max"],
                                 ["layer", "tokens", "rel_err_mean", "rel_err_max"]),
                "gold_ll": (["model", "task", "label", "n_items", "delta_gold_ll", "ci_low", "ci_high"],
                            ["n_items", "delta_gold_ll", "ci_low", "ci_high"])}
MAY_BE_EMPTY = {"outlier_features", "massive_activations", "per_head", "per_channel", "massive", "massive_recurrence",
                "int8_features"}


@dataclass
class RunResults:
    """The tables and records of a run directory, as ``load_run`` reads them: ``run["sweep"]``, ``run["table5"]`` ...

    Attributes:
        root: the run directory.
        profile_dir: where its profile is (None: none).
        sweep_dir: where its sweep is (None: none).
        tables: table stem (``table5``, ``per_layer``, ..., ``sweep``) -> its DataFrame.
        profile_meta: the profile's record (``profile.json``).
        sweep_meta: the sweep's record (``sweep.json``).
        cells: sweep cell id -> its per-item scores and predictions."""

    root: Path
    profile_dir: Path | None = None
    sweep_dir: Path | None = None
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    profile_meta: dict | None = None
    sweep_meta: dict | None = None
    cells: dict[str, pd.DataFrame] = field(default_factory=dict)

    def outcome(self) -> str:
        """The measured outcome in plain words (the report's first paragraph)."""
        from outlierscope.report.outcome import outcome_paragraph

        return outcome_paragraph(self)

    def __getitem__(self, name: str) -> pd.DataFrame:
        if name not in self.tables:
            import difflib

            close = difflib.get_close_matches(name, list(self.tables), n=3)
            raise KeyError(f"no table {name!r} in {self.root} (has {', '.join(self.tables) or 'none'})"
                           + (f"; did you mean {', '.join(close)}?" if close else ""))
        return self.tables[name]


def read_table(path: Path, required: list[str], numeric: list[str], may_be_empty: bool = False,
               record: dict | None = None, what: str = "run") -> pd.DataFrame | None:
    """A validated CSV result table; None when absent (or legitimately empty); a one-line error when damaged.

    Args:
        path: the table.
        required: its columns.
        numeric: the columns that hold numbers only.
        may_be_empty: whether a table without rows is legitimate.
        record: the record of the run that wrote it; the table must match the digest it lists.
        what: the run's kind, for the error."""
    if not path.exists():
        return None
    if record is not None:
        vouched(record, path.parent, path.name, what)
    try:
        df = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        if may_be_empty:
            return None
        raise OutlierscopeError(f"{path} is empty; the run that wrote it did not finish: run it again") from None
    except (UnicodeDecodeError, pd.errors.ParserError, ValueError) as e:
        raise OutlierscopeError(f"{path} is not a readable CSV table ({str(e).splitlines()[0][:120]}); "
                                "it is damaged: run the command that wrote it again") from None
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            cut = size > 0 and f.seek(size - 1) >= 0 and f.read(1) != b"\n"
    except OSError as e:
        raise OutlierscopeError(f"{path} cannot be read ({e.strerror}); check its permissions") from None
    if cut:  # every table is written whole, newline-terminated, atomically: a missing last newline is a cut file
        raise OutlierscopeError(f"{path} ends in the middle of a row: the file is truncated; run the command that wrote "
                                "it again (or restore it)")
    missing = [c for c in required if c not in df.columns]
    if missing and not (may_be_empty and df.empty):
        raise OutlierscopeError(f"{path} lacks column(s) {', '.join(missing)}; expected a table written by outlierscope "
                                "(run the command that wrote it again)")
    if df.empty:
        if may_be_empty:
            return None
        raise OutlierscopeError(f"{path} has a header but no rows; the run that wrote it did not finish: run it again")
    for c in numeric:
        if not pd.api.types.is_numeric_dtype(df[c]):
            raise OutlierscopeError(f"{path}: column {c} holds non-numeric values; the file is damaged: run the command "
                                    "that wrote it again")
    blank = [c for c in numeric if df[c].isna().any()]
    if blank:
        row = int(df[blank[0]].isna().to_numpy().argmax()) + 2  # 1-based, after the header
        raise OutlierscopeError(f"{path}: line {row} has no value in column {blank[0]}; the file is damaged: run the "
                                "command that wrote it again")
    return df


def check_sweep_rows(path: Path, sweep: pd.DataFrame) -> None:
    """Refuse a sweep table cut at a line end: every cell must have all its rows, every (task, model) its 16-bit row.

    A cell's rows are its task's metrics, and for a quantized cell also its flip rates and mean |score change|.

    Args:
        path: the table's path, for the error.
        sweep: the table."""
    from outlierscope.quant.numerics.names import UNQUANTIZED_BITS
    from outlierscope.report.tables import FLIP_METRIC

    for task, t in sweep.groupby("task", sort=False):
        metrics = [m for m in FLIP_METRIC if m in set(t["metric"])]
        for (model, label), g in t.groupby(["model", "label"], sort=False):
            need = set(metrics)
            if int(g["bits"].iloc[0]) != UNQUANTIZED_BITS:
                need |= {FLIP_METRIC[m] for m in metrics} | {"mean_abs_score_change"}
                if not (t[t["model"] == model]["bits"] == UNQUANTIZED_BITS).any():
                    raise OutlierscopeError(f"{path}: {model} on {task} has no 16-bit (unquantized) rows to compare "
                                            f"{label} with; the table is incomplete: run the sweep again")
            missing = sorted(need - set(g["metric"]))
            if missing:
                raise OutlierscopeError(f"{path}: {model} {task} {label} lacks row(s) {', '.join(missing)}; the table "
                                        "is incomplete (cut?): run the command that wrote it again")


def load_run(run_dir: str | Path) -> RunResults:
    """Every table and record of a profile, sweep or reproduce output directory, each checked against its record's digest.

    Args:
        run_dir: the run's output directory.

    Returns:
        The ``RunResults``: ``run["sweep"]``, ``run["table5"]``, ... and the records.

    Raises:
        OutlierscopeError: a missing directory, or a table or record that does not match its digest."""
    root = Path(run_dir)
    if not root.is_dir():
        raise OutlierscopeError(f"run directory not found: {root}; pass the output directory of a profile, sweep or reproduce run")
    res = RunResults(root)
    for cand in (root, root / "profile"):
        if (cand / "profile.json").exists():
            _load_profile(res, cand)
            break
    for cand in (root, root / "sweep"):
        if (cand / "sweep.csv").exists() or (cand / "sweep.json").exists():
            _load_sweep(res, cand)
            break
    if res.profile_dir is None and res.sweep_dir is None:
        raise OutlierscopeError(f"{root} holds no profile.json or sweep.csv (also looked in profile/ and sweep/)")
    return res


def _load_profile(res: RunResults, cand: Path) -> None:
    """The profile record and every table it lists into ``res``."""
    res.profile_dir, res.profile_meta = cand, read_record(cand / "profile.json", what="profile record")
    for name, (req, num) in PROFILE_TABLES.items():
        df = read_table(cand / f"{name}.csv", req, num, name in MAY_BE_EMPTY, res.profile_meta, "profile")
        if df is not None:
            res.tables[name] = df


def _load_sweep(res: RunResults, cand: Path) -> None:
    """The sweep record, its tables and its cells' per-item tables into ``res``."""
    res.sweep_dir = cand
    meta = res.sweep_meta = read_record(cand / "sweep.json", what="sweep record")
    req, num = SWEEP_TABLES["sweep"]
    sw = read_table(cand / "sweep.csv", req, num, record=meta, what="sweep")
    if sw is None:
        raise OutlierscopeError(f"{cand / 'sweep.csv'}: missing beside its sweep.json; run the sweep again")
    res.tables["sweep"] = sw
    if "task" not in sw:  # a one-task sweep of an older version: its task from the record, else HellaSwag
        settings = meta.get("settings", {})
        sw.insert(1, "task", settings.get("task", (settings.get("tasks") or ["hellaswag"])[0]))
    if "chance" not in sw:  # an older sweep without the column: the record's, else HellaSwag's 25%
        sw.insert(sw.columns.get_loc("n_items") + 1, "chance", float(meta.get("chance", 25.0)))
    check_sweep_rows(cand / "sweep.csv", sw)
    for name in ("attn_error", "gold_ll", "linear_error"):  # measured where the sweep's settings asked
        df = read_table(cand / f"{name}.csv", *SWEEP_TABLES[name], record=meta, what="sweep")
        if df is not None:
            res.tables[name] = df
    for cid in dict.fromkeys(sw["cell"]) if "cell" in sw else ():
        if (cand / "cells" / f"{cid}.json").exists():
            cell = read_record(cand / "cells" / f"{cid}.json", what="cell record")
            df = read_table(cand / "cells" / f"{cid}.csv", ["index", "label", "pred", "pred_norm"], ["index", "label"],
                            record=cell, what="cell")
            if df is not None:
                res.cells[cid] = df
