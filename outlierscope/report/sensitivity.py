"""A sensitivity run's tables as markdown (``outlierscope.runs.sensitivity`` writes them), and read back from its
files so that ``sensitivity.md`` can be re-rendered from ``sensitivity.json``, ``sensitivity.csv`` and ``greedy.csv``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from outlierscope.analysis.harm import rank_by_of
from outlierscope.io import read_record, vouched
from outlierscope.quant.numerics.names import UNQUANTIZED_BITS


def load_sensitivity(run_dir: str | Path) -> tuple[dict, pd.DataFrame, list[dict]]:
    """A sensitivity run directory as the run held it, each table checked against its record's digest.

    Args:
        run_dir: the directory.

    Returns:
        ``(record, per-layer table, greedy tries)``."""
    d = Path(run_dir)
    record = read_record(d / "sensitivity.json", ("settings", "final"), "sensitivity record")
    greedy = vouched(record, d, "greedy.csv", "sensitivity study")
    tries = pd.read_csv(greedy, keep_default_na=False).to_dict("records")  # "" = no layer kept
    return record, pd.read_csv(vouched(record, d, "sensitivity.csv", "sensitivity study")), tries


def load_kinds(run_dir: str | Path) -> pd.DataFrame | None:
    """A linear scheme's per-kind table (``kinds.csv``: q_proj ... down_proj, each quantized alone), checked.

    Args:
        run_dir: the directory.

    Returns:
        The table; None when the study has none."""
    d = Path(run_dir)
    if not (d / "kinds.csv").exists():
        return None
    record = read_record(d / "sensitivity.json", ("settings",), "sensitivity record")
    return pd.read_csv(vouched(record, d, "kinds.csv", "sensitivity study"), float_precision="round_trip")


def kept_as(keep_bits: int) -> str:
    """How a sensitivity run's kept layers run: ``unquantized`` (16 bits) or ``at 8 bits``.

    Args:
        keep_bits: the run's ``keep_bits``."""
    return "unquantized" if keep_bits == UNQUANTIZED_BITS else f"at {keep_bits} bits"


def _quant_said(settings: dict, quote: str = "`") -> str:
    """What each layer in turn gets: the attention recipe or spec (``--quant``) with its canonical text, else the
    logits' bits, format and granularity."""
    q = settings.get("quant")
    if not q:
        return f"{settings['bits']}-bit {settings['format']} {settings['granularity']}"
    from outlierscope.quant.specs.spec import QuantSpec

    text = str(QuantSpec.parse(q))
    return q if text == q else f"{q} ({quote}{text}{quote})"


def quantized_said(settings: dict) -> str:
    """What each layer in turn gets, for a figure's title: quantized attention logits, or the recipe or spec.

    Args:
        settings: the run's settings."""
    return "quantized attention logits" if not settings.get("quant") else _quant_said(settings, quote="")


