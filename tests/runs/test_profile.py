"""profile with the points beyond Table 5's two: presets, act_scales.pt, tables and figures; bad points refused
before any model loads."""

import pandas as pd
import pytest
import torch

from outlierscope.cli import main


def test_smoothquant_preset_writes_act_scales(tmp_path, tiny_corpus):
    from outlierscope.models.loading import load_model

    out = tmp_path / "sq"
    rc = main(["profile", "--model", "pair-tiny:transformer", "--text", str(tiny_corpus / "val.jsonl"), "--tokens", "600",
               "--preset", "smoothquant", "--out", str(out)])
    assert rc == 0
    scales = torch.load(out / "act_scales.pt", weights_only=True)  # a plain dict of tensors, as SmoothQuant's
    model = load_model("pair-tiny:transformer").model
    linear = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert sorted(scales) == sorted(linear)
    ch = pd.read_csv(out / "channels.csv")
    for name, s in scales.items():
        assert s.dtype == torch.float32 and s.shape == (linear[name].in_features,)
        parts = name.split(".")
        point = "lm_head.input" if name == "lm_head" else ".".join(parts[3:]) + ".input"
        rows = ch[ch.point == point]
        if name != "lm_head":
            rows = rows[rows.layer == int(parts[2])]
        assert torch.equal(s, torch.tensor(rows.sort_values("channel").absmax.to_numpy(), dtype=torch.float32))
    assert not (out / "sinks.csv").exists()  # only the points asked for


def test_kv_and_sinks_presets_with_points_and_figures(tmp_path, tiny_corpus):
    from outlierscope.report.markdown import write_report

    out = tmp_path / "kv"
    rc = main(["profile", "--model", "pair-tiny:diff", "--text", str(tiny_corpus / "val.jsonl"), "--tokens", "600", "--preset", "kv",
               "--points", "layers.*.attn.probs", "--points", "layers.*.attn.probs_diff", "--sink-k", "2",
               "--out", str(out)])
    assert rc == 0
    pl = pd.read_csv(out / "per_layer.csv")
    assert set(pl.point) == {"attn.q", "attn.k", "attn.v", "attn.probs", "attn.probs_diff"}  # preset + points
    sinks = pd.read_csv(out / "sinks.csv")
    assert set(sinks.point) == {"attn.probs", "attn.probs_diff"} and (sinks.sink_k == 2).all()
    assert ((sinks.mass_first <= sinks.mass_first_k + 1e-12) | (sinks.point == "attn.probs_diff")).all()
    text = write_report(out).read_text()
    assert "## Attention sinks" in text
    for stem in ("channels_attn.k", "sinks"):
        assert (out / "figures" / f"{stem}.png").exists() and f"figures/{stem}.png" in text


