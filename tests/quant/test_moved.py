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


def test_nothing_in_the_repository_imports_an_old_path():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    old = "|".join(p for p in OLD_PATHS if not p.startswith("_"))
    pattern = re.compile(rf"from outlierscope\.quant import ({old})\b|outlierscope\.quant\.({old})\b(?!\.)")
    users = [f"{p.relative_to(root)}:{n}" for folder in ("outlierscope", "tests", "bench", "references", "notebooks")
             for p in (root / folder).rglob("*.py") for n, line in enumerate(p.read_text().splitlines(), 1)
             if pattern.search(line) and p.name != "test_moved.py"]
    assert not users, users
