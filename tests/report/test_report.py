import pandas as pd
import pytest

from outlierscope.cli import main
from outlierscope.errors import OutlierscopeError
from outlierscope.report.markdown import load_run, outcome_paragraph, render_figures, write_report
from outlierscope.runs.profile import ProfileSettings, profile
from outlierscope.runs.sweep import SweepSettings, sweep


@pytest.fixture(scope="module")
def run_dir(tiny_pair, hs_jsonl, tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    specs = [str(tiny_pair["transformer"]), str(tiny_pair["diff"])]
    profile(specs, ProfileSettings(tokens=2048, text=str(tiny_corpus / "train.jsonl"), seq_len=64), root / "profile",
            progress=False)
    sweep(SweepSettings(models=tuple(specs), bits=(16, 6, 2), data=str(hs_jsonl), batch_size=8), root / "sweep",
          progress=False, log=lambda *_: None)
    return root


def test_profile_files(run_dir):
    p = run_dir / "profile"
    for f in ("table5.csv", "table5.md", "per_layer.csv", "per_head.csv", "per_channel.csv", "histograms.csv",
              "topk_logits.csv", "topk_hidden.csv", "outlier_features.csv", "massive_activations.csv", "lambda.csv",
              "profile.json"):
        assert (p / f).exists(), f
    t5 = pd.read_csv(p / "table5.csv")
    assert list(t5.columns[:3]) == ["model", "activation", "point"] and len(t5) == 4
    assert (t5["top1"] >= t5["top2"]).all() and (t5["top10"] >= t5["top100"]).all() and (t5["top100"] >= t5["median"]).all()
    ph = pd.read_csv(p / "per_head.csv")
    diff = ph[ph["model"] == "diff"]
    assert set(diff["map"]) == {"map1", "map2"} and set(diff["diff_head"]) == {0, 1}
    assert not (p / ".profile-").exists() and not list(p.glob(".profile-*"))


def test_figures_and_report(run_dir):
    written, skipped = render_figures(load_run(run_dir), svg=True)
    assert {png.stem for _, png in written} == {"figure8_acc_norm", "figure8_acc", "quantization_damage", "table5_bars",
                                                "per_layer", "head_heatmap", "histograms", "lambda",
                                                "channels_hidden", "gold_ll"}  # channels.csv: hidden channels; gold_ll.csv
    assert not skipped
    for _, png in written:
        assert png.stat().st_size > 10_000 and png.with_suffix(".svg").exists()
    report = write_report(run_dir).read_text()
    assert "## Outcome" in report and "| Model | Activation Type |" in report and "McNemar" in report
    assert report.count("![") == 10 and "## Gold log-likelihood" in report
    para = outcome_paragraph(load_run(run_dir))
    assert "Transformer" in para and "acc_norm" in para


def test_plot_skips_missing(run_dir, capsys):
    assert main(["plot", str(run_dir / "sweep")]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "skipped table5_bars: no table5 data" in out


def test_missing_run_dir(tmp_path):
    with pytest.raises(OutlierscopeError, match="run directory not found"):
        load_run(tmp_path / "nope")
    with pytest.raises(OutlierscopeError, match="holds no profile.json or sweep.csv"):
        load_run(tmp_path)


def test_profile_cli_errors(tiny_pair, tmp_path, capsys):
    rc = main(["profile", "--model", str(tiny_pair["diff"]), "--tokens", "0", "--out", str(tmp_path / "o")])
    assert rc == 2 and capsys.readouterr().err == "outlierscope: error: --tokens must be >= 1, got 0\n"
    assert not (tmp_path / "o").exists()
    short = tmp_path / "short.txt"
    short.write_text("just a few words")
    rc = main(["profile", "--model", str(tiny_pair["diff"]), "--text", str(short), "--out", str(tmp_path / "o2")])
    err = capsys.readouterr().err
    assert rc == 2 and "fewer than one sequence" in err
    assert not (tmp_path / "o2").exists()  # a failed run leaves no empty --out behind


def test_profile_bfloat16_close_to_float32(run_dir, tiny_pair, tiny_corpus, tmp_path):
    """--dtype bfloat16 profiles bf16 activations: the same Table 5 to bf16 precision, dtype recorded."""
    import json

    spec = str(tiny_pair["diff"])
    t5 = profile([spec], ProfileSettings(tokens=2048, text=str(tiny_corpus / "train.jsonl"), seq_len=64, dtype="bfloat16"),
                 tmp_path / "bf16", progress=False).table5
    ref = pd.read_csv(run_dir / "profile" / "table5.csv")
    ref = ref[ref["model"] == t5["model"].iloc[0]].reset_index(drop=True)
    assert len(ref) == len(t5) == 2
    # bf16 keeps 8 significant bits (unit roundoff u = 2^-9); a top-k value passes a few such roundings (the layer
    # input, q and k, the residual stream): within 8u = 2^-6 (measured on pair-tiny at 20,000 tokens: <= 0.56%).
    # The median comes from log bins 0.5% wide: one bin more (measured <= 0.99%), so 2%.
    for col, bound in (("top1", 2**-6), ("top2", 2**-6), ("top3", 2**-6), ("top10", 2**-6), ("top100", 2**-6),
                       ("median", 0.02)):
        rel = (t5[col] - ref[col]).abs() / ref[col].abs()
        assert (rel <= bound).all(), (col, t5[col].tolist(), ref[col].tolist())
    assert (t5["top1"] != ref["top1"]).any()  # really bf16 arithmetic
    meta = json.loads((tmp_path / "bf16" / "profile.json").read_text())
    assert meta["settings"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("damage,msg", [
    (lambda b: b[: len(b) // 2] + b'\n1,2,"unterminated\n', "is not a readable CSV table"),
    (lambda b: b[:700], "ends in the middle of a row: the file is truncated"),
    (lambda b: b"\n".join(b.split(b"\n")[:5]) + b"\n", "lacks row(s)"),  # cut at a line end: a cell's rows missing
    (lambda b: b"\n".join(b.split(b"\n")[:1] + b.split(b"\n")[3:]), "has no 16-bit (unquantized) rows"),
    (lambda b: bytes(range(256)) * 8, "is not a readable CSV table"),
    (lambda b: b.split(b"\n")[0] + b"\n", "has a header but no rows"),
    (lambda b: b"", "is empty"),
    (lambda b: b"model,bits\nx,4\n", "lacks column(s) label, granularity, metric"),
    (lambda b: b.replace(b"transformer,hellaswag,16,", b"transformer,hellaswag,sixteen,", 1), "column bits holds non-numeric"),
])
@pytest.mark.parametrize("cmd", ["plot", "report"])
@pytest.mark.parametrize("resealed", [False, True], ids=["record", "resealed"])
def test_damaged_sweep_table(run_dir, tmp_path, capsys, damage, msg, cmd, resealed):
    """A damaged sweep.csv: its record's digest refuses it; resealed over the damage (a writer's bug, a crafted
    record), its shape is refused, in one line naming the file, with nothing drawn."""
    import shutil

    from outlierscope.io import file_digests, read_record, write_record

    d = tmp_path / "damaged"
    shutil.copytree(run_dir / "sweep", d, ignore=shutil.ignore_patterns("figures", "report.md"))
    (d / "sweep.csv").write_bytes(damage((d / "sweep.csv").read_bytes()))
    if resealed:
        rec = read_record(d / "sweep.json")
        write_record(d / "sweep.json", {**rec, "files": {**rec["files"], **file_digests(d, ["sweep.csv"])}})
    assert main([cmd, str(d)]) == 2
    err = capsys.readouterr().err
    want = msg if resealed else "its content does not match the digest its record holds"
    assert err.count("\n") == 1 and want in err and "sweep.csv" in err
    assert not (d / "figures").exists() or not any((d / "figures").iterdir())  # nothing drawn from a damaged file
    assert not (d / "report.md").exists()


@pytest.mark.parametrize("table", ["sweep/sweep.csv", "profile/table5.csv", "profile/per_layer.csv",
                                   "profile/histograms.csv", "profile/topk_logits.csv"])
@pytest.mark.parametrize("cmd", ["plot", "report"])
def test_one_changed_digit_is_refused(run_dir, tmp_path, capsys, table, cmd):
    """One digit of a result table changed (the file still a well-formed table): a one-line error naming it."""
    import re
    import shutil

    d = tmp_path / "run"
    shutil.copytree(run_dir, d, ignore=shutil.ignore_patterns("figures", "report.md"))
    text = (d / table).read_text()
    m = re.search(r"\d\.(\d)", text.split("\n", 2)[1])  # a digit after a decimal point in the first row
    at = len(text.split("\n", 1)[0]) + 1 + m.start(1)
    (d / table).write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:])
    assert main([cmd, str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(d / table) in err and "does not match the digest" in err
    assert not (d / "report.md").exists()


def test_load_run_tables(run_dir):
    from outlierscope import load_run as public_load_run

    run = public_load_run(run_dir)
    assert {"table5", "per_layer", "per_head", "histograms", "topk_logits", "topk_hidden", "lambda", "sweep"} <= set(run.tables)
    assert run["sweep"].equals(run.tables["sweep"])
    assert set(run.cells) == set(run["sweep"]["cell"]) and all(len(df) == 12 for df in run.cells.values())
    with pytest.raises(KeyError, match="did you mean table5"):
        run["table50"]
    assert "acc_norm" in run.outcome()


def test_outcome_paragraph_numbers(tmp_path):
    """The generated sentences carry the right numbers (ratios, deltas, intervals, flip rates) for known tables."""
    from outlierscope.report.load import RunResults

    t5 = pd.DataFrame([
        {"model": "pair-tiny:transformer", "activation": "Attention Logits", "top1": 36.22, "median": 1.26},
        {"model": "pair-tiny:diff", "activation": "Attention Logits", "top1": 82.35, "median": 1.803},
        {"model": "pair-tiny:transformer", "activation": "Hidden States", "top1": 110.67, "median": 2.529},
        {"model": "pair-tiny:diff", "activation": "Hidden States", "top1": 74.85, "median": 2.244},
    ])
    rows = []
    for model, base, low, d, lo, hi, p, flip in (("pair-tiny:transformer", 0.2614, 0.2631, 0.0017, -0.0014, 0.0049, 0.316, 0.0488),
                                                ("pair-tiny:diff", 0.2575, 0.2576, 0.0001, -0.0038, 0.0038, 1.0, 0.0729)):
        rows += [{"model": model, "bits": 16, "metric": "acc_norm", "value": base},
                 {"model": model, "bits": 4, "metric": "acc_norm", "value": low, "delta_vs_16": d, "ci_low": lo,
                  "ci_high": hi, "mcnemar_p": p},
                 {"model": model, "bits": 4, "metric": "flip_rate_norm", "value": flip}]
    run = RunResults(tmp_path, tables={"table5": t5, "sweep": pd.DataFrame(rows)})
    para = outcome_paragraph(run)
    assert f"(82.35 vs 36.22, {82.35 / 36.22:.2f}x)" in para and "the Diff Transformer has the larger top-1" in para
    assert f"ratio is {36.22 / 1.26:.0f} vs {82.35 / 1.803:.0f}" in para
    assert f"the Transformer has the larger top-1 |value| (110.67 vs 74.85, {110.67 / 74.85:.2f}x)" in para
    assert "acc_norm 26.14% at 16 bits and 26.31% at 4 bits, a change of +0.17 points (95% CI -0.14 to +0.49; " \
           "McNemar p = 0.316, not significant at 5%)" in para
    assert "At 4 bits, 7.29% of pair-tiny:diff's acc_norm choices change versus 4.88% for pair-tiny:transformer." in para


def test_outcome_paragraph_suite(tmp_path):
    """Several tasks: per model the mean, smallest and largest change of each task's headline metric (acc_norm where
    reported, else acc) and the tasks with McNemar p < 0.05."""
    from outlierscope.report.load import RunResults

    rows = []
    for task, metric, d, p in (("arc_easy", "acc_norm", -0.03, 0.01), ("copa", "acc", 0.02, 0.5), ("boolq", "acc", -0.05, 0.001)):
        rows += [{"model": "m", "task": task, "bits": 16, "metric": metric, "value": 0.5},
                 {"model": "m", "task": task, "bits": 4, "metric": metric, "value": 0.5 + d, "delta_vs_16": d,
                  "mcnemar_p": p},
                 {"model": "m", "task": task, "bits": 4, "metric": "acc", "value": 0.9, "delta_vs_16": 0.3, "mcnemar_p": 0.0}]
    rows = [r for r in rows if not (r["task"] != "arc_easy" and r["metric"] == "acc" and r["value"] == 0.9)]
    para = outcome_paragraph(RunResults(tmp_path, tables={"sweep": pd.DataFrame(rows)}))
    assert ("m at 4 bits against 16 bits, over 3 tasks (headline metric: acc_norm where reported, else acc): mean change "
            f"{(-3 + 2 - 5) / 3:+.2f} points, from -5.00 (BoolQ) to +2.00 (COPA); significant at 5% (McNemar) on 2 of 3 "
            "(ARC-Easy, BoolQ).") in para


def test_sweep_from_before_tasks_loads(run_dir, tmp_path):
    """A sweep.csv written before the task and chance columns (e.g. committed docs) reads as its record's task."""
    import json
    import shutil

    from outlierscope.io import file_digests, read_record, write_record
    from outlierscope.report.load import load_run

    d = tmp_path / "old"
    shutil.copytree(run_dir / "sweep", d, ignore=shutil.ignore_patterns("figures", "report.md"))
    new = pd.read_csv(d / "sweep.csv")
    new.drop(columns=["task", "chance"]).to_csv(d / "sweep.csv", index=False)
    rec = read_record(d / "sweep.json")  # the record of such a sweep vouches for its table as written
    write_record(d / "sweep.json", {**rec, "files": {**rec["files"], **file_digests(d, ["sweep.csv"])}})
    got = load_run(d).tables["sweep"]
    assert list(got.columns) == list(new.columns) and got["task"].eq("hellaswag").all() and got["chance"].eq(25.0).all()
    meta = json.loads((d / "sweep.json").read_text())
    meta["settings"]["task"] = "copa"
    meta["chance"] = 50.0
    del meta["settings"]["tasks"]
    del meta["record_sha256"]  # a record from before tasks was written before seals too
    (d / "sweep.json").write_text(json.dumps(meta))
    got = load_run(d).tables["sweep"]
    assert got["task"].eq("copa").all() and got["chance"].eq(50.0).all()


def _recipe_sweep():
    """A sweep table by hand: the paper's logits at 16 and 4 bits and two recipes (format attn) at 2 and 8 bits."""
    rows = []
    for label, fmt, bits, acc, d, p, flip in (("16 (unquantized)", "int", 16, 0.50, None, None, None),
                                              ("4-bit int per_tensor", "int", 4, 0.45, -0.05, 0.02, 0.10),
                                              ("kivi-2bit", "attn", 2, 0.40, -0.10, 0.001, 0.30),
                                              ("sage1", "attn", 8, 0.50, 0.0, 1.0, 0.0)):
        common = {"model": "m", "task": "hellaswag", "bits": bits, "label": label, "format": fmt, "n_items": 100,
                  "chance": 25.0}
        rows.append({**common, "metric": "acc_norm", "value": acc, "stderr": 0.05, "delta_vs_16": d, "ci_low": d,
                     "ci_high": d, "mcnemar_p": p})
        if flip is not None:
            rows.append({**common, "metric": "flip_rate_norm", "value": flip})
    return pd.DataFrame(rows)


def test_outcome_with_recipes(tmp_path):
    """The paper's sentence reads the logits' lowest bit width (4), not a recipe's (2); the recipes get their own
    sentence: the most and the least damaging by flip rate."""
    from outlierscope.report.load import RunResults

    para = outcome_paragraph(RunResults(tmp_path, tables={"sweep": _recipe_sweep()}))
    assert "acc_norm 50.00% at 16 bits and 45.00% at 4 bits, a change of -5.00 points" in para and "2 bits" not in para
    assert ("m on HellaSwag, 2 attention recipes: the most damaging is kivi-2bit (30.0% of choices change, acc_norm "
            "-10.00 points, McNemar p = 0.001), the least sage1 (0.0% of choices change, acc_norm +0.00 points, "
            "McNemar p = 1).") in para


def test_recipe_lines_figure():
    """A line per recipe from the unquantized point (16 bits) to its own bits; the logits line through its bits."""
    import matplotlib

    matplotlib.use("Agg")
    from outlierscope.report.activation_plots import recipe_lines

    fig = recipe_lines(_recipe_sweep())
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[0].get_lines()
             if not ln.get_label().startswith("_")}
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks == ["16", "8", "4", "2"]  # evenly spaced positions 0..3, as the paper's Figure 8
    assert lines["logits (paper, per_tensor)"] == ([0, 2], [50.0, 45.0])
    assert lines["kivi-2bit"] == ([0, 3], [50.0, 40.0]) and lines["sage1"] == ([0, 1], [50.0, 50.0])
    assert recipe_lines(_recipe_sweep().query("format != 'attn'")) is None


def test_attention_error_per_layer_tables():
    """Pooled over heads weighted by rows, by hand: layer 0 (100 rows at KL 0.1, 300 at 0.5) -> 0.4, layer 1 -> 0.2;
    over all 600 rows (10 + 150 + 20 + 20) / 600 (not the layers' plain mean 0.3); top key lost (20 + 0 + 50 + 50) /
    600; output error (1 + 9 + 2 + 2) / 600."""
    import matplotlib

    matplotlib.use("Agg")
    from outlierscope.report.activation_plots import attention_error_layers
    from outlierscope.report.tables import attention_error_markdown

    heads = [(0, 0, 100, 0.1, 0.2, 0.01), (0, 1, 300, 0.5, 0.0, 0.03), (1, 0, 100, 0.2, 0.5, 0.02),
             (1, 1, 100, 0.2, 0.5, 0.02)]
    t = pd.DataFrame([{"model": "m", "task": "hellaswag", "bits": 8, "label": "sage1", "layer": la, "head": h,
                       "rows": n, "kl_mean": kl, "kl_max": 2 * kl, "argmax_change_rate": ch, "rel_out_mean": rel,
                       "rel_out_max": 2 * rel} for la, h, n, kl, ch, rel in heads])
    t = pd.concat([t, t.assign(label="x", bits=2, kl_mean=1.0)], ignore_index=True)
    md = attention_error_markdown(t)
    assert f"| m | HellaSwag | sage1 | 600 | {200 / 600:.3g} | 0 (0.4) | 20.00% | {14 / 600:.3g} |" in md
    assert "| m | HellaSwag | x | 600 | 1 | 0 (1) |" in md
    assert "| layer | sage1 | x |" in md and "| 0 | 0.4 | 1 |" in md and "| 1 | 0.2 | 1 |" in md
    fig = attention_error_layers(t)
    grid = fig.axes[0].images[0].get_array()
    assert grid.shape == (2, 2) and abs(grid[0, 0] - 0.4) < 1e-12 and abs(grid[0, 1] - 0.2) < 1e-12


def test_attention_error_cell_without_output_error():
    """A cell measured without the output error (NaN in attn_error.csv beside a cell with it) shows none: not 0, not
    a mean of the rows that have it; the other cell's error is its rows' weighted mean, (0.01 * 100 + 0.03 * 300)
    / 400 by hand for layer 0."""
    from outlierscope.report.tables import attention_error_layers, attention_error_markdown

    cell = pd.DataFrame([{"model": "m", "task": "hellaswag", "bits": 8, "label": "a", "layer": 0, "head": h,
                          "rows": n, "kl_mean": 0.1, "kl_max": 0.2, "argmax_change_rate": 0.0, "rel_out_mean": rel,
                          "rel_out_max": 2 * rel} for h, n, rel in [(0, 100, 0.01), (1, 300, 0.03)]])
    t = pd.concat([cell, cell.assign(label="b", rel_out_mean=float("nan"), rel_out_max=float("nan"))],
                  ignore_index=True)
    layers = attention_error_layers(t).set_index("label")
    assert abs(layers.loc["a", "rel_out_mean"] - 0.025) < 1e-15 and layers.loc["a", "rel_out_max"] == 0.06
    assert pd.isna(layers.loc["b", "rel_out_mean"]) and pd.isna(layers.loc["b", "rel_out_max"])
    md = attention_error_markdown(t)
    assert "| m | HellaSwag | a | 400 | 0.1 | 0 (0.1) | 0.00% | 0.025 |" in md
    assert "| m | HellaSwag | b | 400 | 0.1 | 0 (0.1) | 0.00% | |" in md


def test_linear_error_beside_the_profile_of_the_same_inputs():
    """Values worked by hand: layer 1's down_proj input has max 300 over median 0.5 (ratio 600) and two LLM.int8
    feature channels in layer 1 (one also in layer 0); q_proj's input was not profiled in layer 1 (left out); the
    point ``hidden`` is no linear's input."""
    from outlierscope.report import activation_plots
    from outlierscope.report.tables import linear_error_vs_outliers

    lin = pd.DataFrame({"model": "m", "task": "hellaswag", "label": "w8a8", "layer": [0, 1, 1],
                        "linear": ["mlp.down_proj", "mlp.down_proj", "self_attn.q_proj"], "tokens": 10,
                        "rel_err_mean": [0.01, 0.2, 0.03], "rel_err_max": [0.02, 0.5, 0.04]})
    per_layer = pd.DataFrame({"model": "m", "point": ["mlp.down_proj.input", "mlp.down_proj.input", "hidden"],
                              "layer": [0, 1, 1], "top1": [4.0, 300.0, 9.0], "median": [1.0, 0.5, 1.0]})
    feats = pd.DataFrame({"model": "m", "point": ["mlp.down_proj.input", "mlp.down_proj.input", "hidden"],
                          "channel": [3, 7, 3], "layers": ["[0, 1]", "[1]", "[1]"]})
    j = linear_error_vs_outliers(lin, per_layer, feats).set_index(["layer", "linear"])
    assert list(j.index) == [(0, "mlp.down_proj"), (1, "mlp.down_proj")]
    assert j.loc[(1, "mlp.down_proj"), "top1_over_median"] == 600.0 and j.loc[(0, "mlp.down_proj"), "top1_over_median"] == 4.0
    assert list(j["int8_features"]) == [1, 2] and list(j["rel_err_mean"]) == [0.01, 0.2]
    assert activation_plots.linear_error_vs_outliers(j.reset_index()) is not None


@pytest.mark.parametrize("texts, said", [
    (["q=int8/per_block:128; k=int8/per_block:64; smooth_k", "logits=int4/per_tensor"], "attention recipes"),
    (["a=int8/per_token; w=int8/per_channel", "w=int4/per_group:64"], "linear-layer schemes"),
    (["a=int8/per_token; w=int8/per_channel", "k=asym2/per_channel:32; v=asym2/per_group:32"], "quantization recipes"),
    (["a=int8/per_token; w=int8/per_channel; k=e4m3/per_tensor; v=e4m3/per_tensor"], "quantization recipes"),
])
def test_the_outcome_names_what_the_quant_rows_are(texts, said):
    """A sweep of linear schemes was called '11 attention recipes' in its outcome sentence."""
    from outlierscope.report.outcome import _kind_said

    assert _kind_said(texts) == said


@pytest.mark.parametrize("rows, heading", [
    ([(16, "int", "16 (unquantized)"), (4, "int", "4-bit")], "Quantized attention logits"),
    ([(16, "int", "16 (unquantized)"), (8, "attn", "k=int8/per_token")], "Quantized attention recipes"),
    ([(16, "int", "16 (unquantized)"), (4, "int", "4-bit"), (8, "attn", "sage1")],
     "Quantized attention logits and attention recipes"),
    ([(16, "int", "16 (unquantized)"), (8, "attn", "w8a8"), (4, "attn", "w=int4/per_group:64")],
     "Quantized linear layers"),
    ([(16, "int", "16 (unquantized)"), (8, "attn", "w8a8"), (8, "attn", "k=int8/per_token")],
     "Quantized attention and linear layers"),
])
def test_the_sweep_heading_names_what_its_rows_quantize(rows, heading):
    """The report's Figure 8 section is named for its rows: logits bit widths, attention recipes, linear schemes."""
    import pandas as pd

    from outlierscope.report.outcome import quantized_heading

    sweep = pd.DataFrame(rows, columns=["bits", "format", "label"])
    assert quantized_heading(sweep) == heading


def test_clipped_texts_finds_a_label_past_the_edge():
    """A 2-inch figure whose x label is 60 characters (about 5 inches at 10 pt) is cut off; the same label wrapped by
    _fit is not; ticks beyond the view limits do not count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from outlierscope.report.plots import _fit, clipped_texts

    label = "a label that is much wider than the two-inch figure it labels"
    for text, cut in ((label, True), (_fit(label, 1.6, 10), False)):
        fig, ax = plt.subplots(figsize=(2, 2), layout="constrained")
        ax.plot([0, 1], [0, 1])
        ax.set_xticks([-5, 0, 1, 6])  # -5 and 6 lie outside the view: not drawn
        ax.set_xlim(0, 1)
        ax.set_xlabel(text, fontsize=10)
        assert bool(clipped_texts(fig)) is cut, (text, clipped_texts(fig))
        plt.close(fig)


def test_gold_ll_takes_a_symlog_axis_when_4_bits_would_hide_8_bits():
    """Changes of -200 nats beside -0.02: symlog (8-bit's bars visible); changes within 1 nat: linear. No text cut."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from outlierscope.report.activation_plots import gold_ll_changes
    from outlierscope.report.plots import clipped_texts

    for worst, scale in ((-200.0, "symlog"), (-0.5, "linear")):
        gold = pd.DataFrame({"model": ["m", "m"], "task": "hellaswag", "label": ["w8a8", "w4a4"], "n_items": 10,
                             "delta_gold_ll": [-0.02, worst], "ci_low": [-0.03, worst - 0.1], "ci_high": [-0.01, worst + 0.1]})
        fig = gold_ll_changes(gold)
        assert fig.axes[0].get_xscale() == scale and not clipped_texts(fig)
        plt.close(fig)
