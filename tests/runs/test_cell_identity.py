"""Every committed run under docs/ resumes with zero cells recomputed: its settings, read back through today's spec
type (:class:`~outlierscope.quant.specs.spec.QuantSpec`), name exactly the cells it recorded.

The expected identities are outside the code under test: each cell's own ``<cell>.json`` holds the settings it was
computed with (written when it ran, by the code of that day), and its file name is their digest."""

import json
from pathlib import Path

import pytest

from outlierscope.quant.specs.transforms import Linears
from outlierscope.runs.cells import cell_id

DOCS = Path(__file__).resolve().parents[2] / "docs"
SWEEPS = sorted(p.parent for p in DOCS.rglob("sweep.json") if (p.parent / "cells").is_dir())
# studies that record their cells' ids (those made before cells existed record none)
STUDIES = sorted(p.parent for p in DOCS.rglob("sensitivity.json") if "cells" in json.loads(p.read_text()))


# records whose cells of one kind predate a revision (``runs.cells.revised``), by the revision's key: GPTQ cells before
# the damping fix (#63: the mean over a contiguous copy of the Hessian's diagonal), ``rotate:`` cells before the
# two-factor rotation (#64). Those cells would be computed again (their identity lacks the revision), every other cell
# resumes; a record leaves this list when it is rerun (the test fails while a listed record is already fresh)
STALE: dict[str, str] = {}


def _id(p):
    return str(p.relative_to(DOCS))


def _stale(run_dir: Path, settings: dict) -> bool:
    """Whether ``settings`` name a cell of a listed stale record that carries the record's revision: then the recorded
    cell must be the one these settings name without it (the old arithmetic; checked by the caller), and it is not
    read back."""
    return _id(run_dir) in STALE and STALE[_id(run_dir)] in settings


def _old(run_dir: Path, settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k != STALE[_id(run_dir)]}


def _identity(run_dir: Path, cell: str) -> dict:
    """The settings a cell was computed with, as its own file recorded them."""
    return json.loads((run_dir / "cells" / f"{cell}.json").read_text())["cell"]


@pytest.mark.parametrize("run_dir", SWEEPS, ids=_id)
def test_sweep_settings_name_their_recorded_cells(run_dir):
    from outlierscope.runs.sweep import SweepSettings, cell_settings

    rec = json.loads((run_dir / "sweep.json").read_text())
    s = SweepSettings.from_record(rec["settings"])
    recorded = {c["cell"] for c in rec["cells"]}
    per_model = {}  # model -> what its cells share besides the spec (the loaded weights, dtype, device)
    for c in rec["cells"]:
        per_model.setdefault(c["model"], _identity(run_dir, c["cell"]))
    tasks = rec.get("tasks") or {s.tasks[0]: {"items_sha256": rec["items_sha256"]}}
    found, stale = set(), set()
    for model in s.models:
        shared = per_model[model]
        for task in s.tasks:
            for spec in s.specs():
                settings = cell_settings(model, shared["weights_sha256"], spec, s, tasks[task]["items_sha256"],
                                         shared["dtype"], shared.get("device", "cpu"), task)
                if _stale(run_dir, settings):
                    old = _old(run_dir, settings)
                    assert old == _identity(run_dir, cell_id(old)), f"{_id(run_dir)}: no recorded cell for {old}"
                    stale.add(cell_id(old))
                    continue
                cid = cell_id(settings)
                assert cid in recorded, f"{spec} ({model}, {task}) would be computed again: {settings}"
                assert settings == _identity(run_dir, cid)
                found.add(cid)
    assert found | stale == recorded
    assert bool(stale) == (_id(run_dir) in STALE), "a listed stale record was rerun: drop it from STALE"


def _weights_sha(model: str) -> str:
    """A bundled model's weights digest (studies recorded before model_source did not write it)."""
    from outlierscope.models.loading import load_model

    return load_model(model).weights_sha256()


