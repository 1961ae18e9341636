"""compare-perplexity: two runs paired by window, against values worked by hand and the runs' own cells."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from outlierscope.analysis.kld import paired_runs
from outlierscope.cli import main
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
