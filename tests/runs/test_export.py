"""outlierscope export: a sweep's chosen cell and a sensitivity study's kept layers become an llm-compressor recipe and
a compressed-tensors quantization_config that select (by compressed-tensors' own matcher on the real module tree)
exactly the linears the study quantized; refusals are one line, exit 2, and leave no files."""

import json
from pathlib import Path

import pytest
import yaml

ctq = pytest.importorskip("compressed_tensors.quantization")

from outlierscope.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PAIR_SWEEP = ROOT / "docs/linear/pair/hellaswag"  # committed: the pair's eleven linear schemes


def _selected(model_dir, qconfig: dict) -> set[str]:
    """The modules compressed-tensors quantizes under ``qconfig`` in the model's real module tree."""
    from compressed_tensors.utils.match import match_named_modules

    from outlierscope.models.loading import load_model

    model = load_model(str(model_dir)).model
    targets = [t for g in qconfig["config_groups"].values() for t in g["targets"]]
    return {n for n, _ in match_named_modules(model, targets, qconfig["ignore"])}


def test_a_sweeps_cell_exported(tmp_path, capsys):
    out = tmp_path / "ex"
    assert main(["export", "--run", str(PAIR_SWEEP), "--quant", "fp8-dynamic", "--model", "pair-tiny:diff",
                 "--out", str(out)]) == 0
    q = json.loads((out / "quantization_config.json").read_text())
    back = ctq.QuantizationConfig.model_validate(q)
    assert back.format == "float-quantized" and back.ignore == ["lm_head"]
    mods = yaml.safe_load((out / "recipe.yaml").read_text())["default_stage"]["default_modifiers"]
    assert list(mods) == ["QuantizationModifier"] and mods["QuantizationModifier"]["config_groups"] == q["config_groups"]
    rec = json.loads((out / "export.json").read_text())
    assert rec["from"]["kind"] == "sweep" and rec["model_source"]["kind"] == "preset"
    assert not any("grid" in d for d in rec["differences"])  # the grid exported is the grid measured
    argv = ["export", "--model", "pair-tiny:diff", "--quant", "w8a8; smooth:0.5", "--out", str(out)]
    assert main(argv) == 2  # an export with other settings is not replaced silently
    assert "holds an export with other settings" in capsys.readouterr().err
    assert main([*argv, "--force"]) == 0
    mods = yaml.safe_load((out / "recipe.yaml").read_text())["default_stage"]["default_modifiers"]
    assert mods["SmoothQuantModifier"] == {"smoothing_strength": 0.5}
    rec = out / "export.json"
    rec.write_text(rec.read_text().replace('"w8a8', '"w4a8', 1))  # an edited record: its seal no longer matches
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(rec) in err and "is damaged: pass --force" in err and "cells" not in err


def test_a_recipe_name_whose_meaning_changed_since_the_sweep_is_refused(tmp_path, capsys):
    """A sweep recorded 'w8a8' when it was the restricted grid (its cell's text says so); today's w8a8 is the
    full-range grid, which that sweep did not measure: exporting it from that sweep is refused, not relabelled."""
    run = tmp_path / "old"
    run.mkdir()
    rec = {"settings": {"models": ["pair-tiny:diff"], "quant": ["w8a8"]},
           "cells": [{"cell": "c", "model": "pair-tiny:diff", "task": "hellaswag", "bits": 8,
                      "quant": "a=int8/per_token; w=int8/per_channel"}]}
    (run / "sweep.json").write_text(json.dumps(rec))
    assert main(["export", "--run", str(run), "--quant", "w8a8", "--out", str(tmp_path / "ex")]) == 2
    err = capsys.readouterr().err
    assert "which this sweep did not measure" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ex").exists()


