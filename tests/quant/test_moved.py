"""Version 0.2 removed the old module paths of quant/ and the names before one spec type (CHANGELOG.md lists each with
its replacement): importing one fails, and the package root holds the names a notebook needs."""

import importlib

import pytest

import outlierscope

OLD_PATHS = ("names", "primitives", "formats", "spec", "parts", "recipes", "recipe", "config_fields", "ops", "logits",
             "linear_ops", "linear", "gptq", "awq", "gptq_model", "awq_model", "sequential", "_moved")  # quant.<old>
OLD_NAMES = {"outlierscope": ("AttnQuant", "quantize_attention", "quantize_weights", "as_attn_quant", "POINT_PRESETS"),
             "outlierscope.quant": ("AttnQuant", "quantize_attention", "quantize_weights"),
             "outlierscope.quant.apply": ("as_attn_quant", "quantize_attention"),
             "outlierscope.hooks.points": ("POINT_PRESETS",)}


@pytest.mark.parametrize("old", OLD_PATHS)
def test_an_old_path_no_longer_imports(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"outlierscope.quant.{old}")


def test_the_old_names_are_gone():
    for module, names in OLD_NAMES.items():
        for name in names:
            assert not hasattr(importlib.import_module(module), name), f"{module}.{name}"


def test_the_root_holds_what_a_notebook_needs():
    assert 20 <= len(outlierscope.__all__) <= 30
    for name in ("load_model", "capture", "OutlierStats", "QuantSpec", "quantize_model", "evaluate", "sweep", "load_run",
                 "plots"):
        assert name in outlierscope.__all__ and getattr(outlierscope, name) is not None
    with pytest.raises(AttributeError, match="did you mean load_model"):
        outlierscope.load_modle  # noqa: B018
