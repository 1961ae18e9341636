"""A cell's identity gains a key where the arithmetic behind a spec's text changed (``runs.cells.revised``), so that
cells computed before are recomputed rather than read back as today's."""

import pytest

from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.runs.cells import revised


@pytest.mark.parametrize("text, expected", [
    ("w=fint4/per_group:64", {}),
    ("w=fint4/per_group:64; awq", {}),
    ("w=fint4/per_group:64; gptq", {"gptq": "contiguous-damping-mean"}),
    ("w=fint3/per_group:64; a=int8/per_token; gptq:order=desc", {"gptq": "contiguous-damping-mean"}),
    ("w=nvfp4", {"nvfp4": "compressed-tensors-order"}),
    ("w=int4/per_channel; a=int4/per_token; rotate:0", {"rotation": "input-signs", "rotate": "two-factors"}),
    ("q=e4m3/per_block:128; k=e4m3/per_block:128; v=e4m3/per_block:128; hadamard:0", {"rotation": "input-signs"}),
])
def test_revisions_name_the_changed_arithmetic(text, expected):
    assert revised(QuantSpec.parse(text)) == expected


def test_gptq_calibration_cache_is_keyed_by_the_damping_revision(tmp_path):
    """A GPTQ calibration cache written before the damping fix has another file name (never read back)."""
    import torch

    from outlierscope.models.loading import load_model
    from outlierscope.quant.linears.sites import linear_sites
    from outlierscope.quant.weights.sequential import _checkpoint_path

    model = load_model("pair-tiny:transformer").model
    spec = QuantSpec.parse("w=fint4/per_group:64; gptq")
    sites = linear_sites(model, spec)
    seqs = torch.zeros(2, 8, dtype=torch.long)
    path, key = _checkpoint_path(tmp_path, "gptq", model, seqs, spec, sites)
    rtn_path, _ = _checkpoint_path(tmp_path, "awq", model, seqs, spec, sites)
    assert path.name.startswith("gptq-") and path != rtn_path
    import hashlib
    h = hashlib.sha256()
    cfg = model.config
    h.update(f"gptq|{spec.part('w')}|{spec.gptq}|{spec.awq}|contiguous-damping-mean|{cfg._name_or_path}|"
             f"{next(model.parameters()).dtype}|".encode())
    h.update("|".join(s.name for s in sites).encode())
    h.update(seqs.numpy().tobytes())
    assert key == h.hexdigest()
