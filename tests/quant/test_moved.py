"""The old module paths of quant/ (before its sub-packages) still import, for one release: each is the moved module
itself (its names, private ones and patches included) and warns once, at the user's import line, naming the new path."""

import importlib
import sys
import warnings

import pytest

import outlierscope.quant as quant

# old path -> new path, written out here (not read from the shims)
MOVED = {
    "names": "numerics.names", "primitives": "numerics.primitives", "formats": "numerics.formats",
    "spec": "specs.spec", "parts": "specs.parts", "recipes": "specs.recipes", "recipe": "specs.recipe",
    "config_fields": "specs.config_fields",
    "ops": "attention.ops", "logits": "attention.logits", "linear_ops": "linears.ops",
    "gptq": "weights.gptq", "awq": "weights.awq", "gptq_model": "weights.gptq_model",
    "awq_model": "weights.awq_model", "sequential": "weights.sequential",
}


def _fresh_import(name: str):
    """Import ``name`` as a first import would (forgetting an earlier one), recording its warnings."""
    sys.modules.pop(name, None)
    parent, _, leaf = name.rpartition(".")
    if hasattr(sys.modules[parent], leaf):
        delattr(sys.modules[parent], leaf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_moved_module(old):
    new = importlib.import_module(f"outlierscope.quant.{MOVED[old]}")
    module, caught = _fresh_import(f"outlierscope.quant.{old}")
    assert module is new
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert f"outlierscope.quant.{MOVED[old]}" in str(caught[0].message)
    assert "0.2" in str(caught[0].message)


def test_old_path_warns_at_the_importers_line():
    """``import outlierscope.quant.spec`` in user code: the warning names the user's file (shown by Python's default
    filters, which hide DeprecationWarnings raised inside a library)."""
    sys.modules.pop("outlierscope.quant.spec", None)
    if hasattr(quant, "spec"):
        delattr(quant, "spec")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import outlierscope.quant.spec  # noqa: F401
    assert [w.filename for w in caught] == [__file__]


def test_old_linear_module_resolves_its_public_names():
    """quant/linear.py was split in three: its public names resolve from the old path to the same objects."""
    from outlierscope.quant.linears import schemes, sites
    from outlierscope.quant.weights import calibration
    module, caught = _fresh_import("outlierscope.quant.linear")
    assert len(caught) == 1 and caught[0].filename == __file__
    assert module.quantize_linears is schemes.quantize_linears
    assert module.LinearSite is sites.LinearSite and module.linear_sites is sites.linear_sites
    assert module.calibrate is calibration.calibrate and module.check_calibration is calibration.check_calibration


def test_public_face_unchanged():
    """Every public name of ``outlierscope`` and ``outlierscope.quant`` (what the README and the guide import) resolves
    without a warning."""
    import outlierscope
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from outlierscope import QuantSpec, quantize_model  # noqa: F401
        for package in (outlierscope, quant):
            for name in package.__all__:
                assert getattr(package, name) is not None