def sensitivity_markdown(record: dict, table: pd.DataFrame, tries: list[dict], kinds: pd.DataFrame | None = None) -> str:
    """A sensitivity run as markdown: the settings, the layers by harm, every greedy try, the rank correlation.

    Args:
        record: the run's record.
        table: its per-layer table.
        tries: its greedy tries.
        kinds: its per-kind table, where it has one."""
    if rank_by_of(record["settings"]).on_text:
        return _text_markdown(record, table, tries, kinds)
    s, metric = record["settings"], record["metric"]
    quant = _quant_said(s)
    final = record["final"]
    reach = ("a loss of at most" if final["within_tolerance"] else "NOT within a loss of") + f" {s['tolerance']} nats"
    lines = [f"# Per-layer sensitivity: {s['model']}, {s['task']}, {quant}", "",
             f"{record['n_items']} items ({'sample' if s['sample'] else 'first'} {s['sample'] or s['limit'] or 'all'}, "
             f"seed {s['seed']}); damage = mean change of the gold choice's log-likelihood (nats, < 0 hurts) against "
             f"the unquantized model; Δ{metric} in points; flip = share of items whose prediction changes.", "",
             f"Greedy suggestion: keep layers {record['keep'] or 'none'} {kept_as(record['keep_bits'])}, quantize "
             f"{len(record['quantized'])} of {record['n_layers']}: {final['delta_gold_ll']:+.4f} nats ({reach}), "
             f"Δ{metric} {final[f'delta_{metric}'] * 100:+.2f}, flip {final['flip_rate'] * 100:.1f}%.", "",
             f"Spearman rank correlation of harm with the layer's top-1/median {outliers_said(record)}: "
             f"{record['spearman_damage_vs_outlier_ratio']:+.2f} (> 0: larger outliers, more harm)"
             + (f"; with the layer's mean attention KL: {record['spearman_damage_vs_kl_mean']:+.2f}"
                if record.get("spearman_damage_vs_kl_mean") is not None else "") + ".", ""]
    cols = [("rank", "Rank", "{:d}"), ("layer", "Layer", "{:d}"), ("only_delta_gold_ll", "only: damage", "{:+.4f}"),
            (f"only_delta_{metric}", f"only: Δ{metric}", "pct"), ("only_flip_rate", "only: flip", "pct%"),
            ("all_but_delta_gold_ll", "all but: damage", "{:+.4f}"), ("kl_mean", "KL mean", "{:.4f}"),
            ("kl_max", "KL max", "{:.3f}"), ("argmax_change_rate", "top key lost", "pct%"),
            ("rel_out_mean", "rel. out error", "{:.4f}"), ("outlier_ratio", "top-1/median", "{:.1f}")]
    cols = [c for c in cols if c[0] in table]

    def fmt(v, f):
        return f"{v * 100:+.2f}" if f == "pct" else f"{v * 100:.2f}%" if f == "pct%" else f.format(v)

    lines += ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for _, r in table.sort_values("rank").iterrows():
        lines.append("| " + " | ".join(fmt(int(r[k]) if f == "{:d}" else r[k], f) for k, _, f in cols) + " |")
    lines += ["", "Greedy tries (bisection over k, the number of most harmful layers kept):", "",
              f"| kept | kept layers | damage | Δ{metric} | flip | within |", "|---|---|---|---|---|---|"]
    for t in tries:
        lines.append(f"| {t['kept']} | {t['kept_layers']} | "
                     f"{t['delta_gold_ll']:+.4f} | {t[f'delta_{metric}'] * 100:+.2f} | {t['flip_rate'] * 100:.1f}% | "
                     f"{'yes' if t['within_tolerance'] else 'no'} |")
    if kinds is not None:
        lines += ["", "Linear kinds, each quantized alone in every layer (most harmful first):", "",
                  f"| linear | damage | Δ{metric} | flip |", "|---|---|---|---|"]
        for _, r in kinds.sort_values(["delta_gold_ll", "linear"]).iterrows():
            lines.append(f"| {r['linear']} | {r['delta_gold_ll']:+.4f} | {r[f'delta_{metric}'] * 100:+.2f} | "
                         f"{r['flip_rate'] * 100:.1f}% |")
    return "\n".join(lines) + "\n"


