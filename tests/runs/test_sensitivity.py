"""outlierscope sensitivity: one layer quantized at a time (checked through capture), the second pass, resume,
the greedy assignment on damage we know, and the outputs."""

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch

from outlierscope.cli import main
from outlierscope.errors import OutlierscopeError
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.specs.transforms import Linears
from outlierscope.runs.sensitivity import SensitivitySettings, greedy_keep, sensitivity


@pytest.mark.parametrize("damage, tol, keep", [
    ({0: 0.1, 1: 0.5, 2: 0.05, 3: 0.3}, 0.2, [1, 3]),   # 0.95 total: keep the two worst -> 0.15
    ({0: 0.1, 1: 0.5, 2: 0.05, 3: 0.3}, 1.0, []),       # already within
    ({0: 0.1, 1: 0.5, 2: 0.05, 3: 0.3}, 0.0, [0, 1, 2, 3]),
    ({0: 0.1, 1: 0.5, 2: 0.05, 3: 0.3}, 0.05, [0, 1, 3]),
])
def test_greedy_keep_on_known_damage(damage, tol, keep):
    order = sorted(damage, key=lambda i: -damage[i])
    got, tries = greedy_keep(order, list(range(4)), lambda q: (sum(damage[i] for i in q) <= tol, {"delta": -sum(damage[i] for i in q)}))
    assert got == keep and [t["kept"] for t in tries] == sorted(t["kept"] for t in tries)
    by_k = {t["kept"]: t for t in tries}
    assert by_k[len(keep)]["within_tolerance"] and not any(t["within_tolerance"] for k, t in by_k.items() if k < len(keep))
    assert by_k[len(keep)]["delta"] == pytest.approx(-sum(damage[i] for i in range(4) if i not in keep))


@pytest.mark.parametrize("seed", range(5))
def test_greedy_bisection_equals_the_linear_scan_in_log_tries(seed):
    """80 layers of additive damage: the same fewest k as trying k = 0, 1, 2, ... in turn, in <= 2 + 7 tries."""
    rng = np.random.default_rng(seed)
    damage = dict(enumerate(rng.exponential(0.05, 80)))
    order = sorted(damage, key=lambda i: -damage[i])
    tol = float(rng.uniform(0, sum(damage.values())))
    calls = []

    def within(q):
        calls.append(q)
        return sum(damage[i] for i in q) <= tol, {}

    got, tries = greedy_keep(order, list(range(80)), within)
    linear = next(k for k in range(81) if sum(damage[i] for i in order[k:]) <= tol)
    assert got == sorted(order[:linear]) and len(calls) == len(tries) <= 2 + 7


def _result(gold: list[float]):
    """An EvalResult of two-choice items whose gold (choice 0) log-likelihoods are ``gold`` (the other choice -5)."""
    from outlierscope.eval.evaluate import EvalResult

    n = len(gold)
    df = pd.DataFrame({"index": range(n), "label": 0, "score0": gold, "score1": -5.0, "tokens0": 1, "tokens1": 1,
                       "pred": 0, "pred_norm": 0})
    return EvalResult(df, {"acc_norm": 1.0}, {})


@pytest.mark.parametrize("delta, passes", [(+0.055, True), (+3.0, True), (0.0, True), (-0.05, True), (-0.0501, False),
                                           (-1.0, False)])
def test_greedy_criterion_is_a_loss_bound(delta, passes):
    """The suggestion's test is change >= -tolerance: any gain passes (SmolLM2's kivi-2bit greedy had rejected layer 4
    alone at +0.055 nats as if it were a loss), a loss passes up to the tolerance."""
    from types import SimpleNamespace

    from outlierscope.analysis.harm import RANK_BY
    from outlierscope.runs.sensitivity import _within, change

    base = _result([-1.0, -2.0])
    run = SimpleNamespace(s=SimpleNamespace(tolerance=0.05, keep_bits=16), layers=[0, 1], metric="acc_norm", base=base,
                          rank_by=RANK_BY["gold_ll"],
                          changes=lambda cells: [change(_result([-1.0 + delta, -2.0 + delta]), base, "acc_norm")])
    run.s.spec = lambda layers, bits=None: ("spec", tuple(layers))
    ok, rec = _within(run)([0])
    assert ok is passes and rec["delta_gold_ll"] == pytest.approx(delta)


@pytest.mark.parametrize("metric, value, passes", [("kld", 0.05, True), ("kld", 0.0501, False), ("kld", 0.0, True),
                                                   ("ppl", -0.3, True), ("ppl", 0.05, True), ("ppl", 0.0501, False)])
