"""The perplexity command: text sources, cells with resume, the table and record, one-line errors."""

import json
import math
import os
import warnings

import numpy as np
import pandas as pd
import pytest

from outlierscope.cli import main
from outlierscope.data.running_text import load_text
from outlierscope.errors import OutlierscopeError
from outlierscope.eval.perplexity import TokenScores
from outlierscope.quant.specs.spec import QuantSpec

PASSAGES = [f"Passage {i}: " + " ".join(f"the {w} went to the {w}s" for w in ("cat", "dog", "fox")[: 1 + i % 3]) * (3 + i)
            for i in range(30)]


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "passages.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in PASSAGES))
    return path


def test_text_sources(tmp_path, text):
    import pandas as pd

    assert load_text(str(text)).docs == tuple(PASSAGES)
    txt = tmp_path / "a.txt"
    txt.write_text("one\n\ntwo")
    assert load_text(str(txt)).docs == ("one\n\ntwo",)  # a .txt file is one document, as written
    pq = tmp_path / "a.parquet"
    pd.DataFrame({"text": ["x y", "", "z"]}).to_parquet(pq)
    got = load_text(str(pq))
    assert got.docs == ("x y", "", "z") and got.kind == "file"
    assert got.record()["sha256"] != load_text(str(text)).record()["sha256"]
    for bad, msg in (("nope.txt", "neither 'lambada', an existing file, nor a dataset"),
                     ("a:b", "neither"), (str(tmp_path / "a.csv"), "neither")):
        with pytest.raises(OutlierscopeError, match=msg):
            load_text(bad)
    (tmp_path / "b.csv").write_text("x")
    with pytest.raises(OutlierscopeError, match="expected a .txt, .jsonl"):
        load_text(str(tmp_path / "b.csv"))


def test_lambada_is_the_offline_default():
    from outlierscope.data.running_text import LAMBADA_DOCS, lambada_path

    if not lambada_path().exists():
        pytest.skip("outlierscope data fetch has not run")
    t = load_text()
    assert len(t.docs) == LAMBADA_DOCS and t.docs[0].startswith("In my palm is a clear stone")
    assert t.docs[0].endswith("I don't care about signs")  # the passage whole: context and its last word


def _run(tmp_path, text, *extra, **flags):
    given = {"--protocol": "gptq", "--length": "64", "--batch-size": "3", **flags}
    return main(["perplexity", "--model", "pair-tiny:diff", "--text", str(text), "--bits", "16", "4", "--quant",
                 "kivi-2bit", "--out", str(tmp_path / "p"), *[x for kv in given.items() for x in kv], *extra])


def test_run_resume_table_and_record(tmp_path, text, capsys):
    assert _run(tmp_path, text) == 0
    out = tmp_path / "p"
    table = pd.read_csv(out / "perplexity.csv")
    rec = json.loads((out / "perplexity.json").read_text())
    assert list(table["label"]) == ["16 (unquantized)", "4-bit int per_tensor", "kivi-2bit"]
    assert rec["text"]["sha256"] == load_text(str(text)).sha256 and rec["settings"]["protocol"] == "gptq"
    assert rec["length"] == 64 and rec["scored_tokens"] == rec["windows"] * 63
    _assert_tokenizer_record(rec["tokenizer"])
    for row in table.to_dict("records"):
        cell = TokenScores.load(out / "cells" / f"{row['cell']}.npz")
        assert len(cell) == rec["scored_tokens"] and row["tokens"] == len(cell)
        assert math.isclose(row["ppl"], math.exp(cell.nll.mean()), rel_tol=1e-12)
        assert math.isclose(row["delta_nll"], (cell.nll - cell.nll_base).mean(), rel_tol=1e-9, abs_tol=1e-15)
        assert math.isclose(row["kld_mean"], cell.kld.mean(), rel_tol=1e-12, abs_tol=0)
    base = table.iloc[0]
    assert base["kld_max"] == 0 and base["same_top"] == 1 and base["ln_ppl_ratio"] == 0
    assert (table.iloc[1:]["kld_mean"] > 0).all() and (table["ppl_base"] == base["ppl"]).all()
    capsys.readouterr()
    assert _run(tmp_path, text, "--quant", "sage1") == 2  # other settings: refused before any work, tables kept
    err = capsys.readouterr().err
    assert "holds a perplexity run with other settings (quant differ)" in err and "pass --force" in err
    assert "force=True" not in err and len(err.strip().splitlines()) == 1
    assert pd.read_csv(out / "perplexity.csv").equals(table)
    assert _run(tmp_path, text, "--quant", "sage1", "--force") == 0  # resumed: only the new spec computed
    assert "3 cells done earlier, 1 to compute" in capsys.readouterr().out
    again = pd.read_csv(out / "perplexity.csv")
    pd.testing.assert_frame_equal(again.iloc[:3], table)


