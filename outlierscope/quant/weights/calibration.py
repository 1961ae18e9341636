"""What a linear spec's calibration reads and computes: SmoothQuant's and static activation scales (a calibration
pass over text, or a SmoothQuant ``act_scales.pt``), GPTQ's and AWQ's layer-by-layer calibration
(``gptq_model``, ``awq_model``), the record of what
it read, and every check of a spec against a model made before the first forward (``check_linear_shapes``,
``check_calibration``)."""

from __future__ import annotations

import difflib
from pathlib import Path

import torch
from torch import nn

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.points import decoder_layers
from outlierscope.models.float64 import float64_model
from outlierscope.quant.linears.ops import (
    _base_order,
)
from outlierscope.quant.linears.sites import (
    CALIB_SEQ_LEN,
    CALIB_TOKENS,
    Calibration,
    LinearSite,
    _max_positions,
    _recording,
    input_groups,
    linear_sites,
    needs_calibration,
)
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.specs.transforms import Rotate


@torch.no_grad()
def calibrate(model: nn.Module, tokenizer, spec: QuantSpec, checkpoint_dir=None) -> Calibration:
    """The calibration a spec needs: each quantized linear's input per-channel max |x| and the groups reading one input.

    The max |x| comes from ``CALIB_TOKENS`` tokens of ``spec.calib`` (``hellaswag``: the validation contexts with
    their gold endings; or a .txt/.jsonl file) packed into sequences of ``CALIB_SEQ_LEN``, or from a SmoothQuant
    ``act_scales.pt``. GPTQ and AWQ calibrate layer after layer.

    Args:
        model: the model.
        tokenizer: its tokenizer.
        spec: the spec.
        checkpoint_dir: GPTQ/AWQ: each finished layer is saved there and a rerun continues after it; None: not kept."""
    from outlierscope.data.text import pack_sequences, text_documents

    sites = linear_sites(model, spec)
    if spec.gptq is not None or spec.awq is not None:
        return _layerwise_calibration(model, tokenizer, spec, sites, checkpoint_dir)
    source = spec.calib or "hellaswag"
    if source.endswith(".pt"):
        return Calibration(_read_act_scales(source, sites), input_groups(model, sites), source)
    if source != "hellaswag" and not Path(source).is_file():
        raise OutlierscopeError(f"calib:{source}: no such file; give hellaswag, a .txt/.jsonl file or an act_scales.pt")
    ctx = _max_positions(model) or CALIB_SEQ_LEN
    seqs = pack_sequences(tokenizer, text_documents(source), min(CALIB_SEQ_LEN, ctx), CALIB_TOKENS)  # (N, T)
    act_max: dict = {}
    dev = next(model.parameters()).device
    with _recording(sites, act_max, None), float64_model(model):
        for row in seqs:
            model(input_ids=row[None].to(dev), use_cache=False)
    return Calibration(act_max, input_groups(model, sites), source)


def _layerwise_calibration(model: nn.Module, tokenizer, spec: QuantSpec, sites: list[LinearSite],
                           checkpoint_dir=None) -> Calibration:
    """GPTQ's rounded weights or AWQ's scales and clipping bounds of the quantized linears ``sites``, calibrated layer
    after layer on ``samples`` sequences of ``spec.calib`` (default: LAMBADA's last passages)
    (``gptq_model``, ``awq_model``)."""
    from outlierscope.quant.weights.sequential import DEFAULT_CALIB, calibration_sequences

    ctx = _max_positions(model)
    cfg, run = _layerwise_method(spec)
    seqs = calibration_sequences(tokenizer, spec.calib, cfg, ctx)  # (N, T)
    return Calibration({}, (), spec.calib or DEFAULT_CALIB, run(model, seqs, spec, sites, checkpoint_dir=checkpoint_dir))


def _layerwise_method(spec: QuantSpec):
    """(settings, the pass) of a spec's layer-by-layer calibration: GPTQ's or AWQ's."""
    from outlierscope.quant.weights.awq_model import awq_model
    from outlierscope.quant.weights.gptq_model import gptq_model

    return (spec.gptq, gptq_model) if spec.gptq is not None else (spec.awq, awq_model)