@pytest.mark.parametrize("argv, msg", [
    (["--run", str(PAIR_SWEEP), "--quant", "w8a8-sq"], "one of the sweep's models"),
    (["--run", str(PAIR_SWEEP), "--quant", "w8a8-qs", "--model", "pair-tiny:diff"], "did you mean w8a8-sq"),
    (["--run", str(PAIR_SWEEP), "--quant", "w4a4-rotated", "--model", "pair-tiny:diff"], "rotate:SEED"),
    (["--run", str(PAIR_SWEEP), "--quant", "llm-int8-paper", "--model", "pair-tiny:diff"], "bitsandbytes"),
    (["--model", "smollm2-135m"], "--quant must be the scheme to export for smollm2-135m"),
    (["--run", str(PAIR_SWEEP), "--quant", "w8a8-sq", "--model", "pair-tiny:diff"], "export w=fint8/per_channel"),
    (["--model", "pair-tiny:diff", "--quant", "w=int4/per_group:64"], "export w=fint4/per_group:64"),
    (["--run", str(ROOT / "docs"), "--quant", "w8a8"], "sensitivity.json or sweep.json"),
    (["--model", "pair-tiny:diff", "--quant", "w=fint8/per_group:7"], "not a multiple of the group size 7"),
])
def test_refusals_are_one_line_and_write_nothing(argv, msg, tmp_path, capsys):
    assert main(["export", *argv, "--out", str(tmp_path / "ex")]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1
    assert not (tmp_path / "ex").exists()


def _study(tmp_path, model, quant, keep, keep_bits=16) -> Path:
    """A sensitivity record as a study writes it (only what export reads of it)."""
    d = tmp_path / "study"
    d.mkdir()
    rec = {"settings": {"model": str(model), "quant": quant}, "keep": keep, "keep_bits": keep_bits,
           "git_commit": None, "final": {}}
    (d / "sensitivity.json").write_text(json.dumps(rec))
    return d


@pytest.mark.parametrize("measured, ok", [("a=int8/per_token; w=int8/per_channel; layers:3", False),
                                           ("a=fint8/per_token; w=fint8/per_channel; layers:3", True)])
def test_a_recipe_name_whose_meaning_changed_since_the_study_is_refused(measured, ok, tmp_path, capsys):
    """A study of 'w8a8' whose one-layer cell (only_3) was computed on the restricted grid (its text, written out by
    hand) did not measure today's full-range w8a8: refused in one line, nothing written; the same study with the
    full-range cell exports."""
    study = _study(tmp_path, "pair-tiny:diff", "w8a8", [])
    rec = json.loads((study / "sensitivity.json").read_text())
    (study / "sensitivity.json").write_text(json.dumps({**rec, "cells": {"base": "b", "only_3": "c3"}}))
    (study / "cells").mkdir()
    (study / "cells" / "c3.json").write_text(json.dumps({"settings": {"quant": measured}}))
    code = main(["export", "--run", str(study), "--out", str(tmp_path / "ex")])
    err = capsys.readouterr().err.strip()
    if ok:
        assert code == 0 and (tmp_path / "ex" / "recipe.yaml").exists(), err
    else:
        assert code == 2 and "which this study did not measure" in err and len(err.splitlines()) == 1
        assert not (tmp_path / "ex").exists()


def test_a_studys_kept_layers_are_ignored(tiny_pair, tmp_path):
    """Layer 1 kept: compressed-tensors then quantizes exactly layer 0's seven linears of the 2-layer model."""
    study = _study(tmp_path, tiny_pair["transformer"], "w8a8; linears:mlp.*", [1])
    assert main(["export", "--run", str(study), "--out", str(tmp_path / "ex")]) == 0
    q = json.loads((tmp_path / "ex/quantization_config.json").read_text())
    assert q["ignore"][0] == r"re:model\.layers\.1\."
    assert _selected(tiny_pair["transformer"], q) == {f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")}


@pytest.mark.parametrize("quant, keep_bits, msg", [
    (None, 16, "quantized the attention logits"), ("w8a8", 8, "keep_bits 16"),
    ("kv=e4m3/per_tensor", 16, "applies to every layer"),
])
def test_studies_compressed_tensors_cannot_state(quant, keep_bits, msg, tiny_pair, tmp_path, capsys):
    study = _study(tmp_path, tiny_pair["diff"], quant, [0], keep_bits)
    assert main(["export", "--run", str(study), "--out", str(tmp_path / "ex")]) == 2
    assert msg in capsys.readouterr().err
