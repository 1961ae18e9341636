"""Emulated vs real on running text: a quantized checkpoint, its float source and each emulation of its scheme
compared token by token by their whole next-token distributions (``compare-quant --metric text``).

    windows  = the text cut by the float model's tokenizer (the checkpoint's must cut it alike: checked)
    forwards = per batch, once each: the float model, the checkpoint's own quantized forward, the float model
               under each emulation (n + 2 forwards for n emulations)
    pairs    = float vs real                     # KL(float || real)
               float vs each emulation           # perplexity cells: KLD to float
               real vs each emulation            # KL(real || emulated): 0 when exact
    compare.csv / compare.md (one row per pair, b against a: PPL of b, ln PPL ratio, NLL change and mean KLD with
    95% intervals over windows, 99.9% KLD, same top token, RMS dp), figures/, compare.json

Both models are held in memory at once (the checkpoint decoded to the float dtype): twice one model's weights.
Every pair is a cell of per-token values saved per virtual shard of the windows (resumable).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from outlierscope.errors import ParamError
from outlierscope.eval.perplexity import TokenScores
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.weights.calibration import calibration_records
from outlierscope.runs.cells import cell_id

UNQUANTIZED = QuantSpec()


def text_windows(s, records: dict | None = None, log=print) -> dict:
    """The text, the window length and the windows, cut by the float model's tokenizer; the checkpoint's must cut alike.

    Else its tokens and the float model's are not the same events.

    Args:
        s: the comparison's settings.
        records: model -> its ``inspect_model``, where the caller has it.
        log: where progress lines go.

    Raises:
        ParamError: a float model whose tokenizer cuts the text otherwise."""
    from outlierscope.models.loading import inspect_model
    from outlierscope.runs.perplexity import prepare_windows, windows_said

    records = {m: (records or {}).get(m) or inspect_model(m, s.trust_remote_code) for m in (s.model, s.real)}
    text, length, windows = prepare_windows(s, records[s.model])
    if prepare_windows(s, records[s.real])[2] != windows:
        raise ParamError("model", f"a float model whose tokenizer cuts the text as {s.real}'s does", s.model,
                         "their windows of the text differ")
    log(windows_said(s, text, length, windows))
    return {"text": text, "length": length, "windows": windows, "tokenizer": records[s.model].tokenizer_files,
            "records": records}


def pair_settings(ident: dict, spec: QuantSpec, batch_size: int, reference: dict | None) -> dict:
    """A text pair cell's identity: a perplexity cell's and the model it is compared against.

    The batch size of any pair against another model enters too (the checkpoint's own forward depends on it by
    float32 rounding).

    Args:
        ident: the cell's model, text and windows.
        spec: its spec.
        batch_size: windows per forward.
        reference: model, weights and spec it is compared against; None: its own unquantized self."""
    from outlierscope.runs.text_cells import cell_settings

    out = cell_settings(ident, spec, batch_size)
    if reference is not None:
        out["reference"] = reference
        if batch_size != 1:
            out["batch_size"] = batch_size
    return out


def compare_on_text(s, out: Path, specs: list[str], records: dict | None = None,
                    log=print) -> tuple[pd.DataFrame, dict, dict]:
    """The text pairs of a comparison, in compare-quant's order: float vs real, then float and real vs each emulation.

    Args:
        s: the ``CompareSettings`` (metric text).
        out: the run's directory (cells in ``out/cells``).
        specs: the emulations.
        records: ``text_windows``' records.
        log: where progress lines go.

    Returns:
        ``(table, what the record says of the text and models, label -> per-token KLD)``."""
    from outlierscope.models.loading import load_model
    from outlierscope.parallel import World
    from outlierscope.runs.perplexity import text_ident
    from outlierscope.runs.text_cells import CellRun, pair_cells

    t = text_windows(s, records, log)
    windows, bs, device = t["windows"], s.text_batch_size, World().device(s.device)
    flt, real = (load_model(m, dtype=s.dtype, device=device, trust_remote_code=s.trust_remote_code,
                            record=t["records"][m]) for m in (s.model, s.real))
    f_ident = text_ident(s, flt, t["text"], t["length"], windows)
    r_ident = text_ident(s, real, t["text"], t["length"], windows, model=s.real)
    emulated = [QuantSpec.parse(q) for q in specs]
    real_ref = {"model": s.real, "weights_sha256": r_ident["weights_sha256"], "quant": str(UNQUANTIZED)}
    float_ref = {"model": s.model, "weights_sha256": f_ident["weights_sha256"], "quant": str(UNQUANTIZED)}
    flt_, real_ = ("float", UNQUANTIZED), ("real", UNQUANTIZED)  # (model key, spec): one side of a pair
    rows = [("float", "real", flt_, real_, pair_settings(r_ident, UNQUANTIZED, bs, float_ref))]
    for sp in emulated:  # compare-quant's order; each distinct forward still runs once per batch
        rows += [("float", f"emulated: {sp}", flt_, ("float", sp), pair_settings(f_ident, sp, bs, None)),
                 ("real", f"emulated: {sp}", real_, ("float", sp), pair_settings(f_ident, sp, bs, real_ref))]
    c = CellRun(out / "cells", bs, None, s.seed, log=log)
    tokens = pair_cells({"float": flt, "real": real}, windows, [(a, b) for _, _, a, b, _ in rows],
                        [st for *_, st in rows], c, kind="text-pair ")
    rows = [(a, b, st, tk) for (a, b, _, _, st), tk in zip(rows, tokens)]
    record = {"text": t["text"].record(), "tokenizer": t["tokenizer"], "length": t["length"],
              "windows": len(windows), "scored_tokens": int(sum(len(w.targets) for w in windows)),
              "model_sources": {s.model: flt.provenance(f_ident["weights_sha256"]),
                                s.real: real.provenance(r_ident["weights_sha256"])}}
    if cal := calibration_records(emulated, flt.model, flt.tokenizer):  # GPTQ/AWQ/SmoothQuant: the text, the tokens
        record["calibration"] = cal
    table = _table(rows, s.seed)
    return table, record, dict(zip(table["label"], (tokens.kld for *_, tokens in rows)))


def _table(rows: list[tuple[str, str, dict, TokenScores]], seed: int) -> pd.DataFrame:
    """One row per pair (b against a): the perplexity table's statistics and the cell."""
    from outlierscope.analysis.kld import summary
    from outlierscope.runs.perplexity import COLUMNS

    columns = [c for c in COLUMNS if c not in ("label", "quant", "bits", "cell")]
    out = []
    for a, b, st, tokens in rows:
        stats = summary(tokens, seed)
        out.append({"label": f"{b} against {a}", "a": a, "b": b, **{k: stats[k] for k in columns},
                    "cell": cell_id(st)})
    return pd.DataFrame(out)