def calibrate_layers_alone(model: nn.Module, tokenizer, spec, layers, checkpoint_dir, progress: bool = True) -> None:
    """The GPTQ / AWQ calibration of a spec restricted to each layer in turn, all in one pass (L layers, not L^2 / 2).

    For a study that quantizes one layer at a time (sensitivity's ``only_i`` cells): each layer on the outputs of the
    float layers below it, as ``layers:i`` alone calibrates it, saved where ``calibrate`` of each ``layers:i`` spec
    finds it. Nothing for a spec without GPTQ or AWQ.

    Args:
        model: the model.
        tokenizer: its tokenizer.
        spec: the spec.
        layers: the layers.
        checkpoint_dir: where each layer's calibration is saved.
        progress: show a progress bar."""
    from outlierscope.quant.weights.sequential import calibration_sequences

    spec = QuantSpec.of(spec)
    if not spec.has_linear or (spec.gptq is None and spec.awq is None):
        return
    cfg, run = _layerwise_method(spec)
    sites = [s for s in linear_sites(model, spec.with_layers(None)) if s.layer in set(layers)]
    seqs = calibration_sequences(tokenizer, spec.calib, cfg, _max_positions(model))  # (N, T)
    run(model, seqs, spec, sites, progress=progress, checkpoint_dir=checkpoint_dir, alone=True)


def calibration_record(spec, tokenizer, ctx: int | None = None) -> dict | None:
    """What a spec's calibration reads, for a run's record.

    The source as given (or its default) and the sha256 of its bytes, and for GPTQ and AWQ the sequences packed from
    it: samples, seqlen, tokens and the sha256 of the token ids, which name the calibration exactly.

    Args:
        spec: the spec.
        tokenizer: the model's tokenizer.
        ctx: the model's context length; None: none.

    Returns:
        The record; None for a spec that reads nothing."""
    import hashlib

    from outlierscope.io import sha256_file
    from outlierscope.quant.weights.sequential import DEFAULT_CALIB, calibration_sequences

    spec = QuantSpec.of(spec)
    if not spec.has_linear or not needs_calibration(spec):
        return None
    layerwise = spec.gptq is not None or spec.awq is not None
    source = spec.calib or (DEFAULT_CALIB if layerwise else "hellaswag")
    rec: dict = {"source": source}
    if source == DEFAULT_CALIB:
        from outlierscope.data.running_text import load_text

        rec["sha256"] = load_text("lambada").sha256
    elif Path(source).is_file():
        rec["sha256"] = sha256_file(source)
    if layerwise:
        cfg = spec.gptq if spec.gptq is not None else spec.awq
        seqs = calibration_sequences(tokenizer, spec.calib, cfg, ctx)  # (N, T)
        rec.update(samples=int(seqs.shape[0]), seqlen=int(seqs.shape[1]), tokens=int(seqs.numel()),
                   tokens_sha256=hashlib.sha256(seqs.cpu().numpy().tobytes()).hexdigest())
    return rec


def calibration_records(specs, model: nn.Module, tokenizer) -> dict:
    """``calibration_record`` of each spec that calibrates, for a run's record.

    Args:
        specs: the specs.
        model: the model (its context length).
        tokenizer: its tokenizer.

    Returns:
        Spec label -> its record."""
    ctx = _max_positions(model)
    recs = {QuantSpec.of(spec).label: calibration_record(spec, tokenizer, ctx) for spec in specs}
    return {k: v for k, v in recs.items() if v is not None}


def calibration_for(model: nn.Module, tokenizer, spec, checkpoint_dir=None) -> Calibration | None:
    """What ``quantize_model`` needs besides a spec: the calibration of a spec with SmoothQuant or static scales.

    The ``linears`` patterns are checked first, before any forward; every process computes the same.

    Args:
        model: the model to calibrate.
        tokenizer: its tokenizer (the calibration text is tokenized with it).
        spec: a ``QuantSpec``, its text or a recipe name.
        checkpoint_dir: GPTQ/AWQ: each calibrated layer is saved there and a rerun continues; None: not kept.

    Returns:
        The ``Calibration``; None when the spec needs none."""
    spec = QuantSpec.of(spec)
    if not spec.has_linear:
        return None
    linear_sites(model, spec)
    return calibrate(model, tokenizer, spec, checkpoint_dir) if needs_calibration(spec) else None