def _text_markdown(record: dict, table: pd.DataFrame, tries: list[dict], kinds: pd.DataFrame | None) -> str:
    """``sensitivity_markdown`` of a run ranked on running text (metric kld or ppl)."""
    s, rb, t = record["settings"], rank_by_of(record["settings"]), record["rank_by"]
    final = record["final"]
    reach = ("at most" if final["within_tolerance"] else "NOT within") + f" {s['tolerance']} {rb.unit}"
    lines = [f"# Per-layer sensitivity: {s['model']}, {t['text']['source']}, {_quant_said(s)}", "",
             f"{t['windows']} {t['protocol']} windows of {t['length']} tokens, {t['scored_tokens']:,} scored tokens; "
             f"ranked by {rb.label}. KLD: mean KL divergence to the unquantized model at every scored token (nats, "
             "> 0 hurts) with its 95% interval over windows; ln PPL ratio = the mean NLL change; same top: share of "
             "tokens whose most likely next token is unchanged.", "",
             f"Greedy suggestion: keep layers {record['keep'] or 'none'} unquantized, quantize "
             f"{len(record['quantized'])} of {record['n_layers']}: {rb.column} {final[rb.column]:.5f} ({reach}), "
             f"mean KLD {final['kld_mean']:.5f}, ln PPL ratio {final['ln_ppl_ratio']:+.5f}, same top "
             f"{final['same_top'] * 100:.2f}%.", "",
             f"Spearman rank correlation of harm with the layer's top-1/median {outliers_said(record)}: "
             f"{record['spearman_damage_vs_outlier_ratio']:+.2f} (> 0: larger outliers, more harm).", "",
             "| Rank | Layer | only: KLD [95% CI] | only: ln PPL ratio | only: same top | all but: KLD | top-1/median |",
             "|---|---|---|---|---|---|---|"]
    for _, r in table.sort_values("rank").iterrows():
        rest = f"{r['all_but_kld_mean']:.5f}" if "all_but_kld_mean" in r else "-"
        lines.append(f"| {int(r['rank'])} | {int(r['layer'])} | {_kld(r, 'only_')} | {r['only_ln_ppl_ratio']:+.5f} | "
                     f"{r['only_same_top'] * 100:.2f}% | {rest} | {r['outlier_ratio']:.1f} |")
    lines += ["", "Greedy tries (bisection over k, the number of most harmful layers kept):", "",
              "| kept | kept layers | KLD [95% CI] | ln PPL ratio | same top | within |", "|---|---|---|---|---|---|"]
    for tr in tries:
        lines.append(f"| {tr['kept']} | {tr['kept_layers']} | {_kld(tr, '')} | {tr['ln_ppl_ratio']:+.5f} | "
                     f"{tr['same_top'] * 100:.2f}% | {'yes' if tr['within_tolerance'] else 'no'} |")
    if t.get("stability"):
        lines += ["", f"How much text the ranking needs: windows drawn with replacement "
                  f"({t['stability'][0]['draws']} draws each), Spearman "
                  f"of the layers' {rb.column} on them with the ranking on all {t['windows']} windows:", "",
                  "| windows | tokens | median ρ | 5% ρ | same most harmful layer |", "|---|---|---|---|---|"]
        for r in t["stability"]:
            lines.append(f"| {r['windows']} | {r['tokens']:,.0f} | {r['spearman_median']:+.3f} | "
                         f"{r['spearman_p5']:+.3f} | {r['same_top'] * 100:.1f}% |")
    if kinds is not None:
        lines += ["", "Linear kinds, each quantized alone in every layer (most harmful first):", "",
                  "| linear | KLD [95% CI] | ln PPL ratio | same top |", "|---|---|---|---|"]
        order = kinds.assign(_h=rb.harm(kinds[rb.column])).sort_values(["_h", "linear"], ascending=[False, True])
        for _, r in order.iterrows():
            lines.append(f"| {r['linear']} | {_kld(r, '')} | {r['ln_ppl_ratio']:+.5f} | {r['same_top'] * 100:.2f}% |")
    return "\n".join(lines) + "\n"


def _kld(r, prefix: str) -> str:
    return f"{r[prefix + 'kld_mean']:.5f} [{r[prefix + 'kld_ci_low']:.5f}, {r[prefix + 'kld_ci_high']:.5f}]"


LOGITS = ["layers.*.attn.logits"]


def outliers_said(record: dict) -> str:
    """What a sensitivity run's outlier ratio measures (its ``outlier_points``; without them: the logits).

    Args:
        record: the run's record."""
    points = record.get("outlier_points") or LOGITS
    if points == LOGITS:
        return "|logit|"
    return "|x| over its logits and quantized linears' inputs" if LOGITS[0] in points else \
        "|input| of its quantized linears"

