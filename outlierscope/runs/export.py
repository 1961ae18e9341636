"""A study's answer as the input of the tools that build the deployed model: an llm-compressor recipe and the
matching compressed-tensors ``quantization_config`` (``outlierscope.quant.export``).

    spec, model, keep = what the run chose      # sensitivity: its quant and the layers its greedy keeps;
                                                #   sweep: the one --quant of its cells you pick; or given directly
    check_exportable(spec)                      # one line for what compressed-tensors cannot state, before any model
    meta = the model's module tree (no weights)
    quantized = linear_sites(meta, spec on every layer but keep)
    ignore = every other nn.Linear (a layer kept whole: one re: pattern)
    write recipe.yaml, quantization_config.json, export.json (the source, the differences from the emulation)
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass
from pathlib import Path

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.hooks.points import decoder_layers
from outlierscope.io import git_commit, output_dir, read_record, versions, write_run_record, write_text
from outlierscope.models.loading import check_model, meta_model, preview_config, trust_remote_code_option
from outlierscope.quant import export as qexport
from outlierscope.quant.linears.sites import linear_sites
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.weights.calibration import check_linear_shapes
from outlierscope.runs.cells import refuse_other_settings
from outlierscope.settings import option


@dataclass(frozen=True)
class ExportSettings:
    """What to export: a run directory (a sensitivity study, or a sweep with the ``quant`` of one of its cells), or a
    ``model`` and a ``quant`` directly."""

    run: str | None = option(None, "a sensitivity or sweep output directory whose answer to export", metavar="DIR")
    model: str | None = option(None, "the model (default: the run's; a sweep of several models needs it)",
                               metavar="SPEC")
    quant: str | None = option(None, "the scheme (a sweep: one of its --quant; without a run: any linear spec)",
                               metavar="SPEC")
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self):
        if self.run is None and self.model is not None and self.quant is None:
            raise ParamError("quant", f"the scheme to export for {self.model} (a linear spec such as w8a8)", self.quant)
        if self.run is None and (self.model is None or self.quant is None):
            raise ParamError("run", "a sensitivity or sweep directory, or model and quant both given", self.run)
        if self.run is not None and not (Path(self.run) / "sensitivity.json").exists() \
                and not (Path(self.run) / "sweep.json").exists():
            raise ParamError("run", "a directory with sensitivity.json or sweep.json", self.run)


@dataclass(frozen=True)
class Choice:
    """What is exported.

    Attributes:
        spec: the spec.
        model: the model.
        keep: the decoder layers left unquantized.
        source: where it came from (the run, its cell or suggestion)."""

    spec: QuantSpec
    model: str
    keep: tuple[int, ...] = ()
    source: dict = dataclasses.field(default_factory=dict)


def _from_sensitivity(s: ExportSettings, rec: dict) -> Choice:
    st = rec["settings"]
    if st.get("quant") is None:
        raise OutlierscopeError(f"{s.run}: this study quantized the attention logits, which compressed-tensors and "
                                "llm-compressor do not quantize; export a study run with --quant (a linear scheme)")
    if s.quant is not None and QuantSpec.parse(s.quant) != QuantSpec.parse(st["quant"]):
        raise ParamError("quant", f"the study's own {st['quant']!r} (or left out)", s.quant)
    if rec.get("keep_bits", 16) != 16 and rec.get("keep"):
        raise OutlierscopeError(f"{s.run}: the kept layers run at keep_bits={rec['keep_bits']} logits, which "
                                "compressed-tensors does not quantize; export a study with keep_bits 16")
    spec = QuantSpec.parse(st["quant"])
    _check_study_measured(s.run, rec, spec)
    return Choice(spec, s.model or st["model"], tuple(rec.get("keep") or ()),
                  {"run": str(s.run), "kind": "sensitivity", "git_commit": rec.get("git_commit"),
                   "final": rec.get("final")})


def _check_study_measured(run: str, rec: dict, spec: QuantSpec) -> None:
    """The study's first one-layer cell (``only_L``, its spec text in ``cells/<id>.json``) is ``spec`` on layer L as
    parsed today: a recipe name whose meaning changed since the study ran is refused, as for sweeps. A study whose
    cells are gone cannot be checked and passes."""
    role = next((r for r in rec.get("cells") or {} if r.startswith("only_")), None)
    cell = Path(run) / "cells" / f"{rec['cells'][role]}.json" if role else None
    if cell is None or not cell.exists():
        return
    measured = read_record(cell, ("settings",), "cell record")["settings"].get("quant")
    today = str(spec.with_layers((int(role.split("_")[1]),)))
    if measured != today:
        raise OutlierscopeError(f"{run}: {rec['settings']['quant']} on layer {role.split('_')[1]} is {today} today, which "
                                f"this study did not measure (its cell: {measured}); run the study again, then export")


def _from_sweep(s: ExportSettings, rec: dict) -> Choice:
    st = rec["settings"]
    quants = st.get("quant") or []
    measured = {c["quant"] for c in rec.get("cells") or () if "quant" in c}  # the texts of what its cells computed
    spec = QuantSpec.parse(s.quant) if s.quant is not None else None
    if spec is None or str(spec) not in {str(QuantSpec.parse(q)) for q in quants} | measured:
        close = difflib.get_close_matches(s.quant or "", quants, n=3, cutoff=0.3)
        raise ParamError("quant", f"one of the sweep's quantizations ({'; '.join(map(repr, quants)) or 'none'})",
                         s.quant, f"did you mean {', '.join(close)}?" if close else "")
    models = st["models"]
    if (s.model is None and len(models) > 1) or (s.model is not None and s.model not in models):
        raise ParamError("model", f"one of the sweep's models ({', '.join(models)})", s.model)
    if measured and str(spec) not in measured:  # a recipe name whose meaning changed since the sweep ran
        raise OutlierscopeError(f"{s.run}: {s.quant} is {spec} today, which this sweep did not measure (its cells: "
                                f"{'; '.join(sorted(measured))}); run the sweep again, then export")
    return Choice(spec, s.model or models[0], (),
                  {"run": str(s.run), "kind": "sweep", "git_commit": rec.get("git_commit")})


def choose(s: ExportSettings) -> Choice:
    """The spec, model and kept layers the settings name: a run's record, or the settings themselves.

    Args:
        s: the export's settings."""
    if s.run is None:
        return Choice(QuantSpec.parse(s.quant), s.model)
    run = Path(s.run)
    if (run / "sensitivity.json").exists():
        return _from_sensitivity(s, read_record(run / "sensitivity.json", ("settings",)))
    return _from_sweep(s, read_record(run / "sweep.json", ("settings",)))


