

import json

import numpy as np
import pandas as pd
import pytest

from outlierscope.cli import main
from outlierscope.errors import OutlierscopeError
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.runs import sweep as sw
from outlierscope.runs.sweep import SweepSettings, sweep


def _settings(tiny_pair, hs_jsonl, **kw):
    base = dict(models=(str(tiny_pair["transformer"]), str(tiny_pair["diff"])), bits=(16, 4, 2), data=str(hs_jsonl),
                batch_size=8)
    base.update(kw)
    return SweepSettings(**base)


@pytest.fixture(scope="module")
def full(tiny_pair, hs_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "full"
    table = sweep(_settings(tiny_pair, hs_jsonl), out, progress=False, log=lambda *_: None).table
    return out, table


def test_table_contents(full):
    out, table = full
    assert set(table["bits"]) == {16, 4, 2} and set(table["metric"]) >= {"acc", "acc_norm", "flip_rate", "mean_abs_score_change"}
    acc16 = table[(table.bits == 16) & (table.metric == "acc")]
    assert (acc16["label"] == "16 (unquantized)").all() and acc16["delta_vs_16"].isna().all()
    q = table[(table.bits == 2) & (table.metric == "acc_norm")]
    assert (q["ci_low"] <= q["delta_vs_16"]).all() and (q["delta_vs_16"] <= q["ci_high"]).all()
    assert q["mcnemar_p"].between(0, 1).all()
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["settings"]["bits"] == [16, 4, 2] and meta["n_items"] == 12 and "versions" in meta
    cells = list((out / "cells").glob("*.csv"))
    assert len(cells) == 6
    res = pd.read_csv(cells[0])
    assert list(res.columns) == ["index", "label", *[f"score{j}" for j in range(4)], *[f"tokens{j}" for j in range(4)], "pred", "pred_norm"]


@pytest.fixture(scope="module")
def real(hellaswag_cached, tmp_path_factory):
    """The bundled pair on 100 real validation items at 2 bits: discordant pairs, so that McNemar and the intervals
    are exercised."""
    out = tmp_path_factory.mktemp("sweep") / "real"
    s = SweepSettings(bits=(16, 2), limit=100, batch_size=32)
    return out, sweep(s, out, progress=False, log=lambda *_: None).table, hellaswag_cached


@pytest.mark.parametrize("which", ["full", "real"])
def test_statistics_recomputed_independently_from_cells(which, request, hs_jsonl):
    """Every number of sweep.csv from the per-item cell files with independent numpy/scipy code; predictions
    come from the score columns and the endings' lengths in characters, not from the pred columns."""
    from scipy.stats import binomtest

    from outlierscope.data.hellaswag import build_doc, load_hellaswag

    out, table, *data = request.getfixturevalue(which)
    chars = np.array([[len(c) for c in build_doc(it).choices] for it in load_hellaswag(data[0] if data else hs_jsonl)],
                     dtype=float)
    discordant = 0
    meta = json.loads((out / "sweep.json").read_text())
    scores = [f"score{j}" for j in range(4)]

    def preds(res):
        sc = res[scores].to_numpy()
        return sc.argmax(1), (sc / chars[res["index"].to_numpy()]).argmax(1)

    cells = {c["cell"]: c for c in meta["cells"]}
    for model in table["model"].unique():
        mine = {c["bits"]: c for c in cells.values() if c["model"] == model}
        base = pd.read_csv(out / "cells" / f"{mine[16]['cell']}.csv")
        b_acc, b_norm = preds(base)
        for bits, c in mine.items():
            res = pd.read_csv(out / "cells" / f"{c['cell']}.csv")
            p_acc, p_norm = preds(res)
            assert np.array_equal(p_acc, res["pred"]) and np.array_equal(p_norm, res["pred_norm"])
            rows = table[(table.model == model) & (table.bits == bits)].set_index("metric")
            for metric, p, bp, flip in (("acc", p_acc, b_acc, "flip_rate"), ("acc_norm", p_norm, b_norm, "flip_rate_norm")):
                ok, bok = p == res["label"].to_numpy(), bp == base["label"].to_numpy()
                assert rows.loc[metric, "value"] == pytest.approx(ok.mean())
                assert rows.loc[metric, "stderr"] == pytest.approx(ok.std(ddof=1) / np.sqrt(len(ok)))
                if bits == 16:
                    continue
                assert rows.loc[metric, "delta_vs_16"] == pytest.approx(ok.mean() - bok.mean())
                n01, n10 = int((bok & ~ok).sum()), int((~bok & ok).sum())
                discordant += n01 + n10
                p_val = 1.0 if n01 + n10 == 0 else binomtest(n01, n01 + n10, 0.5).pvalue
                assert rows.loc[metric, "mcnemar_p"] == pytest.approx(p_val)
                rng = np.random.default_rng(meta["settings"]["seed"])
                d = ok.astype(float) - bok.astype(float)
                boot = np.concatenate([d[rng.integers(0, len(d), (200, len(d)))].mean(1) for _ in range(10)])
                assert (rows.loc[metric, "ci_low"], rows.loc[metric, "ci_high"]) == pytest.approx(tuple(np.percentile(boot, [2.5, 97.5])))
                assert rows.loc[flip, "value"] == pytest.approx((p != bp).mean())
            if bits != 16:
                change = np.abs(res[scores].to_numpy() - base[scores].to_numpy()).mean()
                assert rows.loc["mean_abs_score_change", "value"] == pytest.approx(change)
    assert which == "full" or discordant >= 5  # the real items do exercise McNemar and the intervals


def test_resume_after_crash(tiny_pair, hs_jsonl, tmp_path, monkeypatch, full):
    out = tmp_path / "resumed"
    real = sw.evaluate
    calls = {"n": 0}

    def crash_after_one(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # Ctrl-C in the second cell
        return real(*a, **k)

    monkeypatch.setattr(sw, "evaluate", crash_after_one)
    with pytest.raises(KeyboardInterrupt):
        sweep(_settings(tiny_pair, hs_jsonl), out, progress=False, log=lambda *_: None)
    assert len(list((out / "cells").glob("*.json"))) == 1 and not (out / "sweep.csv").exists()
    monkeypatch.setattr(sw, "evaluate", real)
    logs = []
    table = sweep(_settings(tiny_pair, hs_jsonl), out, progress=False, log=logs.append).table
    assert sum("skipped" in m for m in logs) == 1
    pd.testing.assert_frame_equal(table.drop(columns="cell"), full[1].drop(columns="cell"))


def test_items_tokenised_once_per_model_and_task(tiny_pair, hs_jsonl, tmp_path, monkeypatch, full):
    """Each model's items are tokenised once for its three cells (and not at all when every cell is cached); the
    tables are the full fixture's."""
    import outlierscope.eval.requests as rq

    calls, real = [], rq.build_requests
    monkeypatch.setattr(rq, "build_requests", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = tmp_path / "s"
    table = sweep(_settings(tiny_pair, hs_jsonl), out, progress=False, log=lambda *_: None).table
    assert len(calls) == 2  # 2 models x 1 task
    pd.testing.assert_frame_equal(table, full[1])
    sweep(_settings(tiny_pair, hs_jsonl), out, progress=False, log=lambda *_: None)
    assert len(calls) == 2  # every cell read back


def test_changed_settings_recompute(tiny_pair, hs_jsonl, tmp_path):
    out = tmp_path / "s"
    sweep(_settings(tiny_pair, hs_jsonl, bits=(16, 4)), out, progress=False, log=lambda *_: None)
    logs = []
    with pytest.raises(OutlierscopeError, match=r"holds a sweep with other settings \(granularity differ\); choose another"):
        sweep(_settings(tiny_pair, hs_jsonl, bits=(16, 4), granularity="per_head"), out, progress=False, log=logs.append)
    assert not logs  # refused before any cell ran
    sweep(_settings(tiny_pair, hs_jsonl, bits=(16, 4), granularity="per_head"), out, progress=False, log=logs.append,
          force=True)
    assert sum("skipped" in m for m in logs) == 2  # the two 16-bit cells only
    assert json.loads((out / "sweep.json").read_text())["settings"]["granularity"] == "per_head"


def test_text_loss(tiny_pair, hs_jsonl, tmp_path, tiny_corpus):
    table = sweep(_settings(tiny_pair, hs_jsonl, bits=(16, 2), models=(str(tiny_pair["diff"]),),
                            text=str(tiny_corpus / "val.jsonl"), text_tokens=2048), tmp_path / "t", progress=False,
                  log=lambda *_: None).table
    loss = table[table.metric == "lm_loss"].set_index("bits")["value"]
    assert loss[2] != loss[16]
    # the unquantized loss against transformers' own model(labels=...).loss on the same packed sequences
    import torch

    from outlierscope.data.text import pack_sequences, text_documents
    from outlierscope.models.loading import load_model, resolve_seq_len

    lm = load_model(str(tiny_pair["diff"]))
    seqs = pack_sequences(lm.tokenizer, text_documents(str(tiny_corpus / "val.jsonl")), resolve_seq_len(lm.model, None), 2048)
    with torch.no_grad():
        ref = np.mean([lm.model(input_ids=x[None], labels=x[None]).loss.item() for x in seqs])  # equal lengths: token mean
    assert loss[16] == pytest.approx(ref, rel=1e-5)


def test_kld_text_adds_every_cells_text_metrics(tiny_pair, hs_jsonl, tmp_path, tiny_corpus, capsys):
    """--kld-text: every cell of both models scored on running text as `perplexity` scores it (the same command's
    per-token cells, each model in text/): text.csv's rows are the two standalone perplexity runs' rows (their own
    reference tests: tests/eval/test_perplexity.py), with a model column; the item tables are unchanged."""
    text = str(tiny_corpus / "val.jsonl")
    models = [str(tiny_pair["transformer"]), str(tiny_pair["diff"])]
    common = ["--data", str(hs_jsonl), "--limit", "3", "--bits", "16", "4", "--quant", "k=int4/per_token"]
    argv = ["sweep", *[x for m in models for x in ("--model", m)], *common, "--kld-text", text, "--kld-length", "48",
            "--kld-max-windows", "5", "--out", str(tmp_path / "s")]
    assert main(argv) == 0
    got = pd.read_csv(tmp_path / "s" / "text.csv")
    assert list(got["model"]) == [m for m in models for _ in range(3)]
    for m in models:
        assert main(["perplexity", "--model", m, "--text", text, "--length", "48", "--max-windows", "5",
                     "--quant", "logits=int4/per_tensor", "--quant", "k=int4/per_token", "--out", str(tmp_path / "p")]) == 0
        want = pd.read_csv(tmp_path / "p" / "perplexity.csv")
        mine = got[got.model == m].reset_index(drop=True)
        for col in ("ppl", "kld_mean", "delta_nll", "same_top"):
            np.testing.assert_array_equal(mine[col].to_numpy(), want[col].to_numpy(), err_msg=col)
        (tmp_path / "p" / "perplexity.json").unlink()
    plain = tmp_path / "plain"
    assert main(["sweep", *[x for m in models for x in ("--model", m)], *common, "--out", str(plain)]) == 0
    assert (plain / "sweep.csv").read_bytes() == (tmp_path / "s" / "sweep.csv").read_bytes()
    capsys.readouterr()
    assert main(["sweep", "--model", models[0], *common, "--kld-length", "48", "--out", str(tmp_path / "x")]) == 2
    assert "--kld-length must be its default None without kld_text" in capsys.readouterr().err


@pytest.mark.parametrize("argv,msg", [
    (["--model", "pair-tny:diff"], "did you mean pair-tiny:diff"),
    (["--bits", "17"], "--bits must be in 2..16"),
    (["--bits", "4", "--format", "e4m3"], "--bits must be 8 (or 16 = unquantized) for format e4m3, got 4"),
    (["--limit", "0"], "--limit must be >= 1, got 0"),
    (["--limit", "10043"], "--limit must be in 1..10042"),
])
def test_cli_errors(argv, msg, tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["sweep", *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and err.count("\n") == 1
    assert not (out / "sweep.csv").exists()


def test_cli_malformed_data(tiny_pair, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"activity_label": "a", "ctx_a": "b", "ctx_b": "c", "endings": ["x"], "label": 0}\n')
    rc = main(["sweep", "--model", str(tiny_pair["diff"]), "--data", str(bad), "--out", str(tmp_path / "o")])
    assert rc == 2 and "line 1: expected 4 string endings, got 1" in capsys.readouterr().err


def test_cli_unwritable_dir(tiny_pair, hs_jsonl, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["sweep", "--model", str(tiny_pair["diff"]), "--data", str(hs_jsonl), "--out", str(blocker / "sub")])
    assert rc == 2 and "cannot write to output directory" in capsys.readouterr().err


def test_settings_validation():
    with pytest.raises(OutlierscopeError, match="given twice"):
        SweepSettings(models=("a", "a"))
    with pytest.raises(OutlierscopeError, match="exclude each other"):
        SweepSettings(limit=3, sample=3)


def test_nan_model_is_an_error_and_writes_no_cell(tiny_pair, hs_jsonl, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "nan-model"
    shutil.copytree(tiny_pair["transformer"], bad)
    weights = load_file(bad / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    rc = main(["sweep", "--model", str(bad), "--bits", "16", "--data", str(hs_jsonl), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and "12 of 12 items got non-finite log-likelihoods" in err
    assert not (out / "cells").exists() or not any((out / "cells").iterdir())  # no half-written cell


def test_bfloat16_sweep_close_to_float32(full, tiny_pair, hs_jsonl, tmp_path):
    """--dtype bfloat16: weights and activations in bf16, recorded in the cell settings; scores near float32's."""
    out32, _ = full
    out = tmp_path / "bf16"
    table = sweep(_settings(tiny_pair, hs_jsonl, models=(str(tiny_pair["diff"]),), bits=(16,), dtype="bfloat16"), out,
                  progress=False, log=lambda *_: None).table
    (meta,) = [json.loads(p.read_text()) for p in (out / "cells").glob("*.json")]
    assert meta["cell"]["dtype"] == "bfloat16" and meta["settings"]["dtype"] == "bfloat16"
    ref_cell = [p for p in (out32 / "cells").glob("*.json")
                if json.loads(p.read_text())["cell"] | {"dtype": "bfloat16"} == meta["cell"]]
    assert len(ref_cell) == 1 and ref_cell[0].stem != next((out / "cells").glob("*.json")).stem  # dtype is in the cell id
    a = pd.read_csv(ref_cell[0].with_suffix(".csv"))
    b = pd.read_csv(next((out / "cells").glob("*.csv")))
    s = [f"score{j}" for j in range(4)]
    diff = np.abs(a[s].values - b[s].values)
    assert 0 < diff.max() < 0.05 * np.abs(a[s].values).max()  # bf16 arithmetic, same model
    assert set(table["bits"]) == {16}
    with pytest.raises(OutlierscopeError, match="dtype must be one of auto, float32, bfloat16, float16, float64, got 'int8'"):
        SweepSettings(dtype="int8")


def test_non_utf8_data_is_one_line(tiny_pair, tmp_path, capsys):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"activity_label": "caf\u00e9", "ctx_a": "b", "ctx_b": "c", "endings": ["w", "x", "y", "z"], "label": 0}\n'
                    .encode("latin-1"))
    out = tmp_path / "o"
    rc = main(["sweep", "--model", str(tiny_pair["diff"]), "--data", str(bad), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "line 1: not UTF-8 text" in err and "save the file as UTF-8" in err
    assert not out.exists()


def test_failed_sweep_leaves_no_empty_dirs(tiny_pair, hs_jsonl, tmp_path, capsys):
    out = tmp_path / "new" / "o"
    rc = main(["sweep", "--model", str(tiny_pair["diff"]) + "-missing", "--data", str(hs_jsonl), "--out", str(out)])
    assert rc == 2 and "model directory not found" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_task_sweep_and_report(tiny_pair, tmp_path):
    """Several tasks in one sweep: cells keyed by the task (a HellaSwag cell identity has none, so old cells keep
    their ids), ragged choices, each task's metrics only (COPA: acc), chance levels in the table and the record,
    limit capped at a task's rows, report and Figure 8 with a panel per task; a one-task sweep of the same items
    reuses the suite's cells."""
    import matplotlib

    matplotlib.use("Agg")
    from outlierscope.data.tasks import get_task
    from outlierscope.report.markdown import write_report

    tasks = ("arc_easy", "copa")
    if not all(get_task(t).cached for t in tasks):
        pytest.skip("task data not cached (make test fetches it)")
    out = tmp_path / "suite"
    s = SweepSettings(models=(str(tiny_pair["diff"]),), bits=(16, 4), limit=10, batch_size=8, tasks=tasks)
    res = sweep(s, out, progress=False, log=lambda *_: None)
    t = res.table
    assert list(dict.fromkeys(t["task"])) == list(tasks) and set(t["bits"]) == {16, 4} and t["n_items"].eq(10).all()
    assert set(t.loc[t.task == "copa", "metric"]) == {"acc", "flip_rate", "mean_abs_score_change"}
    assert {"acc_norm", "flip_rate_norm"} <= set(t.loc[t.task == "arc_easy", "metric"])
    assert t.loc[t.task == "copa", "chance"].eq(50.0).all() and t.loc[t.task == "arc_easy", "chance"].between(20, 34).all()
    meta = json.loads((out / "sweep.json").read_text())
    assert meta["settings"]["tasks"] == list(tasks) and meta["tasks"]["copa"]["metrics"] == ["acc"]
    assert meta["tasks"]["copa"]["chance"] == 50.0 and "chance" not in meta  # per task only, with several
    cells = {json.loads(f.read_text())["cell"]["task"] for f in (out / "cells").glob("*.json")}
    assert cells == set(tasks)
    table = res.markdown()
    assert "| Task |" in table and "| COPA |" in table and "(acc)" in table and "(acc_norm)" in table
    report = write_report(out).read_text()
    assert "on ARC-Easy, COPA (Figure 8)" in report and "over 2 tasks" in report
    assert (out / "figures" / "figure8_acc_norm.png").exists() and (out / "figures" / "figure8_acc.png").exists()
    one = sweep(SweepSettings(models=(str(tiny_pair["diff"]),), bits=(16, 4), limit=10, batch_size=8, tasks=("copa",)),
                out, progress=False, log=lambda *_: None, force=True)
    assert list(one.table["cell"].unique()) == list(t.loc[t.task == "copa", "cell"].unique())
    assert json.loads((out / "sweep.json").read_text())["chance"] == 50.0
    capped = SweepSettings(models=("m",), limit=200, tasks=("copa", "arc_easy")).task_items()
    assert len(capped["copa"]) == get_task("copa").rows and len(capped["arc_easy"]) == 200
    with pytest.raises(OutlierscopeError, match="limit must be in 1..570"):
        SweepSettings(models=("m",), limit=5000, tasks=("copa", "arc_easy")).task_items()
    hs = sw.cell_settings("m", "w", s.spec(16), SweepSettings(models=("m",)), "d", "float32")
    assert "task" not in hs


def test_legacy_task_record(tmp_path):
    """A sweep.json from before ``tasks`` (one ``task``) reads back as that task; other settings still refuse."""
    rec = {"settings": {"models": ["pair-tiny:diff"], "task": "copa"}}
    assert SweepSettings.from_record(rec["settings"]).tasks == ("copa",)
    (tmp_path / "sweep.json").write_text(json.dumps(rec))
    now = SweepSettings(models=("pair-tiny:diff",), tasks=("copa",))
    sw.check_previous(tmp_path, json.loads(json.dumps(sw.asdict(now))), force=False)
    with pytest.raises(OutlierscopeError, match="tasks differ"):
        sw.check_previous(tmp_path, json.loads(json.dumps(sw.asdict(SweepSettings(models=("pair-tiny:diff",))))),
                           force=False)


def test_task_errors(capsys, tmp_path):
    with pytest.raises(OutlierscopeError, match="did you mean piqa"):
        SweepSettings(models=("pair-tiny:diff",), tasks=("piqaa",))
    with pytest.raises(OutlierscopeError, match="copa is given twice"):
        SweepSettings(models=("pair-tiny:diff",), tasks=("copa", "copa"))
    assert main(["sweep", "--model", "pair-tiny:diff", "--task", "copa", "--data", "x.jsonl", "--out", str(tmp_path / "o")]) == 2
    assert "--data must be None unless the tasks include hellaswag" in capsys.readouterr().err
    assert main(["sweep", "--task", "wingrande", "--out", str(tmp_path / "o")]) == 2
    assert "did you mean winogrande" in capsys.readouterr().err


@pytest.mark.filterwarnings("error::outlierscope.report.markdown.ClippedTextWarning")  # its small figures too
def test_sweep_attention_error(tiny_pair, hs_jsonl, tmp_path):
    """--attn-error: attn_error.csv per model, bit width, layer and head (quantized cells only); cells keep it on
    resume; cells without it keep their ids."""
    spec = str(tiny_pair["diff"])
    s = SweepSettings(models=(spec,), bits=(16, 8, 4), data=str(hs_jsonl), limit=6, batch_size=8, attn_error=True)
    out = tmp_path / "err"
    res = sweep(s, out, progress=False, log=lambda *_: None)
    t = pd.read_csv(out / "attn_error.csv")
    n_layers = 2
    assert set(t["bits"]) == {8, 4} and len(t) == 2 * n_layers * t["head"].nunique()
    assert (t["rows"] > 0).all() and {"kl_mean", "argmax_change_rate", "rel_out_mean"} <= set(t.columns)
    by_bits = t.groupby("bits")["kl_mean"].mean()
    assert by_bits[8] < by_bits[4]
    from outlierscope.report.markdown import write_report

    report = write_report(out).read_text()  # the report's section, pooled by rows over layers and heads
    for bits, g in t.groupby("bits"):
        kl = (g["kl_mean"] * g["rows"]).sum() / g["rows"].sum()
        assert f"| {bits}-bit int per_tensor | {g['rows'].sum():,} | {kl:.3g} |" in report
    assert "figures/attn_error_layers.png" in report
    logs = []
    sweep(s, out, progress=False, log=logs.append)
    assert sum("done earlier" in m for m in logs) == 3 and pd.read_csv(out / "attn_error.csv").equals(t)
    plain = SweepSettings(models=(spec,), bits=(16, 8, 4), data=str(hs_jsonl), limit=6, batch_size=8)
    ids = set(res.table["cell"])
    other = sweep(plain, tmp_path / "plain", progress=False, log=lambda *_: None)
    assert set(other.table["cell"]) & ids == {c for c in ids if "_b16_" in c}  # quantized cells differ, 16 bits shared


@pytest.mark.parametrize("argv,msg", [
    (["--layers", "3-1"], "ranges from low to high"),
    (["--layers", "9"], "layers [9] out of range: the model has layers 0..1"),
    (["--bits", "16", "4", "--layers", "5"], "out of range"),
])
def test_layers_checked_before_the_first_cell(argv, msg, tiny_pair, hs_jsonl, tmp_path, capsys, monkeypatch):
    """Bad layers are refused before any cell runs (no evaluate call, no cell written)."""
    import outlierscope.runs.sweep as sw

    calls = []
    monkeypatch.setattr(sw, "evaluate", lambda *a, **k: calls.append(1))
    out = tmp_path / "o"
    rc = main(["sweep", "--model", str(tiny_pair["diff"]), "--data", str(hs_jsonl), *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and err.count("\n") == 1, err
    assert calls == [] and not out.exists()


def test_second_model_checked_before_the_first_runs(tiny_pair, hs_jsonl, tmp_path, capsys, monkeypatch):
    import outlierscope.runs.sweep as sw

    calls = []
    monkeypatch.setattr(sw, "evaluate", lambda *a, **k: calls.append(1))
    out = tmp_path / "o"
    rc = main(["sweep", "--model", str(tiny_pair["diff"]), "--model", "pair-tiny:dif", "--data", str(hs_jsonl),
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "did you mean pair-tiny:diff" in err and calls == [] and not out.exists()


def test_reproduce_checks_the_sweep_before_profiling(tmp_path, capsys, monkeypatch):
    """A typo in the second model, or a --limit above every task, stops reproduce before its profile runs."""
    import outlierscope.runs.profile as prof

    calls = []
    monkeypatch.setattr(prof, "profile_model", lambda *a, **k: calls.append(1))
    out = tmp_path / "r"
    rc = main(["reproduce", "--model", "pair-tiny:diff", "--model", "pair-tiny:transfomer", "--out", str(out)])
    assert rc == 2 and "did you mean pair-tiny:transformer" in capsys.readouterr().err
    rc = main(["reproduce", "--model", "pair-tiny:diff", "--limit", "10043", "--tokens", "1000", "--out", str(out)])
    assert rc == 2 and "--limit must be in 1..10042" in capsys.readouterr().err
    assert calls == [] and not out.exists()


def test_merge_garbage_shard_records_are_one_line(tmp_path, capsys):
    d = tmp_path / "shards"
    d.mkdir()
    (d / "sweep.shard-0-of-2.json").write_text('{"settings": {"models": ["a"')  # cut mid-file
    (d / "sweep.shard-1-of-2.json").write_text("[]")
    rc = main(["merge", str(d)])
    err = capsys.readouterr().err
    assert rc == 2 and "sweep.shard-0-of-2.json is not a readable sweep shard record" in err and err.count("\n") == 1
    (d / "sweep.shard-0-of-2.json").write_text("[]")
    rc = main(["merge", str(d)])
    err = capsys.readouterr().err
    assert rc == 2 and "it lacks settings, cells, tasks" in err and err.count("\n") == 1


def test_record_names_each_model_and_its_weights(full, tiny_pair):
    """sweep.json: each model as given, its kind and the sha256 of its weight files (computed here)."""
    import hashlib

    out, _ = full
    rec = json.loads((out / "sweep.json").read_text())
    for role in ("transformer", "diff"):
        spec = str(tiny_pair[role])
        src = rec["model_sources"][spec]
        assert src["given"] == spec and src["kind"] == "directory"
        h = hashlib.sha256()
        for p in sorted(tiny_pair[role].glob("*.safetensors")):
            h.update(p.read_bytes())
        assert src["weights_sha256"] == h.hexdigest()


def test_sweep_with_attention_recipes(tiny_pair, hs_jsonl, tmp_path, capsys):
    """--quant cells: named by their spec text (a recipe's or a spec's), scored as evaluate() scores under
    quantize_model with that spec, resumed, tabulated again byte-identical from the cells, merged from shards."""
    from outlierscope.eval.evaluate import evaluate
    from outlierscope.models.loading import load_model

    s = _settings(tiny_pair, hs_jsonl, models=(str(tiny_pair["diff"]),), bits=(16,),
                  quant=("sage2-int4", "k=int4/per_group:8"))
    out = tmp_path / "q"
    table = sweep(s, out, progress=False, log=lambda *_: None).table
    rec = json.loads((out / "sweep.json").read_text())
    quant = [c for c in rec["cells"] if "quant" in c]
    assert [c["quant"] for c in quant] == [str(QuantSpec.parse("sage2-int4")), "k=int4/per_group:8"]
    assert set(table[table.format == "attn"]["label"]) == {"sage2-int4", "k=int4/per_group:8"}
    lm = load_model(str(tiny_pair["diff"]))
    items = s.task_items()["hellaswag"]
    direct = evaluate(lm, quant=QuantSpec.parse("k=int4/per_group:8"), items=items, batch_size=s.batch_size,
                      progress=False)  # quantized float32 scores: compared at the cell's batch size
    cell = pd.read_csv(out / "cells" / f"{quant[1]['cell']}.csv")
    np.testing.assert_array_equal(cell[[f"score{j}" for j in range(4)]].to_numpy(), direct.items[[f"score{j}" for j in range(4)]].to_numpy())
    logs = []
    sweep(s, out, progress=False, log=logs.append)  # resumed: nothing recomputed
    assert all("done earlier" in m for m in logs if "items in" in m or "done earlier" in m) and len(logs) >= 3
    sw.tabulate_sweep(out, tmp_path / "again")
    assert (tmp_path / "again" / "sweep.csv").read_bytes() == (out / "sweep.csv").read_bytes()
    for i in range(2):
        sweep(s, tmp_path / f"shard{i}", progress=False, log=lambda *_: None, shard=sw.Shard(i, 2))
    sw.merge_sweep([tmp_path / "shard0", tmp_path / "shard1"], tmp_path / "merged", log=lambda *_: None)
    assert (tmp_path / "merged" / "sweep.csv").read_bytes() == (out / "sweep.csv").read_bytes()
    rc = main(["sweep", "--model", str(tiny_pair["diff"]), "--data", str(hs_jsonl), "--quant", "sage3", "--out",
               str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert rc == 2 and "did you mean sage1" in err and err.count("\n") == 1 and not (tmp_path / "bad").exists()


def test_attention_error_with_recipes_measures_every_cell(tiny_pair, hs_jsonl, tmp_path):
    """--attn-error with --quant: the logits cells and the q/k/v/P cells are measured (each row of attn_error.csv
    labelled with its spec); a spec that quantizes the logits and q/k/v together fails before anything runs."""
    s = _settings(tiny_pair, hs_jsonl, models=(str(tiny_pair["diff"]),), bits=(16, 4), quant=("k=int4/per_group:8",),
                  attn_error=True)
    sweep(s, tmp_path, progress=False, log=lambda *_: None)
    err = pd.read_csv(tmp_path / "attn_error.csv")

    assert set(err["label"]) == {"4-bit int per_tensor", QuantSpec.parse("k=int4/per_group:8").label}
    rows = err.groupby("label")["rows"].sum()
    assert rows.nunique() == 1 and rows.iloc[0] > 0 and (err["kl_mean"] > 0).any()  # the same rows, both measured
    with pytest.raises(OutlierscopeError, match="not both"):
        _settings(tiny_pair, hs_jsonl, quant=("k=int4/per_token;logits=int8/per_tensor",), attn_error=True)


def test_a_quantized_cell_is_named_by_its_batch_size():
    """Quantized per-item scores depend on the batch size by float32 rounding (tests/eval/test_scorer.py), so a
    quantized cell computed at batch 8 is not reused at batch 32; an unquantized cell (~1e-5 nats) keeps its id."""
    from outlierscope.runs.cells import cell_id

    def ident(spec, bs):
        return cell_id(sw.cell_settings("m", "w", spec, SweepSettings(models=("m",), batch_size=bs), "d", "float32"))

    s = SweepSettings(models=("m",))
    for spec in (s.spec(4), QuantSpec.parse("sage1")):
        assert ident(spec, 8) != ident(spec, 32)
    assert ident(s.spec(16), 8) == ident(s.spec(16), 32)


def test_a_spec_with_its_own_layers_and_layers_is_refused():
    """One rule: ``layers`` applies to the specs that name none; both at once is an error before any work."""
    with pytest.raises(OutlierscopeError, match="layers must be left out when a quant spec names its own layers"):
        SweepSettings(models=("m",), quant=("k=int4/per_token; layers:0-1",), layers=(2, 3))
    s = SweepSettings(models=("m",), quant=("k=int4/per_token; layers:0-1", "sage1"))
    assert [sp.layers for sp in s.specs()[-2:]] == [(0, 1), None]


def test_linear_schemes_gold_loglik_and_linear_error(tiny_pair, hs_jsonl, tmp_path):
    """A pair swept with linear schemes: gold_ll.csv's changes and Diff-minus-Transformer differences equal numpy
    recomputations from the per-item cell files (intervals around them); linear_error.csv and the report's linear
    section (token-weighted means per scheme and kind); tabulating again from the cells writes the same files."""
    from outlierscope.report.markdown import write_report

    models = (str(tiny_pair["transformer"]), str(tiny_pair["diff"]))
    s = SweepSettings(models=models, bits=(16,), quant=("w4a4", "w8a8"), data=str(hs_jsonl), limit=12, batch_size=8,
                      attn_error=True)
    out = tmp_path / "lin"
    res = sweep(s, out, progress=False, log=lambda *_: None)
    cells = res.record["cells"]

    def gold(cell):
        df = pd.read_csv(out / "cells" / f"{cell}.csv")
        return df[[f"score{j}" for j in range(4)]].to_numpy()[np.arange(len(df)), df["label"].to_numpy()]

    g = pd.read_csv(out / "gold_ll.csv")
    assert len(g) == 4 and not (out / "attn_error.csv").exists()  # linear-only specs: no attention error
    change = {}
    for c in cells:
        if c["bits"] == 16:
            continue
        base = next(b for b in cells if b["model"] == c["model"] and b["bits"] == 16)
        change[c["model"], c["label"]] = d = gold(c["cell"]) - gold(base["cell"])
        row = g[(g["model"] == c["model"]) & (g["label"] == c["label"])].iloc[0]
        assert row["delta_gold_ll"] == pytest.approx(d.mean(), abs=1e-9) and row["ci_low"] <= d.mean() <= row["ci_high"]
        if c["model"] == models[1]:
            vs = d - change[models[0], c["label"]]
            assert row["minus_first_model"] == pytest.approx(vs.mean(), abs=1e-9)
        else:
            assert np.isnan(row["minus_first_model"])
    w4 = g.set_index(["model", "label"])["delta_gold_ll"]
    assert (w4.xs("w4a4", level="label").abs() > w4.xs("w8a8", level="label").abs()).all()  # 4 bits move it more
    lin = pd.read_csv(out / "linear_error.csv")
    assert len(lin) == 2 * 2 * 2 * 7 and (lin["tokens"] > 0).all()  # models x schemes x layers x linears
    report = write_report(out).read_text()
    for (m, label), h in lin.groupby(["model", "label"]):
        mean = np.average(h["rel_err_mean"], weights=h["tokens"])
        down = np.average(h[h["linear"] == "mlp.down_proj"]["rel_err_mean"], weights=h[h["linear"] == "mlp.down_proj"]["tokens"])
        assert f"| {m} | HellaSwag | {label} | {mean:.3g} |" in report and f" {down:.3g} |" in report
    assert "## Gold log-likelihood" in report and "figures/linear_error.png" in report and "figures/gold_ll.png" in report
    sw.tabulate_sweep(out, tmp_path / "again")
    for name in ("sweep.csv", "gold_ll.csv", "linear_error.csv"):
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name


def test_lm_head_scheme_through_the_scorer(tiny_pair, hs_jsonl, tmp_path):
    """linears:lm_head through sweep: the scorer feeds the head the scored positions only; linear_error.csv holds one
    row (layer one past the last decoder layer) over exactly the continuation tokens of every choice, and the cell
    is a real change (the gold log-likelihood moves)."""
    s = SweepSettings(models=(str(tiny_pair["diff"]),), bits=(16,), quant=("w=int4/per_channel; a=int8/per_token; linears:lm_head",),
                      data=str(hs_jsonl), limit=6, batch_size=8, attn_error=True)
    out = tmp_path / "head"
    sweep(s, out, progress=False, log=lambda *_: None)
    lin = pd.read_csv(out / "linear_error.csv")
    cell = next(c for c in json.loads((out / "sweep.json").read_text())["cells"] if c["bits"] != 16)
    items = pd.read_csv(out / "cells" / f"{cell['cell']}.csv")
    assert list(lin["linear"]) == ["lm_head"] and list(lin["layer"]) == [2]
    assert lin["tokens"].iloc[0] == items[[f"tokens{j}" for j in range(4)]].to_numpy().sum()
    assert 0 < lin["rel_err_mean"].iloc[0] < lin["rel_err_max"].iloc[0]
    assert pd.read_csv(out / "gold_ll.csv")["delta_gold_ll"].abs().iloc[0] > 0


def test_sweep_with_bitsandbytes_weights(tiny_pair, hs_jsonl, tmp_path):
    """--weights nf4: every cell runs with bitsandbytes' Linear4bit in the decoder's linears, put back after each
    cell. Reference: the model with its linears replaced by bitsandbytes' own modules by hand, evaluated unquantized
    (16) and with the logits at 4 bits; cells keep the weights in their identity and table rows."""
    import bitsandbytes as bnb
    import torch

    from outlierscope.eval.evaluate import evaluate
    from outlierscope.hooks.points import decoder_layers
    from outlierscope.models.loading import load_model

    s = _settings(tiny_pair, hs_jsonl, models=(str(tiny_pair["diff"]),), bits=(16, 4), weights="nf4", limit=6)
    out = tmp_path / "nf4"
    table = sweep(s, out, progress=False, log=lambda *_: None).table
    assert set(table["weights"]) == {"nf4"} and set(table["label"]) == {"16 (unquantized)", "4-bit int per_tensor"}
    rec = json.loads((out / "sweep.json").read_text())
    lm = load_model(str(tiny_pair["diff"]))
    for layer in decoder_layers(lm.model):  # bitsandbytes by hand
        for child in list(layer.modules()):
            for name, lin in list(child.named_children()):
                if type(lin) is torch.nn.Linear:
                    new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                            compute_dtype=lin.weight.dtype, quant_type="nf4")
                    new.load_state_dict(lin.state_dict())
                    setattr(child, name, new.to(lin.weight.device))
    items = s.task_items()["hellaswag"]
    for c, spec in zip(rec["cells"], (QuantSpec(), QuantSpec.logits(bits=4))):
        ident = json.loads((out / "cells" / f"{c['cell']}.json").read_text())["cell"]
        assert ident["weights"] == "nf4" and ident["bits"] == spec.bits
        ref = evaluate(lm, quant=spec, items=items, batch_size=s.batch_size, progress=False)
        cell = pd.read_csv(out / "cells" / f"{c['cell']}.csv")
        cols = [f"score{j}" for j in range(4)]
        np.testing.assert_array_equal(cell[cols].to_numpy(), ref.items[cols].to_numpy())
    with pytest.raises(OutlierscopeError, match="specs without bitsandbytes weights"):
        _settings(tiny_pair, hs_jsonl, quant=("w=bnb-nf4",))


def test_a_part_swapped_for_another_cells_part_is_recomputed_or_refused(tiny_pair, hs_jsonl, tmp_path, capsys, full):
    """Another cell's part of the same shard under a part's names (its record and table, digest-valid): `merge` is a
    one-line error naming the record; the shard's run again says so in one line and computes that part again; the
    merged table then equals one process's."""
    s = _settings(tiny_pair, hs_jsonl)
    for i in range(2):
        sweep(s, tmp_path / f"s{i}", progress=False, log=lambda *_: None, shard=sw.Shard(i, 2))
    cells = tmp_path / "s0" / "cells"
    a, b = sorted(cells.glob("*_b4_*.shard-0-of-2.json"))[0], sorted(cells.glob("*_b2_*.shard-0-of-2.json"))[0]
    for suffix in (".json", ".csv"):
        a.with_suffix(suffix).write_bytes(b.with_suffix(suffix).read_bytes())
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert str(a) in err and "(swapped or renamed)" in err and "\n" not in err
    logs = []
    sweep(s, tmp_path / "s0", progress=False, log=logs.append, shard=sw.Shard(0, 2))
    assert sum("(swapped or renamed); computing it again" in m for m in logs) == 1
    sw.merge_sweep([tmp_path / "s0", tmp_path / "s1"], tmp_path / "m", log=lambda *_: None)
    assert (tmp_path / "m" / "sweep.csv").read_bytes() == (full[0] / "sweep.csv").read_bytes()


@pytest.mark.parametrize("damage", [lambda b: b[:40], lambda b: b.replace(b'"batch_size": 8', b'"batch_size": 9', 1)],
                         ids=["truncated", "edited"])
def test_a_damaged_record_in_out_is_named_as_damaged(tiny_pair, hs_jsonl, tmp_path, damage):
    """sweep.json cut or edited in the run's own --out: one line saying it is damaged (not "other settings")."""
    s = _settings(tiny_pair, hs_jsonl, bits=(16, 4))
    out = tmp_path / "s"
    sweep(s, out, progress=False, log=lambda *_: None)
    rec = out / "sweep.json"
    rec.write_bytes(damage(rec.read_bytes()))
    with pytest.raises(OutlierscopeError, match="is damaged: pass force=True to replace its tables") as e:
        sweep(s, out, progress=False, log=lambda *_: None)
    assert str(rec) in str(e.value) and "other settings" not in str(e.value)


def test_cli_refusal_names_the_flag(tiny_pair, hs_jsonl, tmp_path, capsys):
    """The sweep command's refusal of other settings in --out names --force, as every run command's does."""
    argv = ["sweep", "--model", str(tiny_pair["diff"]), "--data", str(hs_jsonl), "--bits", "16", "--out", str(tmp_path)]
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, "--granularity", "per_head"]) == 2
    err = capsys.readouterr().err
    assert "other settings (granularity differ)" in err and "pass --force" in err and "force=True" not in err


def test_a_directory_where_a_cell_file_goes_is_one_line_before_the_cell(tiny_pair, hs_jsonl, tmp_path, capsys, full,
                                                                        monkeypatch):
    """A directory standing where a sweep cell's table goes: one line naming it, exit 2, before that cell runs."""
    monkeypatch.setattr(sw, "evaluate", lambda *a, **k: pytest.fail("the cell ran"))
    cid = json.loads((full[0] / "sweep.json").read_text())["cells"][0]["cell"]
    out = tmp_path / "s"
    (out / "cells" / f"{cid}.csv").mkdir(parents=True)
    rc = main(["sweep", "--model", str(tiny_pair["transformer"]), "--model", str(tiny_pair["diff"]), "--bits", "16",
               "4", "2", "--data", str(hs_jsonl), "--batch-size", "8", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"{cid}.csv is a directory where outlierscope writes a file" in err
    assert sorted(p.name for p in (out / "cells").iterdir()) == [f"{cid}.csv"]


def test_sweep_kld_text_is_read_before_any_item_cell(bad_texts, capsys, tmp_path):
    out = tmp_path / "sweep"
    rc = main(["sweep", "--model", "pair-tiny:diff", "--bits", "16", "8", "--limit", "4", "--kld-text",
               str(bad_texts / "latin1.txt"), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "latin1.txt" in err and "not UTF-8" in err
    assert not list(out.rglob("*.npz")) and not list(out.rglob("*.json"))


def test_kld_length_zero_names_its_flag(capsys, tmp_path):
    rc = main(["sweep", "--model", "pair-tiny:diff", "--kld-text", "lambada", "--kld-length", "0", "--out",
               str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "--kld-length must be >= 2" in err