def _read_act_scales(path: str, sites: list[LinearSite]) -> dict[str, torch.Tensor]:
    if not Path(path).is_file():
        raise OutlierscopeError(f"calib:{path}: no such file; give an act_scales.pt (profile --preset smoothquant)")
    try:
        scales = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types for a cut or foreign file
        raise OutlierscopeError(f"calib:{path}: not a readable torch file ({type(e).__name__}); give SmoothQuant's "
                                "act_scales.pt (profile --preset smoothquant writes one)") from None
    if not isinstance(scales, dict):
        raise OutlierscopeError(f"calib:{path}: expected SmoothQuant's act_scales.pt (module name -> per-channel "
                                f"max |x|), got a {type(scales).__name__}")
    out = {}
    for s in sites:
        a = scales.get(s.name)
        if a is None or tuple(a.shape) != (s.module.in_features,):
            close = difflib.get_close_matches(s.name, list(scales), n=1)
            raise OutlierscopeError(f"calib:{path} has no scales of {s.name} ({s.module.in_features} channels)"
                                    + (f"; it has {close[0]}" if close and a is None else
                                       f", got shape {tuple(a.shape)}" if a is not None else ""))
        if not torch.isfinite(a).all() or (a < 0).any() or not (a > 0).any():
            raise OutlierscopeError(f"calib:{path}: the scales of {s.name} are "
                                    + ("not all finite" if not torch.isfinite(a).all() else "negative somewhere"
                                       if (a < 0).any() else "all zero")
                                    + "; expected max |x| per channel (>= 0, some > 0): make it again")
        out[s.name] = a.float()
    return out


def check_linear_shapes(spec: QuantSpec, config) -> None:
    """Check what a spec's linear parts need of a model, from its config alone (a meta model).

    ``linears`` patterns that match, ``layers`` it has, group sizes dividing each quantized linear's in_features, a
    rotation of each in_features, and the ``calib:`` source. A config transformers cannot build is left to the first
    forward.

    Args:
        spec: the spec.
        config: the model's config."""
    from outlierscope.models.quiet import quiet_transformers

    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"), quiet_transformers():
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # custom code, an architecture without a causal-LM class: checked when the model is loaded
        return
    if spec.layers is not None and max(spec.layers) >= len(decoder_layers(model)):
        return  # check_layers says it
    for site in linear_sites(model, spec):
        d = site.module.in_features
        for p in (spec.part("a"), spec.part("w")):
            if p is not None and p.granularity == "per_group" and d % p.size:
                raise OutlierscopeError(f"{p}: {site.path} has {d} inputs, not a multiple of the group size {p.size}; "
                                        "choose a group size that divides it, or leave it out with linears:")
        if spec.get(Rotate) is not None:
            _base_order(d)
    check_calibration(spec, model)


def check_calibration(spec: QuantSpec, model: nn.Module) -> None:
    """Read ``calib:`` before any forward (a mistake found after the 16-bit cell is a defect).

    A text file that exists and holds text; an ``act_scales.pt`` that loads, with finite, non-negative scales of each
    quantized linear's shape, not all zero for any (every smoothing factor would be 1: plain W8A8 under the
    SmoothQuant label).

    Args:
        spec: the spec.
        model: the model (a meta model will do)."""
    if not needs_calibration(spec):
        return
    if (spec.gptq is not None or spec.awq is not None) and spec.calib is None:
        from outlierscope.data.running_text import lambada_path

        if not lambada_path().exists():
            raise OutlierscopeError(f"{'gptq' if spec.gptq else 'awq'} calibrates on LAMBADA's last passages by "
                                    "default, not fetched yet; run `outlierscope data fetch`, or give calib:FILE")
        return
    source = spec.calib or "hellaswag"
    if source.endswith(".pt"):
        _read_act_scales(source, linear_sites(model, spec))
    elif source != "hellaswag":
        _check_text(source)


def _check_text(source: str) -> None:
    from outlierscope.data.text import text_documents

    path = Path(source)
    if not path.is_file():
        raise OutlierscopeError(f"calib:{source}: " + ("a directory" if path.is_dir() else "no such file")
                                + "; give hellaswag, a .txt/.jsonl file or an act_scales.pt")
    try:
        first = next((d for d in text_documents(source) if d.strip()), None)
    except (UnicodeDecodeError, ValueError, OSError, EOFError) as e:
        raise OutlierscopeError(f"calib:{source}: not readable as text ({type(e).__name__}); give a UTF-8 .txt or "
                                ".jsonl file") from None
    if first is None:
        raise OutlierscopeError(f"calib:{source}: holds no text; give a .txt/.jsonl file with documents")