def _quantized_names(model, choice: Choice) -> set[str]:
    n, spec = len(decoder_layers(model)), choice.spec
    layers = [i for i in range(n) if spec.applies_to(i) and i not in choice.keep]
    if not layers:
        raise OutlierscopeError(f"{spec}: every layer is kept or left out; nothing to quantize")
    return {site.name for site in linear_sites(model, spec.with_layers(layers))}


def export(s: ExportSettings, out: str | Path, log=print, force: bool = False) -> Path:
    """Write ``recipe.yaml``, ``quantization_config.json`` and the sealed ``export.json`` into a directory.

    Args:
        s: the export's settings.
        out: the directory.
        log: where progress lines go.
        force: replace an earlier export with other settings.

    Returns:
        ``out``."""
    import yaml

    refuse_other_settings(Path(out) / "export.json", json.loads(json.dumps(dataclasses.asdict(s))), {}, "an export",
                          force, cells=False)
    choice = choose(s)
    qexport.check_exportable(choice.spec)
    if choice.spec.has_attention and (choice.keep or choice.spec.layers is not None):
        raise OutlierscopeError(f"{choice.spec}: a KV cache scheme applies to every layer in compressed-tensors; "
                                "export it without kept or named layers")
    if (config := preview_config(choice.model)) is not None:  # a GGUF file's metadata: before its conversion
        check_linear_shapes(choice.spec, config)
    source, config = check_model(choice.model, s.trust_remote_code)
    check_linear_shapes(choice.spec, config)
    model = meta_model(config, s.trust_remote_code)
    ignore = qexport.ignore_list(model, _quantized_names(model, choice)) if choice.spec.part("w") else []
    qconfig = qexport.quantization_config(choice.spec, ignore)
    recipe = qexport.recipe(choice.spec, ignore)
    record = {"settings": dataclasses.asdict(s), "spec": str(choice.spec), "model": choice.model,
              "model_source": source.record(), "keep": list(choice.keep), "from": choice.source,
              "differences": qexport.differences(choice.spec), "versions": versions(), "git_commit": git_commit()}
    with output_dir(out) as d:
        write_text(d / "recipe.yaml", f"# outlierscope export of {choice.spec} for {choice.model}\n"
                   + yaml.safe_dump(recipe, sort_keys=False))
        write_text(d / "quantization_config.json", json.dumps(qconfig, indent=2) + "\n")
        write_run_record(d / "export.json", record, ["recipe.yaml", "quantization_config.json"])
    log(f"{choice.spec} on {choice.model}: {len(ignore)} ignore entries"
        + (f" (kept layers {', '.join(map(str, choice.keep))})" if choice.keep else ""))
    return Path(out)