def test_a_second_run_into_a_running_out_is_refused_at_once(tmp_path, text, capsys):
    """While a run holds --out (its lock taken by another process), the same command there is a one-line error before
    any work, naming the running process, and writes nothing; once that process ends, the command runs."""
    import subprocess
    import sys

    out = tmp_path / "p"
    out.mkdir()
    code = ("import sys, time; from outlierscope.io import run_lock\n"
            f"with run_lock({str(out)!r}, 'whole', 'perplexity run'):\n"
            "    print('held', flush=True); sys.stdin.readline()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert _run(tmp_path, text) == 2
        err = capsys.readouterr().err
        assert f"another perplexity run into this directory is running (pid {holder.pid})" in err
        assert sorted(p.name for p in out.iterdir()) == [".outlierscope-whole.lock"]
        assert _run(tmp_path, text, "--shard", "0/2") == 0  # another shard's lock: not held
    finally:
        holder.communicate("\n", timeout=60)
    assert not (out / ".outlierscope-whole.lock").exists()
    assert _run(tmp_path, text) == 0 and (out / "perplexity.csv").exists()


def test_noise_floor_cells_beside_each_quantized_spec(tmp_path, text, capsys):
    """--noise float64: one more cell per quantized spec (the spec in float64 as its base), its KLD beside the
    spec's, '-' for the unquantized row; the first table's columns unchanged; resumed, nothing recomputed."""
    assert _run(tmp_path, text) == 0
    plain = pd.read_csv(tmp_path / "p" / "perplexity.csv")
    capsys.readouterr()
    assert _run(tmp_path, text, "--noise", "float64", "--force") == 0  # another setting: replaces the tables
    assert "0 noise-floor (float64) cells done earlier, 2 to compute" in capsys.readouterr().out
    out = tmp_path / "p"
    table = pd.read_csv(out / "perplexity.csv")
    pd.testing.assert_frame_equal(table[plain.columns], plain)
    rec = json.loads((out / "perplexity.json").read_text())
    assert rec["settings"]["noise"] == "float64"
    assert math.isnan(table.iloc[0]["noise_kld_mean"]) and "| - | - |" in (out / "perplexity.md").read_text()
    for label in ("4-bit int per_tensor", "kivi-2bit"):
        row = table[table["label"] == label].iloc[0]
        cell = json.loads((out / "cells" / f"{rec['cells'][f'{label} (noise float64)']}.json").read_text())
        assert cell["cell"]["noise"] == "float64" and cell["cell"]["quant"] == row["quant"]
        tokens = TokenScores.load(out / "cells" / f"{rec['cells'][f'{label} (noise float64)']}.npz")
        assert math.isclose(row["noise_kld_mean"], tokens.kld.mean(), rel_tol=1e-12)
        assert 0 < row["noise_kld_mean"] < row["kld_mean"]  # rounding moves the output less than 4-bit / 2-bit
    capsys.readouterr()
    assert _run(tmp_path, text, "--noise", "float64") == 0
    assert "2 noise-floor (float64) cells done earlier, 0 to compute" in capsys.readouterr().out


@pytest.mark.parametrize("flags,extra,msg", [
    ({"--noise": "float64", "--dtype": "float64"}, [], "--noise must be an arithmetic other than dtype=float64"),
    ({"--noise": "float64"}, ["--quant", "w=fint8/per_channel; linears:*,lm_head"], "noise floor of a quantized lm_head"),
    ({"--length": "1"}, [], "--length must be >= 2"),
    ({"--length": "100000"}, [], "--length must be at most the model's"), ({}, ["--quant", "sage3"], "did you mean sage1"),
    ({}, ["--quant", "kivi-2bit"], "is given twice"), ({"--batch-size": "0"}, [], "--batch-size must be >= 1"),
])
def test_errors_are_one_line(tmp_path, text, capsys, flags, extra, msg):
    rc = _run(tmp_path, text, *extra, **flags)
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and err.count("\n") == 1
    assert not (tmp_path / "p" / "perplexity.csv").exists()


def test_unknown_protocol_is_argparses_choice_error(tmp_path, text, capsys):
    with pytest.raises(SystemExit) as e:
        _run(tmp_path, text, **{"--protocol": "bpb"})
    assert e.value.code == 2 and "invalid choice: 'bpb' (choose from 'gptq', 'lmeval', 'llamacpp')" in capsys.readouterr().err


def test_too_little_text_is_one_line(tmp_path, capsys, monkeypatch):
    """Found with the tokenizer alone, before the weights load."""
    import outlierscope.models.loading as loading

    def no_weights(*a, **k):
        raise AssertionError("the weights were loaded before the text was checked")

    monkeypatch.setattr(loading, "load_model", no_weights)
    short = tmp_path / "s.txt"
    short.write_text("a b c")
    rc = main(["perplexity", "--model", "pair-tiny:diff", "--text", str(short), "--length", "64", "--out",
               str(tmp_path / "q")])
    err = capsys.readouterr().err
    assert rc == 2 and "--length must be at most the 3 tokens of the text" in err and err.count("\n") == 1
    assert not (tmp_path / "q").exists()


def test_windows_are_scored_once_per_batch_of_every_spec(tmp_path, text):
    """Per-token values of the cells equal the library's score_windows on the same windows (the command adds
    nothing to them)."""
    from outlierscope.eval.perplexity import score_windows
    from outlierscope.eval.windows import protocol_windows
    from outlierscope.models.loading import load_model

    assert _run(tmp_path, text) == 0
    table = pd.read_csv(tmp_path / "p" / "perplexity.csv")
    lm = load_model("pair-tiny:diff")
    windows = protocol_windows("gptq", lm.tokenizer, PASSAGES, 64)
    (ref,) = score_windows(lm.model, windows, [QuantSpec.parse("kivi-2bit")], batch_size=3)
    cell = TokenScores.load(tmp_path / "p" / "cells" / f"{table.iloc[2]['cell']}.npz")
    assert np.array_equal(cell.kld, ref.kld) and np.array_equal(cell.nll, ref.nll)


def test_lmeval_protocol_adds_lm_evals_document_metrics(tmp_path, text):
    """With --protocol lmeval the table holds lm-eval's word/byte perplexity and bits per byte (from its own
    aggregation functions applied to each document's log-likelihood in the cell)."""
    from lm_eval.api.metrics import bits_per_byte, weighted_perplexity
    from lm_eval.api.task import ConfigurableTask

    from outlierscope.eval.perplexity import document_loglikelihoods
    from outlierscope.eval.windows import lmeval_windows
    from outlierscope.models.loading import load_model

    assert _run(tmp_path, text, **{"--protocol": "lmeval", "--length": "48"}) == 0
    table = pd.read_csv(tmp_path / "p" / "perplexity.csv")
    windows = lmeval_windows(load_model("pair-tiny:diff").tokenizer, PASSAGES, 48)
    for row in table.to_dict("records"):
        ll = document_loglikelihoods(TokenScores.load(tmp_path / "p" / "cells" / f"{row['cell']}.npz"), windows,
                                     len(PASSAGES))
        nbytes = [(x, ConfigurableTask.count_bytes(d)) for x, d in zip(ll, PASSAGES)]
        assert math.isclose(row["word_perplexity"], weighted_perplexity(
            [(x, ConfigurableTask.count_words(d)) for x, d in zip(ll, PASSAGES)]), rel_tol=1e-12)
        assert math.isclose(row["bits_per_byte"], bits_per_byte(nbytes), rel_tol=1e-12)
        assert math.isclose(row["byte_perplexity"], weighted_perplexity(nbytes), rel_tol=1e-12)
    assert table.iloc[0]["word_perplexity"] == table.iloc[0]["word_perplexity_base"]


def test_logprobs_lmeval_is_its_own_cell_with_lm_evals_sums(tmp_path, text, capsys):
    """--logprobs lmeval (dtype float32): cells of their own (their identity says so), NLLs from a float32
    log-softmax (within float32 rounding of the float64 run's, not equal), documents summed per window in float32
    (lm-eval's aggregation of them gives the table's metrics); with another dtype or --noise: one line, exit 2."""
    from lm_eval.api.metrics import weighted_perplexity
    from lm_eval.api.task import ConfigurableTask

    from outlierscope.eval.perplexity import document_loglikelihoods
    from outlierscope.eval.windows import lmeval_windows
    from outlierscope.models.loading import load_model

    flags = {"--protocol": "lmeval", "--length": "48", "--dtype": "float32"}
    assert _run(tmp_path / "a", text, **flags) == 0
    assert _run(tmp_path / "b", text, "--logprobs", "lmeval", **flags) == 0
    exact, lmeval = (pd.read_csv(tmp_path / d / "p" / "perplexity.csv") for d in ("a", "b"))
    assert not set(exact["cell"]) & set(lmeval["cell"])
    windows = lmeval_windows(load_model("pair-tiny:diff").tokenizer, PASSAGES, 48)
    for row, other in zip(lmeval.to_dict("records"), exact.to_dict("records")):
        cells = tmp_path / "b" / "p" / "cells"
        assert json.loads((cells / f"{row['cell']}.json").read_text())["cell"]["logprobs"] == "lmeval"
        tokens = TokenScores.load(cells / f"{row['cell']}.npz")
        ll = document_loglikelihoods(tokens, windows, len(PASSAGES), logprobs="lmeval")
        words = [(x, ConfigurableTask.count_words(d)) for x, d in zip(ll, PASSAGES)]
        assert math.isclose(row["word_perplexity"], weighted_perplexity(words), rel_tol=1e-13)  # a sum's order
        assert abs(row["word_perplexity"] / other["word_perplexity"] - 1) > 1e-9
        assert math.isclose(row["word_perplexity"], other["word_perplexity"], rel_tol=1e-5)
        assert np.array_equal(tokens.nll, tokens.nll.astype(np.float32))  # float32 values
    capsys.readouterr()
    for extra in (["--dtype", "float64"], ["--noise", "float64"]):
        given = {**flags, "--dtype": extra[1]} if extra[0] == "--dtype" else flags
        rc = _run(tmp_path / "c", text, "--logprobs", "lmeval", *([] if extra[0] == "--dtype" else extra), **given)
        err = capsys.readouterr().err
        assert rc == 2 and "--logprobs must be float64 unless dtype=float32 and no noise" in err
    assert not (tmp_path / "c").exists()


def test_figures_have_every_quantized_spec(tmp_path, text):
    """figures/: the KLD distribution with one line per quantized spec (not the unquantized model, whose KLD is 0),
    and the interval panels with one row each, no text cut off."""

    import matplotlib

    from outlierscope.report.markdown import ClippedTextWarning
    from outlierscope.report.perplexity_plots import kld_distribution, nll_and_kld

    matplotlib.use("Agg")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ClippedTextWarning)
        assert _run(tmp_path, text) == 0
    out = tmp_path / "p"
    assert {p.name for p in (out / "figures").iterdir()} == {"kld_distribution.png", "nll_and_kld.png"}
    table = pd.read_csv(out / "perplexity.csv")
    kld = {r["label"]: TokenScores.load(out / "cells" / f"{r['cell']}.npz").kld for r in table.to_dict("records")}
    fig = kld_distribution(kld)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["4-bit int per_tensor", "kivi-2bit"]
    fig2 = nll_and_kld(table)
    assert [t.get_text() for t in fig2.axes[0].get_yticklabels()] == ["4-bit int per_tensor", "kivi-2bit"]