def _study_specs(s, role: str, n_layers: int):
    """(spec, keep, measure) of a sensitivity role, as :mod:`outlierscope.runs.sensitivity` builds it."""

    from outlierscope.runs.sensitivity import _in_attention

    layers = list(range(n_layers))
    tag = "keep" if s.keep_bits == 16 else f"keep{s.keep_bits}"
    if role == "base":
        return None, None, s.spec() if s.attn_error and _in_attention(s.spec()) else None
    if role.startswith("only_"):
        return s.spec([int(role[5:])]), None, None
    if role.startswith("all_but_"):
        return s.spec([j for j in layers if j != int(role[8:])]), None, None
    if role.startswith("kind_"):
        return s.spec().with_part(Linears((role[5:],))), None, None
    kept = [] if role == "all" else [int(i) for i in role.removeprefix(f"{tag}_").split("_")]
    quantized = [i for i in layers if i not in kept]
    keep = s.spec(kept, bits=s.keep_bits) if kept and s.keep_bits < 16 else None
    return s.spec(quantized) if quantized else None, keep, None


@pytest.mark.parametrize("run_dir", STUDIES, ids=_id)
def test_sensitivity_settings_name_their_recorded_cells(run_dir):
    from outlierscope.eval.evaluate import items_digest, layout_for, select_items
    from outlierscope.runs.sensitivity import SensitivitySettings
    from outlierscope.runs.sensitivity_cells import cell_settings

    rec = json.loads((run_dir / "sensitivity.json").read_text())
    s = SensitivitySettings(**rec["settings"])
    if "text" in rec.get("rank_by", {}):  # a text metric's cells are perplexity cells
        return _check_text_cells(rec, s)
    if (run_dir / "cells").is_dir():  # what every cell shares, as the base cell recorded it
        base = _identity(run_dir, rec["cells"]["base"])
        ident = {k: base[k] for k in ("model", "weights_sha256", "task", "items_sha256", "dtype", "layout")}
    else:  # the study's record and its settings (the cells themselves are not committed): CPU runs, float32
        items = select_items(s.limit, s.sample, s.seed, None, s.task)
        weights = rec.get("model_source", {}).get("weights_sha256") or _weights_sha(s.model)
        ident = {"model": s.model, "weights_sha256": weights, "task": s.task,
                 "items_sha256": items_digest(items), "dtype": "float32", "layout": layout_for(s.spec())}
    stale = set()
    for role, cid in rec["cells"].items():
        settings = cell_settings(ident, *_study_specs(s, role, rec["n_layers"]), s.batch_size)
        if _stale(run_dir, settings):
            stale.add(role)
            settings = _old(run_dir, settings)
        assert cell_id(settings) == cid, f"{role} would be computed again: {settings}"
        if (run_dir / "cells").is_dir():
            assert settings == _identity(run_dir, cid)
    assert bool(stale) == (_id(run_dir) in STALE), "a listed stale record was rerun: drop it from STALE"


def _check_text_cells(rec: dict, s) -> None:
    """A study ranked by KLD or PPL names its perplexity cells by the text its record names (source digest,
    protocol, window length and count; CPU runs, float32) and each role's spec at the text batch size."""
    from outlierscope.quant.specs.spec import QuantSpec
    from outlierscope.runs.text_cells import cell_settings as text_cell_settings

    text = rec["rank_by"]
    ident = {"model": s.model, "weights_sha256": rec["model_source"]["weights_sha256"],
             "text_sha256": text["text"]["sha256"], "protocol": text["protocol"], "length": text["length"],
             "windows": text["windows"], "dtype": "float32"}
    for role, cid in rec["cells"].items():
        spec = _study_specs(s, role, rec["n_layers"])[0] or QuantSpec()
        settings = text_cell_settings(ident, spec, s.text_batch_size)
        assert cell_id(settings) == cid, f"{role} would be computed again: {settings}"


def test_every_committed_kind_is_covered():
    assert len(SWEEPS) >= 20 and len(STUDIES) >= 4
