"""Two perplexity runs on the same windows, compared spec by spec and paired by window (the pair: the Transformer
and the Diff model under the same schemes): which model's output distribution a scheme moves more.

    a, b  = perplexity.json and cells/ of two `outlierscope perplexity` runs       # same text, protocol, windows
    for each quantized spec both ran (by its canonical text):
        paired_runs(cell_a, cell_b)      # each model's NLL change and mean KLD to its own unquantized self,
                                         # b - a and KLD b / a with 95% intervals over windows (resampled jointly)
    compare.csv, compare.md, compare.json (both runs' records, commit, machine)

``rank_against_task``: do the schemes' mean KLD and a sweep's gold log-likelihood change of the same model rank them
alike (Spearman's rho, windows and items resampled together)?

Each run's KLD is to its own unquantized model, so the comparison asks how far each scheme moves each model, not
which model is better; windows hold the same tokens only when both models share a tokenizer (checked).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from outlierscope.analysis.kld import paired_runs
from outlierscope.errors import OutlierscopeError, check_seed
from outlierscope.eval.perplexity import TokenScores
from outlierscope.io import git_commit, machine, output_dir, versions, write_csv, write_run_record, write_text

SAME = ("length", "windows", "scored_tokens")  # record fields both runs must share (and the text's digest, protocol)
COLUMNS = ("label", "quant", "windows", "tokens", "delta_nll_a", "delta_nll_b", "delta_nll_diff",
           "delta_nll_diff_ci_low", "delta_nll_diff_ci_high", "kld_a", "kld_b", "kld_diff", "kld_diff_ci_low",
           "kld_diff_ci_high", "kld_ratio", "kld_ratio_ci_low", "kld_ratio_ci_high", "moved_less")


def _run(path: Path) -> tuple[dict, pd.DataFrame]:
    rec_path, csv = path / "perplexity.json", path / "perplexity.csv"
    if not rec_path.exists() or not csv.exists():
        raise OutlierscopeError(f"{path}: no perplexity.json / perplexity.csv; expected an `outlierscope perplexity` "
                                "output directory whose run finished")
    from outlierscope.io import read_record, vouched

    rec = read_record(rec_path, ("settings",), "perplexity record")
    return rec, pd.read_csv(vouched(rec, path, "perplexity.csv", "perplexity run"))


def _cell(run: Path, cell: str) -> TokenScores:
    path = run / "cells" / f"{cell}.npz"
    if not path.exists():
        raise OutlierscopeError(f"{path} is missing: the per-token cells of a perplexity run are not committed with "
                                f"its tables; run its `outlierscope perplexity` command again into {run} (it resumes)")
    from outlierscope.runs.text_cells import read_cell

    return read_cell(run / "cells", cell)


def check_pairable(rec_a: dict, rec_b: dict, a: Path, b: Path) -> None:
    """Refuse, in one line, two perplexity runs whose windows can differ, naming the first setting that does.

    The text, the protocol, the tokenizer (its files' digest, where both records hold one), the window length and
    counts.

    Args:
        rec_a: the first run's record.
        rec_b: the second's.
        a: the first run's directory, for the error.
        b: the second's."""
    tok_a, tok_b = ((r.get("tokenizer") or {}).get("files_sha256") for r in (rec_a, rec_b))
    if tok_a and tok_b and tok_a != tok_b:
        raise OutlierscopeError(f"{a} and {b} ran models with different tokenizers (files sha256 {tok_a[:12]} vs "
                                f"{tok_b[:12]}): their windows hold other tokens; pair runs of models of one tokenizer")
    pairs = [("text sha256", rec_a["text"]["sha256"], rec_b["text"]["sha256"]),
             ("protocol", rec_a["settings"]["protocol"], rec_b["settings"]["protocol"])]
    pairs += [(k, rec_a[k], rec_b[k]) for k in SAME]
    for name, va, vb in pairs:
        if va != vb:
            raise OutlierscopeError(f"{a} and {b} differ in {name} ({va} vs {vb}); pair runs of one text, protocol and "
                                    "length with --max-windows alike")


def _rows(a: Path, b: Path, table_a: pd.DataFrame, table_b: pd.DataFrame, seed: int) -> list[dict]:
    rows = []
    common = [q for q in table_a["quant"] if q in set(table_b["quant"]) and q != "none"]
    if not common:
        raise OutlierscopeError(f"{a} and {b} share no quantized spec; run the same --bits/--quant on both")
    for quant in common:
        ra, rb = (t[t["quant"] == quant].iloc[0] for t in (table_a, table_b))
        tokens_a, tokens_b = _cell(a, ra["cell"]), _cell(b, rb["cell"])
        try:
            stats = paired_runs(tokens_a, tokens_b, seed)
        except ValueError as e:
            raise OutlierscopeError(f"{a} and {b}: {e}") from None
        rows.append({"label": ra["label"], "quant": quant, **stats, "moved_less": _moved_less(stats)})
    return rows


def _moved_less(stats: dict) -> str:
    """``a``, ``b`` or ``neither`` by the KLD ratio's interval (b / a below 1: b moved less)."""
    lo, hi = stats["kld_ratio_ci_low"], stats["kld_ratio_ci_high"]
    if math.isnan(lo) or lo <= 1 <= hi:
        return "neither"
    return "b" if hi < 1 else "a"


def compare_perplexity(a: str | Path, b: str | Path, out: str | Path, seed: int = 0) -> pd.DataFrame:
    """Compare two perplexity runs of one text, each model against its own unquantized self, paired by window.

    Args:
        a: the first run's directory.
        b: the second's.
        out: where ``compare.csv``, ``compare.md`` and the record go.
        seed: the bootstrap's seed.

    Returns:
        The table."""
    check_seed(seed)
    a, b, out = Path(a), Path(b), Path(out)
    (rec_a, table_a), (rec_b, table_b) = _run(a), _run(b)
    check_pairable(rec_a, rec_b, a, b)
    table = pd.DataFrame(_rows(a, b, table_a, table_b, seed))[list(COLUMNS)]
    names = (rec_a["settings"]["model"], rec_b["settings"]["model"])
    with output_dir(out):
        write_csv(out / "compare.csv", table)
        write_text(out / "compare.md", compare_markdown(table, *names))
        write_run_record(out / "compare.json", {"a": {"dir": str(a), **rec_a}, "b": {"dir": str(b), **rec_b},
                                                "seed": seed, "versions": versions(), "machine": machine(),
                                                "git_commit": git_commit()}, ["compare.csv", "compare.md"])
    return table


def compare_markdown(table: pd.DataFrame, name_a: str, name_b: str) -> str:
    """One row per spec: each model's NLL change and mean KLD, the differences and the KLD ratio with intervals.

    Args:
        table: ``compare_perplexity``'s table.
        name_a: the first model's name.
        name_b: the second's."""
    head = (f"a = {name_a}, b = {name_b}; each against its own unquantized model, paired by window (95% intervals "
            "over windows)\n\n| spec | ΔNLL a | ΔNLL b | b − a [95% CI] | KLD a | KLD b | KLD b / a [95% CI] | "
            "moved less |\n|---|---|---|---|---|---|---|---|\n")
    who = {"a": name_a, "b": name_b, "neither": "neither (interval spans 1)"}
    lines = [f"| {r['label']} | {r['delta_nll_a']:+.5f} | {r['delta_nll_b']:+.5f} | {r['delta_nll_diff']:+.5f} "
             f"[{r['delta_nll_diff_ci_low']:+.5f}, {r['delta_nll_diff_ci_high']:+.5f}] | {r['kld_a']:.6f} | "
             f"{r['kld_b']:.6f} | {r['kld_ratio']:.3f} [{r['kld_ratio_ci_low']:.3f}, {r['kld_ratio_ci_high']:.3f}] | "
             f"{who[r['moved_less']]} |" for r in table.to_dict("records")]
    return head + "\n".join(lines) + "\n"


AGREEMENT_COLUMNS = ("label", "quant", "kld", "delta_gold_ll", "kld_rank", "harm_rank")


def _sweep_gold(sweep_dir: Path, model: str) -> tuple[str, dict[str, np.ndarray]]:
    """The task and, per quantized spec text of ``model``'s cells in a sweep, each item's gold log-likelihood change
    against its unquantized cell (the sweep's items, in its order)."""
    from outlierscope.eval.evaluate import EvalResult
    from outlierscope.io import read_record
    from outlierscope.runs.sweep import SweepSettings

    rec = read_record(sweep_dir / "sweep.json", ("settings", "cells"), "sweep record")
    s = SweepSettings.from_record(rec["settings"])
    if len(s.tasks) != 1:
        raise OutlierscopeError(f"{sweep_dir}: a sweep of {len(s.tasks)} tasks; give a sweep of one task")
    results = {}
    for c in rec["cells"]:
        if c["model"] == model:
            res = EvalResult.load(sweep_dir / "cells", c["cell"])
            if res is None:
                raise OutlierscopeError(f"{sweep_dir / 'cells'}: cell {c['cell']} is missing or incomplete")
            results[str(s.spec_of(c))] = res
    if "none" not in results:
        raise OutlierscopeError(f"{sweep_dir}: no unquantized cell of {model} (models there: "
                                f"{', '.join(sorted({c['model'] for c in rec['cells']}))})")
    base = results.pop("none")
    return s.tasks[0], {q: r.gold_loglik() - base.gold_loglik() for q, r in results.items()}


def rank_against_task(perplexity_dir: str | Path, sweep_dir: str | Path, out: str | Path, seed: int = 0) -> dict:
    """Spearman's rho of the schemes ranked by a perplexity run's mean KLD and by a sweep's gold log-likelihood loss.

    The schemes both ran (by spec text), with the window-and-item bootstrap interval (``rank_agreement``); writes
    rank_agreement.csv/.md/.json.

    Args:
        perplexity_dir: the perplexity run.
        sweep_dir: a sweep of the same model.
        out: where the files go.
        seed: the bootstrap's seed."""
    from outlierscope.analysis.agreement import rank_agreement
    from outlierscope.analysis.kld import window_blocks

    check_seed(seed)
    perplexity_dir, sweep_dir, out = Path(perplexity_dir), Path(sweep_dir), Path(out)
    rec, table = _run(perplexity_dir)
    model = rec["settings"]["model"]
    task, gold = _sweep_gold(sweep_dir, model)
    rows = [r for r in table.to_dict("records") if r["quant"] != "none" and r["quant"] in gold]
    if len(rows) < 3:
        raise OutlierscopeError(f"{perplexity_dir} and {sweep_dir} share {len(rows)} quantized spec(s) of {model}; "
                                "a ranking needs 3 or more")
    blocks = [window_blocks(_cell(perplexity_dir, r["cell"])) for r in rows]
    counts = blocks[0][0]
    stats = rank_agreement(counts, np.stack([b[2] for b in blocks], 1), np.stack([gold[r["quant"]] for r in rows], 1),
                           seed)
    frame = pd.DataFrame({"label": [r["label"] for r in rows], "quant": [r["quant"] for r in rows],
                          "kld": stats["kld"], "delta_gold_ll": stats["gold"]})
    frame["kld_rank"] = frame["kld"].rank(ascending=False).astype(int)
    frame["harm_rank"] = frame["delta_gold_ll"].rank(ascending=True).astype(int)
    summary = {k: stats[k] for k in ("spearman", "ci_low", "ci_high", "schemes", "windows", "items")}
    with output_dir(out):
        write_csv(out / "rank_agreement.csv", frame[list(AGREEMENT_COLUMNS)])
        write_text(out / "rank_agreement.md", agreement_markdown(frame, summary, model, task))
        write_run_record(out / "rank_agreement.json", {"model": model, "task": task, **summary, "seed": seed,
                                                       "perplexity": str(perplexity_dir), "sweep": str(sweep_dir),
                                                       "versions": versions(), "machine": machine(),
                                                       "git_commit": git_commit()},
                         ["rank_agreement.csv", "rank_agreement.md"])
    return summary


def agreement_markdown(frame: pd.DataFrame, summary: dict, model: str, task: str) -> str:
    """The rank agreement as markdown: rho with its interval, then each scheme's mean KLD, harm and ranks.

    Args:
        frame: the schemes' table.
        summary: rho, its interval and the counts.
        model: the model's name.
        task: the task's label."""
    head = (f"{model}: Spearman's rho between mean KLD (running text) and the {task} gold log-likelihood harm over "
            f"{summary['schemes']} schemes = {summary['spearman']:+.3f} [{summary['ci_low']:+.3f}, "
            f"{summary['ci_high']:+.3f}] (95%, {summary['windows']} windows and {summary['items']} items resampled)\n\n"
            "| spec | mean KLD | rank | ΔNLL gold (nats) | rank |\n|---|---|---|---|---|\n")
    lines = [f"| {r['label']} | {r['kld']:.6f} | {r['kld_rank']} | {r['delta_gold_ll']:+.4f} | {r['harm_rank']} |"
             for r in frame.sort_values("kld_rank").to_dict("records")]
    return head + "\n".join(lines) + "\n"