def test_shards_in_one_directory_then_assembled_give_the_same_bytes(tmp_path, text, capsys):
    """--shard 0/2 into an --out writes its parts and no table; --shard 1/2 into the same --out finds every part
    there, assembles the cells and writes the tables: perplexity.csv byte-identical to a single process's; a later
    run computes nothing."""
    assert _run(tmp_path, text) == 0
    whole = (tmp_path / "p" / "perplexity.csv").read_bytes()
    split = tmp_path / "split"
    assert _run(split, text, "--shard", "0/2") == 0
    assert not (split / "p" / "perplexity.csv").exists()
    assert len(list((split / "p" / "cells").glob("*.part-*.npz"))) == 3 * 8
    assert _run(split, text, "--shard", "1/2") == 0
    assert (split / "p" / "perplexity.csv").read_bytes() == whole
    assert not list((split / "p" / "cells").glob("*.part-*"))
    capsys.readouterr()
    assert _run(split, text) == 0 and "3 cells done earlier, 0 to compute" in capsys.readouterr().out


def test_an_interrupted_run_resumes_at_its_shard(tmp_path, text, monkeypatch):
    """Killed in its 6th virtual shard, a rerun computes only the shards not saved (the first five are read back)
    and writes the same table as an uninterrupted run."""
    from outlierscope.runs import text_cells as P

    real, calls = P.score_windows, []

    def failing(*a, **k):
        calls.append(k["shards"])
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(P, "score_windows", failing)
    assert _run(tmp_path, text) == 130  # the CLI's exit for an interruption
    calls.clear()
    monkeypatch.setattr(P, "score_windows", lambda *a, **k: calls.append(k["shards"]) or real(*a, **k))
    assert _run(tmp_path, text) == 0
    assert calls == [[v] for v in range(5, 16)]
    assert _run(tmp_path / "again", text) == 0
    assert (tmp_path / "p" / "perplexity.csv").read_bytes() == (tmp_path / "again" / "p" / "perplexity.csv").read_bytes()


