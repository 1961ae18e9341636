"""compare-perplexity: two runs paired by window, against values worked by hand and the runs' own cells."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from outlierscope.analysis.kld import paired_runs
from outlierscope.cli import main
from outlierscope.errors import OutlierscopeError
from outlierscope.eval.perplexity import TokenScores


def _tokens(window, nll, nll_base, kld) -> TokenScores:
    n = len(window)
    return TokenScores(np.array(window), np.array(nll, float), np.array(nll_base, float), np.array(kld, float),
                       np.ones(n, bool), np.zeros(n))


A = _tokens([0, 0, 1, 1, 1, 2], [1.0, 2.0, 1.5, 1.0, 0.5, 3.0], [1.0, 1.5, 1.0, 1.0, 0.5, 2.0],
            [0.1, 0.2, 0.0, 0.3, 0.1, 0.5])


def test_paired_runs_by_hand():
    """Token-weighted means over the 6 tokens: a's NLL change (0 + .5 + .5 + 0 + 0 + 1) / 6 = 1/3, KLD 1.2 / 6;
    b: NLL change 2 x a's, KLD 3 x a's at every token, so every resample gives b - a = a's change and b / a = 3."""
    b = _tokens(A.window, A.nll_base + 2 * (A.nll - A.nll_base), A.nll_base, 3 * A.kld)
    s = paired_runs(A, b, seed=1)
    assert s["windows"] == 3 and s["tokens"] == 6
    assert math.isclose(s["delta_nll_a"], 1 / 3) and math.isclose(s["delta_nll_b"], 2 / 3)
    assert math.isclose(s["kld_a"], 0.2) and math.isclose(s["kld_b"], 0.6) and math.isclose(s["kld_ratio"], 3)
    assert math.isclose(s["kld_ratio_ci_low"], 3) and math.isclose(s["kld_ratio_ci_high"], 3)
    assert s["delta_nll_diff_ci_low"] <= s["delta_nll_diff"] <= s["delta_nll_diff_ci_high"]
    same = paired_runs(A, A)
    assert same["delta_nll_diff"] == 0 and same["kld_diff_ci_low"] == same["kld_diff_ci_high"] == 0
    with pytest.raises(ValueError, match="cannot be paired"):
        paired_runs(A, _tokens([0, 0, 0, 1, 1, 2], A.nll, A.nll_base, A.kld))  # other window lengths


def _perplexity(tmp_path, role, *extra):
    out = tmp_path / role
    rc = main(["perplexity", "--model", f"pair-tiny:{role}", "--text", str(tmp_path / "t.txt"), "--length", "64",
               "--max-windows", "12", "--bits", "16", "4", "--quant", "kivi-2bit", "--out", str(out), *extra])
    assert rc == 0
    return out