def test_text_metrics_bound_the_harm(metric, value, passes):
    """kld: a mean KLD of at most the tolerance passes; ppl: an ln PPL ratio of at most it (a gain always passes)."""
    from outlierscope.analysis.harm import RANK_BY

    rb = RANK_BY[metric]
    assert rb.within({rb.column: value}, 0.05) is passes
    assert rb.harm(value) == value  # larger KLD / ratio = more harm


def test_greedy_when_no_assignment_is_within():
    got, tries = greedy_keep([1, 0], [0, 1], lambda q: (False, {}))
    assert got == [0, 1] and [t["kept"] for t in tries] == [0, 2] and not tries[-1]["within_tolerance"]


def test_one_layer_spec_quantizes_exactly_that_layer():
    """Through capture (inside the quantization): only layer 1's logits sit on the 4-bit grid."""
    from outlierscope.hooks.capture import capture
    from outlierscope.models.loading import load_model
    from outlierscope.quant.apply import quantize_model

    lm = load_model("pair-tiny:transformer", device="cpu")
    s = SensitivitySettings(model="pair-tiny:transformer")
    distinct = {}

    def rec(obs):
        v = obs.x[obs.valid.expand_as(obs.x)]
        distinct[obs.point.layer] = len(v.abs().unique())

    ids = torch.randint(5, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), quantize_model(lm.model, s.spec([1])), capture(lm.model, ["layers.*.attn.logits"], reducers=[rec]):
        lm.model(input_ids=ids)
    assert distinct[1] <= 2 ** 3 and all(n > 50 for layer, n in distinct.items() if layer != 1)


def _record_figure_titles(monkeypatch) -> dict:
    """Each figure a sensitivity run saves: its stem -> its title, as drawn."""
    from outlierscope.report import markdown

    titles, save = {}, markdown.save_figure

    def recording(fig, out, stem, **kw):
        titles[stem] = fig.get_suptitle()
        return save(fig, out, stem, **kw)

    monkeypatch.setattr(markdown, "save_figure", recording)
    return titles