def test_torchrun_two_processes_give_one_process_bytes(tmp_path, text):
    """Two gloo processes under torchrun (each its virtual shards, rank 0 assembling once both wrote their parts):
    perplexity.csv and every cell byte-identical to one process's; the record says 2 processes; no part left."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = ["-m", "outlierscope", "perplexity", "--model", "pair-tiny:diff", "--text", str(text), "--bits", "16", "4",
            "--quant", "kivi-2bit", "--protocol", "gptq", "--length", "64", "--batch-size", "3"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    for cmd, out in (([sys.executable], "one"), (launch, "two")):
        r = subprocess.run([*cmd, *argv, "--out", str(tmp_path / out)], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    one, two = tmp_path / "one", tmp_path / "two"
    assert (two / "perplexity.csv").read_bytes() == (one / "perplexity.csv").read_bytes()
    cells = sorted(p.name for p in (one / "cells").iterdir())
    assert cells == sorted(p.name for p in (two / "cells").iterdir()) and not [c for c in cells if ".part-" in c]
    for c in cells:
        if c.endswith(".npz"):
            a, b = TokenScores.load(one / "cells" / c), TokenScores.load(two / "cells" / c)
            assert all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("window", "nll", "kld", "p_diff"))
    assert json.loads((two / "perplexity.json").read_text())["processes"] == 2


def _assert_tokenizer_record(tok: dict) -> None:
    """The record names the tokenizer that cut the text: its class and size as transformers loads it from the pair's
    directory, and a sha256 over its files computed here (name, NUL, bytes)."""
    import hashlib

    from transformers import AutoTokenizer

    from outlierscope.models.resolve import resolve_model

    path = resolve_model("pair-tiny:diff").path
    ref = AutoTokenizer.from_pretrained(path)
    assert (tok["class"], tok["tokens"]) == (type(ref).__name__, len(ref)) and "tokenizer.json" in tok["files"]
    digest = hashlib.sha256()
    for name in tok["files"]:
        digest.update(name.encode() + b"\0" + (path / name).read_bytes())
    assert tok["files_sha256"] == digest.hexdigest()


def test_specs_scored_in_groups_give_the_same_values(tmp_path, text, monkeypatch):
    """SPECS_PER_PASS bounds how many specs hold a batch's hidden states at once: one spec (or noise pair) per pass
    (the unquantized trunk run again for each) gives every cell's per-token values exactly as all in one pass."""
    import outlierscope.eval.perplexity as E
    import outlierscope.runs.text_cells as P

    assert _run(tmp_path / "one", text, "--noise", "float64") == 0
    monkeypatch.setattr(P, "SPECS_PER_PASS", 1)
    calls, pairs = [], []
    real, real_pairs = P.score_windows, E.score_sides
    monkeypatch.setattr(P, "score_windows", lambda model, w, specs, *a, **k: calls.append(len(specs)) or
                        real(model, w, specs, *a, **k))
    monkeypatch.setattr(E, "score_sides", lambda models, w, p, *a, **k: pairs.append(len(p)) or
                        real_pairs(models, w, p, *a, **k))
    assert _run(tmp_path / "many", text, "--noise", "float64") == 0
    assert calls and set(calls) == {1} and pairs and set(pairs) == {1}
    a, b = (pd.read_csv(tmp_path / d / "p" / "perplexity.csv") for d in ("one", "many"))
    pd.testing.assert_frame_equal(a, b)
    cells = json.loads((tmp_path / "one" / "p" / "perplexity.json").read_text())["cells"].values()
    assert len(cells) > len(a)  # the noise-floor cells too
    for cell in cells:
        x, y = (TokenScores.load(tmp_path / d / "p" / "cells" / f"{cell}.npz") for d in ("one", "many"))
        for k in ("window", "nll", "nll_base", "kld", "same_top", "p_diff"):
            assert np.array_equal(getattr(x, k), getattr(y, k)), k