def test_the_pair_compared_by_window(tmp_path, capsys):
    words = [f"w{(i * 7) % 97}" for i in range(3000)]
    (tmp_path / "t.txt").write_text(" ".join(words))
    a, b = _perplexity(tmp_path, "transformer"), _perplexity(tmp_path, "diff")
    assert main(["compare-perplexity", str(a), str(b), "--out", str(tmp_path / "c")]) == 0
    table = pd.read_csv(tmp_path / "c" / "compare.csv")
    assert list(table["label"]) == ["4-bit int per_tensor", "kivi-2bit"]
    runs = {d: pd.read_csv(d / "perplexity.csv") for d in (a, b)}
    for row in table.to_dict("records"):
        for side, d in (("a", a), ("b", b)):
            r = runs[d][runs[d]["quant"] == row["quant"]].iloc[0]
            cell = TokenScores.load(d / "cells" / f"{r['cell']}.npz")
            assert math.isclose(row[f"kld_{side}"], cell.kld.mean(), rel_tol=1e-12)
            assert math.isclose(row[f"delta_nll_{side}"], (cell.nll - cell.nll_base).mean(), rel_tol=1e-9)
        assert row["kld_ratio_ci_low"] <= row["kld_ratio"] <= row["kld_ratio_ci_high"]
        assert row["moved_less"] in ("a", "b", "neither")
    rec = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert rec["a"]["settings"]["model"] == "pair-tiny:transformer" and "git_commit" in rec
    assert "a = pair-tiny:transformer, b = pair-tiny:diff" in (tmp_path / "c" / "compare.md").read_text()
    other = tmp_path / "o"
    rc = main(["perplexity", "--model", "pair-tiny:diff", "--text", str(tmp_path / "t.txt"), "--length", "32",
               "--max-windows", "12", "--bits", "4", "--out", str(other)])
    capsys.readouterr()
    assert rc == 0 and main(["compare-perplexity", str(a), str(other), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "differ in length (64 vs 32)" in err and err.count("\n") == 1 and not (tmp_path / "x").exists()
    assert main(["compare-perplexity", str(a), str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert "no perplexity.json" in capsys.readouterr().err


def test_rank_agreement_against_scipy_and_planted_orders():
    """rho is scipy's spearmanr of the schemes' mean KLD and minus their mean gold change; a gold change that orders
    the schemes as KLD does in every item gives +1 with the interval [1, 1], the reverse -1."""
    from scipy.stats import spearmanr

    from outlierscope.analysis.agreement import rank_agreement

    rng = np.random.default_rng(0)
    counts = rng.integers(50, 80, 30)  # (W,)
    kld = rng.gamma(2.0, 1.0, (30, 6)) * counts[:, None] * np.array([1, 3, 2, 9, 5, 7])  # (W, S) sums
    gold = rng.normal(0, 1, (40, 6)) - np.array([1, 2, 3, 4, 5, 6])  # (I, S): noisy harms
    r = rank_agreement(counts, kld, gold, seed=3)
    want = spearmanr(kld.sum(0) / counts.sum(), -gold.mean(0)).statistic
    assert math.isclose(r["spearman"], want, abs_tol=1e-12) and r["ci_low"] <= r["spearman"] <= r["ci_high"]
    planted = -np.tile(np.array([1, 3, 2, 9, 5, 7], float), (40, 1))  # harm exactly in KLD's order, every item
    same = rank_agreement(counts, kld * 0 + counts[:, None] * np.array([1, 3, 2, 9, 5, 7]), planted)
    assert same["spearman"] == 1 and same["ci_low"] == same["ci_high"] == 1
    assert rank_agreement(counts, counts[:, None] * np.array([1., 3, 2, 9, 5, 7]), -planted)["spearman"] == -1
    with pytest.raises(ValueError, match=">= 3 schemes"):
        rank_agreement(counts, kld[:, :2], gold[:, :2])


def test_rank_agreement_of_a_perplexity_run_and_a_sweep(tmp_path, hellaswag_cached, capsys):
    """The CLI on the pair's Diff model: the schemes both ran, rho equal to scipy's on the means read back from each
    run's own cells (KLD from the perplexity cells, gold log-likelihoods from the sweep's)."""
    from scipy.stats import spearmanr

    from outlierscope.eval.evaluate import EvalResult

    (tmp_path / "t.txt").write_text(" ".join(f"w{(i * 7) % 97}" for i in range(3000)))
    specs = ["--bits", "16", "8", "4", "--quant", "kivi-2bit", "--quant", "w4a4"]
    ppl, sweep = tmp_path / "ppl", tmp_path / "sweep"
    assert main(["perplexity", "--model", "pair-tiny:diff", "--text", str(tmp_path / "t.txt"), "--length", "64",
                 "--max-windows", "10", *specs, "--out", str(ppl)]) == 0
    assert main(["sweep", "--model", "pair-tiny:diff", *specs, "--limit", "24", "--out", str(sweep)]) == 0
    capsys.readouterr()
    assert main(["rank-agreement", str(ppl), str(sweep), "--out", str(tmp_path / "r")]) == 0
    assert "Spearman's rho over 4 schemes" in capsys.readouterr().out
    got = json.loads((tmp_path / "r" / "rank_agreement.json").read_text())
    table = pd.read_csv(ppl / "perplexity.csv").set_index("quant")
    rec = json.loads((sweep / "sweep.json").read_text())
    cells = {c.get("quant") or c["bits"]: EvalResult.load(sweep / "cells", c["cell"]) for c in rec["cells"]}
    base = cells[16].gold_loglik()
    quants = [q for q in table.index if q != "none"]
    gold = [(cells.get(q) or cells[int(q.split("int")[1].split("/")[0])]).gold_loglik().mean() - base.mean()
            for q in quants]
    kld = [TokenScores.load(ppl / "cells" / f"{table.loc[q, 'cell']}.npz").kld.mean() for q in quants]
    assert math.isclose(got["spearman"], spearmanr(kld, -np.array(gold)).statistic, abs_tol=1e-12)
    assert got["schemes"] == 4 and got["items"] == 24 and got["task"] == "hellaswag"
    import shutil

    shutil.rmtree(ppl / "cells")  # as in docs/: the tables committed, the per-token cells not
    assert main(["rank-agreement", str(ppl), str(sweep), "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err
    assert "is missing: the per-token cells" in err and "outlierscope perplexity" in err and err.count("\n") == 1
    assert not (tmp_path / "r2").exists()


def test_compare_perplexity_refuses_runs_of_different_tokenizers(tmp_path):
    from outlierscope.runs.perplexity_compare import check_pairable

    def rec(tok):
        return {"text": {"sha256": "t"}, "settings": {"protocol": "gptq"}, "length": 512, "windows": 4,
                "scored_tokens": 2044, "tokenizer": {"files_sha256": tok}}

    check_pairable(rec("a" * 64), rec("a" * 64), tmp_path / "a", tmp_path / "b")
    with pytest.raises(OutlierscopeError, match="different tokenizers"):
        check_pairable(rec("a" * 64), rec("b" * 64), tmp_path / "a", tmp_path / "b")