def test_sensitivity_run_and_resume(tiny_pair, hellaswag_cached, tmp_path, capsys, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    titles = _record_figure_titles(monkeypatch)
    out = tmp_path / "sens"
    s = SensitivitySettings(model=str(tiny_pair["diff"]), limit=6, batch_size=8, profile_tokens=512, tolerance=0.0)
    rec = sensitivity(s, out, progress=False, log=lambda *_: None)
    t = pd.read_csv(out / "sensitivity.csv")
    assert list(t["layer"]) == [0, 1] and sorted(t["rank"]) == [1, 2]
    assert {"only_delta_gold_ll", "all_but_delta_gold_ll", "kl_mean", "argmax_change_rate", "outlier_ratio"} <= set(t.columns)
    for i in (0, 1):
        assert json.loads((out / "cells" / f"{rec['cells'][f'only_{i}']}.json").read_text())["cell"]["layers"] == [i]
        assert json.loads((out / "cells" / f"{rec['cells'][f'all_but_{i}']}.json").read_text())["cell"]["layers"] == [1 - i]
    g = pd.read_csv(out / "greedy.csv")
    assert list(g["kept"]) == [0, 1, 2] and (g["within_tolerance"] == (g["delta_gold_ll"] >= 0)).all()  # a loss bound
    fewest = int(g.loc[g["within_tolerance"], "kept"].min())
    assert rec["keep"] == sorted(rec["ranking"][:fewest]) and rec["keep_bits"] == 16
    assert rec["ranking"] == t.sort_values("rank")["layer"].tolist()
    assert -1 <= rec["spearman_damage_vs_outlier_ratio"] <= 1
    harm, kl = -t["only_delta_gold_ll"], t["kl_mean"]  # two layers: +1 when the more harmed one has the larger KL
    assert rec["spearman_damage_vs_kl_mean"] == pytest.approx(1.0 if (harm[0] > harm[1]) == (kl[0] > kl[1]) else -1.0)
    assert (out / "figures" / "sensitivity.png").exists() and (out / "figures" / "damage_vs_outliers.png").exists()
    assert titles["sensitivity"] == "Per-layer sensitivity to quantized attention logits"
    assert set(pd.read_csv(out / "attn_error.csv")["layer"]) == {0, 1}
    md = (out / "sensitivity.md").read_text()
    assert f"keep layers {rec['keep']} unquantized" in md and md.count("\n| ") == 2 + 2 + 3  # two heads, two layers, three tries
    logs = []
    again = sensitivity(s, out, progress=False, log=logs.append)
    assert sum("done earlier" in m for m in logs) == 1 + 2 + 2 + 2  # base, only, all_but, greedy tries (all = 'all')
    assert again["ranking"] == rec["ranking"] and pd.read_csv(out / "sensitivity.csv").equals(t)


def test_attention_error_of_the_unquantized_cell_is_each_one_layer_cells_own(tiny_pair, hellaswag_cached, tmp_path):
    """Measured once without applying it, each layer's error equals what that layer's one-layer cell measures."""
    from outlierscope.analysis.attention_error import AttentionErrorStats, pool_heads
    from outlierscope.eval.evaluate import evaluate, select_items
    from outlierscope.models.loading import load_model

    s = SensitivitySettings(model=str(tiny_pair["transformer"]), limit=5, batch_size=4, profile_tokens=256, all_but=False)
    sensitivity(s, tmp_path, progress=False, log=lambda *_: None)
    shadow = pd.read_csv(tmp_path / "attn_error.csv")
    lm, items = load_model(s.model, device="cpu"), select_items(5, None, 0, None, "hellaswag")
    for i in (0, 1):
        st = AttentionErrorStats(2)
        evaluate(lm, quant=s.spec([i]), items=items, batch_size=s.batch_size, progress=False, attn_error=st)  # quantized
        # float32 scores are compared at the cell's batch size: another batch shape may round otherwise
        own = st.table()
        assert set(own["layer"]) == {i}
        pd.testing.assert_frame_equal(own.reset_index(drop=True), shadow[shadow["layer"] == i].reset_index(drop=True),
                                      check_exact=False, rtol=1e-12, atol=0)
    got = pd.read_csv(tmp_path / "sensitivity.csv").set_index("layer")
    pooled = pool_heads(shadow).set_index("layer")
    assert got["kl_mean"].tolist() == pytest.approx(pooled["kl_mean"].tolist(), rel=1e-12)


def test_kept_layers_at_8_bits(tiny_pair, hellaswag_cached, tmp_path):
    """keep_bits=8: the greedy's kept layers run at 8 bits (all kept = the 8-bit model), the others at 4; an
    unreachable tolerance says so; a reachable one bisects to a mixed 4/8-bit cell."""
    import matplotlib

    from outlierscope.eval.evaluate import EvalResult, evaluate, select_items
    from outlierscope.models.loading import load_model

    matplotlib.use("Agg")
    kw = dict(model=str(tiny_pair["diff"]), limit=5, batch_size=4, profile_tokens=256, keep_bits=8, all_but=False,
              attn_error=False)
    logs = []
    rec = sensitivity(SensitivitySettings(tolerance=0.0, **kw), tmp_path, progress=False, log=logs.append)
    assert rec["spearman_damage_vs_kl_mean"] is None  # no attention error measured
    g = pd.read_csv(tmp_path / "greedy.csv")
    assert list(g["kept"]) == [0, 2] and not g["within_tolerance"].any() and rec["keep"] == [0, 1]
    assert "NOT reached" in logs[-1] and "at 8 bits" in logs[-1]
    both = EvalResult.load(tmp_path / "cells", rec["cells"]["keep8_0_1"])
    lm = load_model(kw["model"], device="cpu")
    direct = evaluate(lm, quant=QuantSpec.logits(bits=8), items=select_items(5, None, 0, None, "hellaswag"),
                      batch_size=kw["batch_size"], progress=False)  # quantized float32: the cell's batch size
    np.testing.assert_array_equal(both.items[both.score_columns].to_numpy(), direct.items[direct.score_columns].to_numpy())
    d4, d8 = abs(g["delta_gold_ll"].iloc[0]), abs(g["delta_gold_ll"].iloc[1])
    assert d8 < d4
    rec = sensitivity(SensitivitySettings(tolerance=(d4 + d8) / 2, **kw), tmp_path, progress=False, log=lambda *_: None,
                      force=True)  # another tolerance: its tables replaced, the cells reused
    first = rec["ranking"][0]
    mixed = EvalResult.load(tmp_path / "cells", rec["cells"][f"keep8_{first}"])
    assert mixed.extra["cell"]["keep"] == {"quant": f"8-bit int per_tensor layers {first}", "layers": [first]}
    assert mixed.extra["cell"]["layers"] == [1 - first]
    assert list(pd.read_csv(tmp_path / "greedy.csv")["kept"]) == [0, 1, 2]


@pytest.mark.parametrize("kw, msg", [({"bits": 16}, "bits must be below 16"), ({"tolerance": -1}, "tolerance must be >= 0"),
                                     ({"quant": "none"}, "quantizes something"),
                                     ({"quant": "kivi-2bit", "bits": 8}, "bits must be its default 4 with quant"),
                                     ({"quant": "kivi-2bit", "granularity": "per_row"}, "granularity must be its default"),
                                     ({"quant": "k=int4/per_token; layers:0-1"}, "names no layers"),
                                     ({"quant": "w=bnb-nf4"}, "a spec without bitsandbytes weights"),
                                     ({"keep_bits": 4}, "keep_bits must be above bits=4"), ({"keep_bits": 17}, "bits must be in 2..16"),
                                     ({"task": "piqaa"}, "did you mean piqa"), ({"bits": 1}, "bits must be in 2..16")])
def test_settings_errors(kw, msg):
    with pytest.raises(OutlierscopeError, match=msg):
        SensitivitySettings(model="pair-tiny:diff", **kw)


def test_cli_missing_model(tmp_path, capsys):
    assert main(["sensitivity", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "model directory not found" in capsys.readouterr().err


PLANTED = {0: 0.0, 1: 6.0, 2: 0.6, 3: 2.0}  # layer -> amplitude of the corruption its "quantization" adds


def _planted_quantization(model, spec, block_rows=None, calibration=None, linear_error=None, held=None):
    """Stands in for quantize_model: 'quantizing' layer i adds PLANTED[i] * cos(1.7 * key) to its logits (a fixed
    pattern over key positions), so the harm of each layer is known in advance: 1 > 3 > 2 > 0 (0 changes nothing)."""
    from outlierscope.hooks.attention import attention_stages

    def stage(ctx, logits):
        if spec.is_identity or not spec.applies_to(ctx.layer) or PLANTED[ctx.layer] == 0:
            return logits
        keys = torch.arange(logits.shape[-1], dtype=logits.dtype)
        return logits + PLANTED[ctx.layer] * torch.cos(1.7 * keys)  # (B, H, t, S) + (S,)

    return attention_stages(model, stage, block_rows=block_rows)


def test_planted_harm_ranked_and_recomputed_from_the_cells(hellaswag_cached, tmp_path, monkeypatch):
    """A known harm per layer: ranks and signs as planted, and every number of sensitivity.csv and the greedy's
    verified change equal a numpy recomputation from the per-item cell files."""
    import matplotlib

    import outlierscope.eval.evaluate as ev
    import outlierscope.eval.together as together

    matplotlib.use("Agg")
    monkeypatch.setattr(ev, "quantize_model", _planted_quantization)
    monkeypatch.setattr(together, "quantize_model", _planted_quantization)  # only_1..3: one pass (prefix reused)
    s = SensitivitySettings(model="pair-tiny:transformer", limit=24, batch_size=8, profile_tokens=256, all_but=False,
                            attn_error=False, tolerance=0.05)
    rec = sensitivity(s, tmp_path, progress=False, log=lambda *_: None)
    t = pd.read_csv(tmp_path / "sensitivity.csv").set_index("layer")

    def cell(role):
        df = pd.read_csv(tmp_path / "cells" / f"{rec['cells'][role]}.csv")
        scores = df[[c for c in df.columns if c.startswith("score")]].to_numpy()
        return df, scores[np.arange(len(df)), df["label"].to_numpy()]

    base, base_gold = cell("base")
    for i in range(4):
        df, gold = cell(f"only_{i}")
        assert t.loc[i, "only_delta_gold_ll"] == pytest.approx((gold - base_gold).mean(), abs=1e-12)
        assert t.loc[i, "only_flip_rate"] == pytest.approx((df["pred_norm"] != base["pred_norm"]).mean())
    assert t.loc[0, "only_delta_gold_ll"] == 0  # no corruption: exactly nothing
    assert all(t.loc[i, "only_delta_gold_ll"] < 0 for i in (1, 2, 3))  # harm is negative
    assert rec["ranking"] == [1, 3, 2, 0] and t.loc[1, "rank"] == 1 and t.loc[0, "rank"] == 4
    final = rec["final"]
    kept = rec["keep"]
    assert kept == sorted(rec["ranking"][: len(kept)])  # the most harmful layers are the kept ones
    name = "all" if not kept else "keep_" + "_".join(map(str, kept))
    _, gold = cell(name) if rec["quantized"] else (None, base_gold)
    assert final["delta_gold_ll"] == pytest.approx((gold - base_gold).mean(), abs=1e-12)
    assert final["delta_gold_ll"] >= -s.tolerance and final["within_tolerance"]
    g = pd.read_csv(tmp_path / "greedy.csv")
    for _, row in g.iterrows():  # every tried assignment too
        k = [] if pd.isna(row["kept_layers"]) else [int(x) for x in str(row["kept_layers"]).split()]
        if len(k) == 4:
            continue
        _, gold = cell("all" if not k else "keep_" + "_".join(map(str, k)))
        assert row["delta_gold_ll"] == pytest.approx((gold - base_gold).mean(), abs=1e-12)


@pytest.mark.parametrize("task, granularity", [("copa", "per_head"), ("arc_easy", "per_row")])
def test_sensitivity_on_a_zero_shot_task(task, granularity, tiny_pair, tmp_path):
    """A task with another metric (COPA: acc only, 2 choices; ARC-Easy: acc_norm) and granularity: the per-layer
    changes of the headline metric and gold log-likelihood equal a recomputation from the cell files."""
    import matplotlib

    from outlierscope.data.tasks import get_task

    if not get_task(task).cached:
        pytest.skip(f"{task} not cached (make test fetches it)")
    matplotlib.use("Agg")
    s = SensitivitySettings(model=str(tiny_pair["diff"]), task=task, granularity=granularity, limit=8, batch_size=8,
                            profile_tokens=256, all_but=False, attn_error=False)
    rec = sensitivity(s, tmp_path, progress=False, log=lambda *_: None)
    metric = "acc" if task == "copa" else "acc_norm"
    assert rec["metric"] == metric and rec["settings"]["granularity"] == granularity
    t = pd.read_csv(tmp_path / "sensitivity.csv").set_index("layer")
    col = "pred" if metric == "acc" else "pred_norm"
    base = pd.read_csv(tmp_path / "cells" / f"{rec['cells']['base']}.csv")
    scores = lambda df: df[[c for c in df.columns if c.startswith("score")]].to_numpy()  # noqa: E731
    gold = lambda df: scores(df)[np.arange(len(df)), df["label"].to_numpy()]  # noqa: E731
    for i in (0, 1):
        df = pd.read_csv(tmp_path / "cells" / f"{rec['cells'][f'only_{i}']}.csv")
        assert json.loads((tmp_path / "cells" / f"{rec['cells'][f'only_{i}']}.json").read_text())["cell"]["quant"].endswith(
            f"{granularity} layers {i}")
        assert t.loc[i, "only_delta_gold_ll"] == pytest.approx((gold(df) - gold(base)).mean(), abs=1e-12)
        acc = lambda d: (d[col] == d["label"]).mean()  # noqa: E731
        assert t.loc[i, f"only_delta_{metric}"] == pytest.approx(acc(df) - acc(base), abs=1e-12)
        assert t.loc[i, "only_flip_rate"] == pytest.approx((df[col] != base[col]).mean())
    if task == "copa":
        assert scores(base).shape[1] == 2  # two choices


def test_sensitivity_with_an_attention_recipe(tiny_pair, hellaswag_cached, tmp_path, monkeypatch):
    """--quant RECIPE: each layer in turn gets the recipe (its cell equals evaluate() with the recipe on that layer
    alone), cells named by the spec text; the attention error of the recipe measured per layer."""

    from outlierscope.eval.evaluate import evaluate
    from outlierscope.models.loading import load_model
    from outlierscope.quant.specs.spec import QuantSpec

    s = SensitivitySettings(model="pair-tiny:diff", quant="kivi-2bit", limit=6, batch_size=8, profile_tokens=256,
                            all_but=False, tolerance=0.0)
    titles = _record_figure_titles(monkeypatch)
    rec = sensitivity(s, tmp_path, progress=False, log=lambda *_: None)
    lm = load_model("pair-tiny:diff")
    from outlierscope.eval.evaluate import select_items

    items = select_items(limit=6)
    for i in (0, 3):
        cell = json.loads((tmp_path / "cells" / f"{rec['cells'][f'only_{i}']}.json").read_text())["cell"]
        assert cell["quant"] == f"{QuantSpec.parse('kivi-2bit')}; layers:{i}"
        df = pd.read_csv(tmp_path / "cells" / f"{rec['cells'][f'only_{i}']}.csv")
        spec = QuantSpec.parse("kivi-2bit").with_layers((i,))
        direct = evaluate(lm, quant=spec, items=items, batch_size=s.batch_size, progress=False)  # the cell's batch size
        np.testing.assert_array_equal(df[direct.score_columns].to_numpy(), direct.items[direct.score_columns].to_numpy())
    err = pd.read_csv(tmp_path / "attn_error.csv")
    assert sorted(set(err["layer"])) == list(range(lm.model.config.num_hidden_layers)) and (err["rel_out_mean"] > 0).all()
    title = (tmp_path / "sensitivity.md").read_text().splitlines()[0]  # the recipe, not the unused logits bits
    assert title == f"# Per-layer sensitivity: pair-tiny:diff, hellaswag, kivi-2bit (`{QuantSpec.parse('kivi-2bit')}`)"
    assert titles["sensitivity"] == "Per-layer sensitivity to kivi-2bit (k=asym2/per_channel:32; v=asym2/per_group:32)"
    with pytest.raises(OutlierscopeError, match="did you mean sage1"):
        SensitivitySettings(model="pair-tiny:diff", quant="sage")
    with pytest.raises(OutlierscopeError, match="head_dim 8 is not a multiple of the group size 32"):  # before it loads
        sensitivity(SensitivitySettings(model=str(tiny_pair["diff"]), quant="kivi-2bit", limit=2), tmp_path / "x",
                    progress=False, log=lambda *_: None)


def test_a_directory_with_another_runs_tables_is_refused(tmp_path):
    """Model B's run in --out: refused before anything loads (its tables would be replaced, its cells kept), unless
    force; the same settings resume."""
    from outlierscope.runs.sensitivity import check_previous

    b = SensitivitySettings(model="pair-tiny:diff", sample=300)
    (tmp_path / "sensitivity.json").write_text(json.dumps({"settings": dataclasses.asdict(b)}))
    with pytest.raises(OutlierscopeError, match=r"holds a sensitivity run with other settings \(model differ\)"):
        sensitivity(SensitivitySettings(model="pair-tiny:transformer", sample=300), tmp_path, progress=False)
    check_previous(tmp_path, SensitivitySettings(model="pair-tiny:transformer", sample=300), force=True)
    check_previous(tmp_path, b, force=False)


def test_device_map_reaches_the_model_loader(monkeypatch, tmp_path):
    """Every command that runs a model takes --device-map (README); sensitivity passes it to load_model."""
    import outlierscope.models.loading as loading

    seen = {}

    def fake_load(spec, **kw):
        seen.update(kw)
        raise OutlierscopeError("stop here")

    monkeypatch.setattr(loading, "load_model", fake_load)
    assert main(["sensitivity", "--model", "pair-tiny:diff", "--device-map", "auto", "--out", str(tmp_path)]) == 2
    assert seen["device_map"] == "auto"


def test_sensitivity_of_a_linear_scheme_per_layer_and_kind(hellaswag_cached, tmp_path):
    """--quant w8a8: each layer in turn, then each linear kind alone in every layer (kinds.csv, most harmful first in
    the record); a kind's cell equals evaluate() with that kind's pattern; no attention error (nothing in attention
    changes)."""

    from outlierscope.eval.evaluate import evaluate, select_items
    from outlierscope.models.loading import load_model
    from outlierscope.quant.linears.sites import layer_linears
    from outlierscope.quant.specs.spec import QuantSpec

    s = SensitivitySettings(model="pair-tiny:diff", quant="w8a8", limit=6, batch_size=8, profile_tokens=256,
                            all_but=False, tolerance=0.0)
    rec = sensitivity(s, tmp_path, progress=False, log=lambda *_: None)
    lm = load_model("pair-tiny:diff")
    paths = [p for p, _ in layer_linears(lm.model)[0]]
    kinds = pd.read_csv(tmp_path / "kinds.csv")
    assert kinds["linear"].tolist() == paths and len(paths) >= 7
    assert rec["kinds"] == kinds.sort_values(["delta_gold_ll", "linear"])["linear"].tolist()
    assert not (tmp_path / "attn_error.csv").exists()
    path = paths[-1]
    df = pd.read_csv(tmp_path / "cells" / f"{rec['cells'][f'kind_{path}']}.csv")
    direct = evaluate(lm, quant=QuantSpec.parse("w8a8").with_part(Linears((path,))),
                      items=select_items(limit=6), batch_size=8, progress=False)
    np.testing.assert_array_equal(df[direct.score_columns].to_numpy(), direct.items[direct.score_columns].to_numpy())
    gold = direct.items.apply(lambda r: r[f"score{int(r['label'])}"], axis=1)
    base = pd.read_csv(tmp_path / "cells" / f"{rec['cells']['base']}.csv")
    want = float((gold - base.apply(lambda r: r[f"score{int(r['label'])}"], axis=1)).mean())
    assert kinds.set_index("linear").loc[path, "delta_gold_ll"] == pytest.approx(want, abs=1e-12)
    assert "Linear kinds, each quantized alone" in (tmp_path / "sensitivity.md").read_text()


def test_a_linear_schemes_outlier_ratio_is_its_linears_inputs(hellaswag_cached, tmp_path):
    """--quant w8a8: a layer's outlier ratio is the largest top-1 / median |x| over the inputs of the linears it
    quantizes (every decoder linear), from a profile of the same tokens (computed here from its per-layer table),
    not the attention logits'; the record names the points, sensitivity.md says what the ratio measures."""
    from outlierscope.models.loading import load_model
    from outlierscope.quant.linears.sites import layer_linears
    from outlierscope.runs.profile import ProfileSettings, profile_model

    s = SensitivitySettings(model="pair-tiny:diff", quant="w8a8", limit=4, batch_size=8, profile_tokens=256,
                            all_but=False, kinds=False, tolerance=0.0)
    rec = sensitivity(s, tmp_path, progress=False, log=lambda *_: None)
    lm = load_model("pair-tiny:diff")
    points = [f"layers.*.{p}.input" for p in sorted(p for p, _ in layer_linears(lm.model)[0])]
    assert rec["outlier_points"] == points
    pl = profile_model(lm, settings=ProfileSettings(tokens=256, points=tuple(points)), progress=False).tables["per_layer"]
    want = {layer: float((g["top1"] / g["median"]).max()) for layer, g in pl.groupby("layer")}
    got = pd.read_csv(tmp_path / "sensitivity.csv").set_index("layer")["outlier_ratio"]
    assert got.to_dict() == pytest.approx(want, rel=1e-12)
    logits = profile_model(lm, settings=ProfileSettings(tokens=256), progress=False).tables["per_layer"]
    logits = logits[logits.point == "attn.logits"].set_index("layer")
    assert not np.allclose(got.sort_index().to_numpy(), (logits["top1"] / logits["median"]).sort_index().to_numpy())
    assert "top-1/median |input| of its quantized linears" in (tmp_path / "sensitivity.md").read_text()


WORDS = [f"Passage {i}: " + " ".join(f"the {w} went to the {w}s" for w in ("cat", "dog", "fox", "owl")[: 1 + i % 4])
         * (2 + i % 5) for i in range(40)]


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "words.jsonl"
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in WORDS))
    return path


def _log_probs(spec, windows, model, memo: dict) -> list[np.ndarray]:
    """Each window's float64 log-probabilities from its own full forward (one window alone, unpadded) under
    ``spec``, kept in ``memo`` by the spec's text (the base and repeated specs are computed once per test)."""
    from outlierscope.models.float64 import float64_model
    from outlierscope.quant.apply import quantize_model

    if str(spec) not in memo:
        out = []
        for w in windows:
            ids = torch.tensor([w.input_ids])  # (1, T)
            with torch.no_grad(), quantize_model(model, spec), float64_model(model):  # float64 in every operation
                out.append(torch.log_softmax(model(input_ids=ids).logits[0].double(), -1).numpy())  # (T, V)
        memo[str(spec)] = out
    return memo[str(spec)]


def _reference(spec, windows, model, memo: dict, per_window: bool = False):
    """Mean KL(base || spec), mean NLL change and same-top share over every scored token, in float64: KL = sum_v
    p_b (ln p_b - ln p_q) written out. The base runs through the same attention function quantizing nothing (the
    model's own eager attention takes its softmax in float32: its NLL differs by up to 2e-6)."""
    kl, dnll, same = [], [], []
    for w, lb, lq in zip(windows, _log_probs(QuantSpec(), windows, model, memo), _log_probs(spec, windows, model, memo)):
        rows = np.arange(w.first, w.first + len(w.targets))
        pb = np.exp(lb[rows])
        kl.append((pb * (lb[rows] - lq[rows])).sum(-1))
        t = np.array(w.targets)
        dnll.append(lb[rows, t] - lq[rows, t])
        same.append(lb[rows].argmax(-1) == lq[rows].argmax(-1))
    if per_window:  # each window's sums of KLD and of the NLL change
        return np.array([k.sum() for k in kl]), np.array([d.sum() for d in dnll])
    return tuple(float(np.mean(np.concatenate(v))) for v in (kl, dnll, same))


@pytest.mark.parametrize("metric", ["kld", "ppl"])
def test_text_metric_ranks_layers_by_the_float64_kld_of_full_forwards(metric, words, tmp_path):
    """metric kld / ppl: every layer's change, the ranking, the greedy's verified assignment and its bound equal a
    float64 recomputation from the model's own full forwards, window by window (batch of 3 in the run); the
    per-layer cells are perplexity cells; and the markdown says what was ranked."""
    import matplotlib

    from outlierscope.eval.windows import gptq_windows
    from outlierscope.models.loading import load_model

    matplotlib.use("Agg")
    s = SensitivitySettings(model="pair-tiny:transformer", metric=metric, text=str(words), length=48, text_batch_size=3,
                            dtype="float64", profile_tokens=256, tolerance=0.02 if metric == "kld" else 0.001,
                            all_but=metric == "kld")
    rec = sensitivity(s, tmp_path, progress=False, log=lambda *_: None)
    lm = load_model("pair-tiny:transformer", dtype="float64")
    from outlierscope.data.running_text import load_text

    windows = gptq_windows(lm.tokenizer, load_text(str(words)).docs, 48)
    memo = {}
    assert rec["rank_by"]["windows"] == len(windows) >= 7 and rec["rank_by"]["scored_tokens"] == 47 * len(windows)
    t = pd.read_csv(tmp_path / "sensitivity.csv").set_index("layer")
    ref = {i: _reference(s.spec([i]), windows, lm.model, memo) for i in t.index}
    for i, (kl, dnll, same) in ref.items():
        assert t.loc[i, "only_kld_mean"] == pytest.approx(kl, rel=1e-9, abs=1e-11)
        assert t.loc[i, "only_ln_ppl_ratio"] == pytest.approx(dnll, rel=1e-9, abs=1e-11)
        assert t.loc[i, "only_same_top"] == pytest.approx(same, abs=1e-12)
        assert t.loc[i, "only_kld_ci_low"] <= kl <= t.loc[i, "only_kld_ci_high"]
        if s.all_but:
            rest = _reference(s.spec([j for j in t.index if j != i]), windows, lm.model, memo)
            assert t.loc[i, "all_but_kld_mean"] == pytest.approx(rest[0], rel=1e-9, abs=1e-11)
    key = 0 if metric == "kld" else 1
    assert rec["ranking"] == sorted(ref, key=lambda i: (-ref[i][key], i))
    assert len({round(ref[i][key], 12) for i in ref}) == len(ref)  # distinct harms: the ranking is tested
    final, kept = rec["final"], rec["keep"]
    quantized = [i for i in t.index if i not in kept]
    got = _reference(s.spec(quantized), windows, lm.model, memo) if quantized else (0.0, 0.0, 1.0)
    col = "kld_mean" if metric == "kld" else "ln_ppl_ratio"
    assert final[col] == pytest.approx(got[key], rel=1e-9, abs=1e-11) and final["within_tolerance"]
    assert got[key] <= s.tolerance
    for tr in pd.read_csv(tmp_path / "greedy.csv", keep_default_na=False).to_dict("records"):
        k = [int(x) for x in str(tr["kept_layers"]).split()]
        q = [i for i in t.index if i not in k]
        want = _reference(s.spec(q), windows, lm.model, memo)[key] if q else 0.0
        assert tr[col] == pytest.approx(want, rel=1e-9, abs=1e-11) and tr["within_tolerance"] == (want <= s.tolerance)
    assert 0 < len(kept) < len(t), "the tolerance should make the greedy keep some layers but not all"
    cell = json.loads((tmp_path / "cells" / f"{rec['cells']['only_0']}.json").read_text())
    assert cell["cell"]["protocol"] == "gptq" and cell["cell"]["quant"] == str(s.spec([0]))
    md = (tmp_path / "sensitivity.md").read_text()
    assert f"{len(windows)} gptq windows of 48 tokens" in md and "only: KLD [95% CI]" in md
    assert rec["rank_by"]["unit"] in md
    from outlierscope.analysis.agreement import ranking_stability

    sums = np.stack([_reference(s.spec([i]), windows, lm.model, memo, per_window=True)[key] for i in t.index], 1)
    want = ranking_stability(np.array([len(w.targets) for w in windows]), sums, s.seed)
    got = rec["rank_by"]["stability"]
    assert [r["windows"] for r in got] == [r["windows"] for r in want] and got[-1]["windows"] == len(windows)
    for g, w in zip(got, want):
        assert g["same_top"] == w["same_top"] and g["spearman_median"] == pytest.approx(w["spearman_median"], abs=1e-9)
    assert "How much text the ranking needs" in md
    from outlierscope.runs.sensitivity_record import written_files

    listed = {f.rstrip("/") for f in written_files(s, rec)}
    assert listed == {p.name for p in tmp_path.iterdir()} - {"cells"}  # no attention error on text


@pytest.mark.parametrize("kw, msg", [
    ({"metric": "kld", "limit": 5}, "limit must be its default None with metric='kld'"),
    ({"metric": "ppl", "task": "arc_easy"}, "task must be its default 'hellaswag' with metric='ppl'"),
    ({"metric": "kld", "keep_bits": 8}, "keep_bits must be 16 with metric='kld'"),
    ({"max_windows": 3}, "max_windows must be its default None with metric='gold_ll'"),
    ({"text_batch_size": 2}, "text_batch_size must be its default 1 with metric='gold_ll'"),
    ({"metric": "kld", "batch_size": 4}, "batch_size must be its default 32 with metric='kld'"),
    ({"metric": "kld", "text_batch_size": 0}, "text_batch_size must be >= 1"),
    ({"metric": "kld", "max_windows": 0}, "max_windows must be >= 1"),
    ({"metric": "kld", "protocol": "gptqq"}, "protocol"),
    ({"metric": "mse"}, "metric")])
def test_text_metric_settings_errors(kw, msg):
    with pytest.raises(OutlierscopeError, match=msg):
        SensitivitySettings(model="pair-tiny:diff", **kw)


def test_text_metric_refuses_a_partial_shard(tmp_path):
    from outlierscope.parallel import Shard

    s = SensitivitySettings(model="pair-tiny:diff", metric="kld")
    with pytest.raises(OutlierscopeError, match="shard: whole with metric='kld'"):
        sensitivity(s, tmp_path, shard=Shard(0, 2))