def test_shards_in_other_directories_merged_give_the_same_bytes(tmp_path, text, capsys):
    """--shard 0/2 and 1/2 into two directories, `outlierscope merge A B --out C`, then the command without --shard
    in C: perplexity.csv and every cell byte-identical to a single process's, nothing computed again; a merge into a
    directory holding a part with other values, or of a shard whose parts are gone, is a one-line error."""
    assert _run(tmp_path / "one", text) == 0
    for i in (0, 1):
        assert _run(tmp_path / f"s{i}", text, "--shard", f"{i}/2") == 0
        assert (tmp_path / f"s{i}" / "p" / f"perplexity.shard-{i}-of-2.json").exists()
    merged = tmp_path / "merged"
    assert main(["merge", str(tmp_path / "s0" / "p"), str(tmp_path / "s1" / "p"), "--out", str(merged)]) == 0
    capsys.readouterr()
    assert main(["perplexity", "--model", "pair-tiny:diff", "--text", str(text), "--bits", "16", "4", "--quant",
                 "kivi-2bit", "--out", str(merged), "--protocol", "gptq", "--length", "64", "--batch-size", "3"]) == 0
    said = capsys.readouterr().out
    assert "0 cells done earlier, 3 to compute" in said and "of 16 done" not in said  # all parts there: none scored
    one = tmp_path / "one" / "p"
    assert (merged / "perplexity.csv").read_bytes() == (one / "perplexity.csv").read_bytes()
    for f in (one / "cells").glob("*.npz"):
        a, b = TokenScores.load(f), TokenScores.load(merged / "cells" / f.name)
        assert all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("window", "nll", "kld", "same_top"))
    bad = tmp_path / "bad"
    part = next((tmp_path / "s0" / "p" / "cells").glob("*.part-*"))
    (bad / "cells").mkdir(parents=True)
    (bad / "cells" / part.name).write_bytes(b"other")
    assert main(["merge", str(tmp_path / "s0" / "p"), str(tmp_path / "s1" / "p"), "--out", str(bad)]) == 2
    assert "exists with other values" in capsys.readouterr().err
    assert [p.name for p in (bad / "cells").iterdir()] == [part.name]  # nothing copied
    part.unlink()
    assert main(["merge", str(tmp_path / "s0" / "p"), str(tmp_path / "s1" / "p"), "--out", str(tmp_path / "c")]) == 2
    assert "is missing" in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_a_part_swapped_for_another_cells_part_is_recomputed_or_refused(tmp_path, text, capsys):
    """Another cell's part of the same virtual shard under a part's name (a digest-valid file): `merge` of that shard's
    directory is a one-line error naming the file; the shard's run again says so in one line and computes that part
    again; merged and assembled, the table equals an untouched run's."""
    assert _run(tmp_path / "one", text) == 0
    for i in (0, 1):
        assert _run(tmp_path / f"s{i}", text, "--shard", f"{i}/2") == 0
    cells = tmp_path / "s0" / "p" / "cells"
    cids = sorted({p.name.partition(".part-")[0] for p in cells.glob("*.part-*")})
    victim = sorted(cells.glob(f"{cids[0]}.part-*"))[0]
    victim.write_bytes((cells / victim.name.replace(cids[0], cids[1])).read_bytes())
    merge = ["merge", str(tmp_path / "s0" / "p"), str(tmp_path / "s1" / "p"), "--out", str(tmp_path / "m" / "p")]
    capsys.readouterr()
    assert main(merge) == 2
    err = capsys.readouterr().err.strip()
    assert str(victim) in err and f"of cell {cids[1]}, not part" in err and "\n" not in err
    assert not (tmp_path / "m").exists()
    assert _run(tmp_path / "s0", text, "--shard", "0/2") == 0
    assert capsys.readouterr().out.count("(swapped or renamed); computing that part again") == 1
    assert main(merge) == 0
    assert _run(tmp_path / "m", text) == 0
    assert (tmp_path / "m" / "p" / "perplexity.csv").read_bytes() == (tmp_path / "one" / "p" / "perplexity.csv").read_bytes()