@pytest.mark.parametrize("argv,msg", [
    (["--points", "layers.*.mlp.down_prj.input"], "did you mean layers.*.mlp.down_proj.input"),
    (["--sink-k", "0"], "--sink-k must be >= 1"),
    (["--attn-block", "0"], "--attn-block must be a positive number of query rows"),  # placement: checked up front
    (["--preset", "sinks", "--sink-k", "100000"], "--sink-k must be below the sequence length (256 tokens"),
    (["--seq-len", "300"], "--seq-len must be at most the model's context of 256 tokens"),
])
def test_bad_points_fail_before_any_model_loads(argv, msg, tmp_path, capsys, monkeypatch):
    import outlierscope.models.loading as loading

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the points were checked")

    monkeypatch.setattr(loading, "load_model", no_load)
    rc = main(["profile", "--model", "pair-tiny:transformer", "--model", "pair-tiny:diff", "--tokens", "100", *argv,
               "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and msg in err, err
    assert not (tmp_path / "out").exists()


def test_unknown_preset_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["profile", "--model", "pair-tiny:diff", "--preset", "kvv", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "invalid choice: 'kvv'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_profile_of_a_smoothed_model_sees_the_smoothed_inputs(tmp_path, tiny_corpus):
    """profile --quant 'smooth:0.5; calib:act_scales.pt': the q/k/v and gate/up inputs it observes are x / s, s
    SmoothQuant's factors computed here from the first profile's act_scales.pt and the weights, so their per-channel
    max is the unsmoothed one divided by s (up to the float32 rounding that smoothing moves through the layers);
    o_proj and down_proj read inputs of their own and are not smoothed. s is 1e-2..1e2 here: a wrong s fails."""
    from outlierscope.models.loading import load_model

    text = ["--model", "pair-tiny:transformer", "--text", str(tiny_corpus / "val.jsonl"), "--tokens", "600",
            "--preset", "smoothquant"]
    assert main(["profile", *text, "--out", str(tmp_path / "plain")]) == 0
    scales = torch.load(tmp_path / "plain" / "act_scales.pt", weights_only=True)
    spec = f"smooth:0.5; calib:{tmp_path / 'plain' / 'act_scales.pt'}"
    assert main(["profile", *text, "--quant", spec, "--out", str(tmp_path / "smoothed")]) == 0
    smoothed = torch.load(tmp_path / "smoothed" / "act_scales.pt", weights_only=True)
    model = load_model("pair-tiny:transformer").model
    for i, layer in enumerate(model.model.layers):
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            w = torch.stack([layer.get_submodule(p).weight.detach().abs().amax(0) for p in group]).amax(0).double()
            a = scales[f"model.layers.{i}.{group[0]}"].double()
            s = (a.clamp(min=1e-5) ** 0.5 / w.clamp(min=1e-5) ** 0.5).clamp(min=1e-5).float()
            assert (s - 1).abs().max() > 0.1  # smoothing moves these channels visibly
            for p in group:
                torch.testing.assert_close(smoothed[f"model.layers.{i}.{p}"], scales[f"model.layers.{i}.{p}"] / s,
                                           rtol=1e-4, atol=0, msg=p)
        for p in ("self_attn.o_proj", "mlp.down_proj"):
            torch.testing.assert_close(smoothed[f"model.layers.{i}.{p}"], scales[f"model.layers.{i}.{p}"], rtol=1e-4,
                                       atol=0)


@pytest.mark.parametrize("argv,expected", [
    ([], {"attn.logits", "hidden"}),  # the paper's two
    (["--preset", "kv"], {"attn.q", "attn.k", "attn.v"}),  # the preset's alone
    (["--preset", "kv", "--points", "layers.*.attn.logits", "--points", "layers.*.hidden"],  # given: added, even when
     {"attn.q", "attn.k", "attn.v", "attn.logits", "hidden"}),                             # they are the default two
    (["--preset", "kv", "--points", "layers.*.hidden"], {"attn.q", "attn.k", "attn.v", "hidden"}),
])
def test_points_given_with_a_preset_are_added_to_it(argv, expected):
    """The point kinds a profile observes, from its command line (the kv preset's are hand-listed)."""
    from outlierscope.cli import build_parser
    from outlierscope.hooks.points import resolve_points
    from outlierscope.models.loading import load_model
    from outlierscope.runs.profile import ProfileSettings
    from outlierscope.settings import from_cli

    a = build_parser().parse_args(["profile", "--model", "pair-tiny:transformer", *argv, "--out", "x"])
    s = from_cli(ProfileSettings, vars(a))
    model = load_model("pair-tiny:transformer").model
    assert {p.kind for p in resolve_points(model, s.points, s.preset)} == expected


def test_profile_model_with_a_new_preset_drops_the_default_points(tiny_corpus):
    """profile_model(..., preset=P) over default settings observes P's points alone; with points=... given too, both."""
    from outlierscope.runs.profile import ProfileSettings, _replaced

    assert _replaced(ProfileSettings(), {"preset": "kv"}).points == ()
    assert _replaced(ProfileSettings(), {"preset": "kv", "points": ("layers.*.hidden",)}).points == ("layers.*.hidden",)
    with pytest.raises(ValueError, match="points must be at least one point or pattern"):
        ProfileSettings(points=())


def test_the_profile_masks_each_map_in_place_with_the_same_statistics(monkeypatch):
    """The profile's reducers declare that they let go of each observation (``keeps_observations = False``), so the
    attention function masks each logits map in place instead of copying it; every table and every statistic is the
    same bytes as with the copy (the reducers declaring that they keep)."""
    import sys

    from outlierscope.analysis.outliers import OutlierStats
    from outlierscope.models.loading import load_model
    from outlierscope.runs.profile import profile_model

    capture_mod = sys.modules["outlierscope.hooks.capture"]  # the package exports capture, the function, by that name
    keeps, stages = [], capture_mod.attention_stages
    monkeypatch.setattr(capture_mod, "attention_stages", lambda model, stage, **kw: keeps.append(stage.keeps) or stages(model, stage, **kw))
    lm = load_model("pair-tiny:diff")
    runs = []
    for declared in (None, True):  # None: as the library declares it
        if declared is not None:
            monkeypatch.setattr(OutlierStats, "keeps_observations", declared)
        runs.append(profile_model(lm, tokens=3 * 64, seq_len=64, batch_size=2, progress=False))
    assert keeps == [False, True]
    (a, b) = runs
    assert a.tables.keys() == b.tables.keys()
    for k in a.tables:
        pd.testing.assert_frame_equal(a.tables[k], b.tables[k], check_exact=True)
    (sa,), (sb,) = a.stats.values(), b.stats.values()  # {model name: OutlierStats}
    assert torch.equal(sa.logits.hist, sb.logits.hist) and sa.logits.hist.sum() > 0
    assert torch.equal(sa.logits.moments.sums, sb.logits.moments.sums)
    assert torch.equal(sa.logits.top.values, sb.logits.top.values)