@pytest.mark.parametrize("damage", [lambda b: b[: len(b) // 2], lambda b: b.replace(b'"windows": ', b'"windows": 1', 1)],
                         ids=["truncated", "edited"])
def test_a_damaged_record_in_out_is_named_as_damaged(tmp_path, text, capsys, damage):
    """perplexity.json cut or edited in the run's own --out: one line saying it is damaged and that --force replaces
    the tables (not "other settings"); with --force the run writes a sound record again."""
    assert _run(tmp_path, text) == 0
    rec = tmp_path / "p" / "perplexity.json"
    rec.write_bytes(damage(rec.read_bytes()))
    capsys.readouterr()
    assert _run(tmp_path, text) == 2
    err = capsys.readouterr().err.strip()
    assert str(rec) in err and "is damaged" in err and "pass --force" in err and "other settings" not in err
    assert "\n" not in err
    assert _run(tmp_path, text, "--force") == 0
    from outlierscope.io import read_record

    assert read_record(rec, sealed_only=True)["windows"] > 0


def test_a_directory_where_a_cell_file_goes_is_one_line_before_any_work(tmp_path, text, capsys):
    """A directory standing where a cell's values go: one line naming it, exit 2, no part scored or left behind."""
    from outlierscope.runs.cells import cell_id

    assert _run(tmp_path / "one", text) == 0
    cid = json.loads((tmp_path / "one" / "p" / "perplexity.json").read_text())["cells"]["kivi-2bit"]
    assert cell_id(json.loads((tmp_path / "one" / "p" / "cells" / f"{cid}.json").read_text())["cell"]) == cid
    (tmp_path / "p" / "cells" / f"{cid}.npz").mkdir(parents=True)
    capsys.readouterr()
    assert _run(tmp_path, text) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{cid}.npz is a directory where outlierscope writes a file" in err
    assert not list((tmp_path / "p" / "cells").glob("*.part-*")) and not (tmp_path / "p" / "perplexity.json").exists()


@pytest.mark.parametrize("name", ["latin1.txt", "broken.parquet"])
def test_perplexity_with_an_unreadable_text_exits_before_loading(bad_texts, name, capsys, tmp_path):
    rc = main(["perplexity", "--model", "pair-tiny:diff", "--text", str(bad_texts / name), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and name in err
    assert not (tmp_path / "o").exists()
