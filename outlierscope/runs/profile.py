"""Profile activation outliers (Table 5 and finer): ``profile_model`` for a model in memory, ``profile`` for specs.

    from outlierscope import load_model, profile_model
    res = profile_model(load_model("pair-tiny:diff"), tokens=20_000)
    res.table5                       # tidy DataFrame; res.tables has every table, res.stats the reducers
    res.save("runs/diff")            # table5.csv, per_layer.csv, ..., profile.json (settings, versions)
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from outlierscope.analysis.outliers import MASSIVE_ABS, MASSIVE_REL, OutlierStats
from outlierscope.data.text import delimiter_ids, pack_sequences, shuffled, text_documents
from outlierscope.errors import OutlierscopeError, ParamError, check_seed
from outlierscope.hooks.attention import diff_lambda
from outlierscope.hooks.capture import capture
from outlierscope.hooks.points import DEFAULT_POINTS, PRESETS, decoder_layers, resolve_points
from outlierscope.io import (
    output_dir,
    peak_rss_mb,
    read_torch_record,
)
from outlierscope.models.float64 import float64_model
from outlierscope.models.loading import (
    LoadedModel,
    attn_block_option,
    check_placement,
    device_map_option,
    device_option,
    dtype_option,
    model_device,
    model_dtype,
    resolve_seq_len,
    state_dict_sha256,
    trust_remote_code_option,
)
from outlierscope.parallel import Shard, World, find_shards, owned_shards, shard_of
from outlierscope.runs.profile_result import ProfileResult
from outlierscope.settings import option


@dataclass(frozen=True)
class ProfileSettings:
    """Settings of a profile (``outlierscope profile``): what is streamed through which points of which models. Each
    field is a CLI flag of the same name (its help is the field's ``option`` text) and is written to the run's
    record."""

    tokens: int = option(400_000, "tokens to stream per model (the paper: 400000)")
    text: str = option("hellaswag", "hellaswag (validation contexts + gold endings) or a .txt/.jsonl(.xz) file")
    seq_len: int | None = option(None, "tokens per packed sequence (default: min(model context, 256))")
    batch_size: int = option(8, "sequences per forward; the statistics do not depend on it")
    seed: int = option(0, "seeds the document order")
    k: int = option(100, "largest values kept with their locations (>= 100)", flag="--top-k")
    points: tuple[str, ...] | None = option(None, "observation points or patterns (layers.*.attn.k, "
                                            "layers.*.mlp.down_proj.input, lm_head.input); repeat (default: "
                                            f"{' and '.join(DEFAULT_POINTS)}; none with --preset)", flag="--points",
                                            repeat=True, metavar="POINT")
    preset: str | None = option(None, "a named set of points instead of the default two (with --points: added to "
                                "them): " + "; ".join(f"{p.name}: {p.help}" for p in PRESETS.values()),
                                choices=tuple(PRESETS))
    sink_k: int = option(4, "key positions counted as the attention sink (from 0), for attn.probs points")
    massive_abs: float = option(MASSIVE_ABS, "massive activations: |x| above this (Sun et al. 2024: 100) ...")
    massive_rel: float = option(MASSIVE_REL, "... and above this many times the layer's median |x| (Sun et al.: 1000)")
    quant: str | None = option(None, "profile the model quantized by this recipe or spec (see `outlierscope recipes`; "
                               "e.g. w8a8-sq: what the quantized linears and attention see)", metavar="RECIPE_OR_SPEC")
    compile: bool = option(True, "run the statistics' per-element passes uncompiled (torch.compile fuses them into one "
                           "loop; the statistics are the same, moments within float32 rounding)", flag="--no-compile")
    dtype: str = dtype_option()
    device: str = device_option()
    device_map: str | None = device_map_option()
    attn_block: int | None = attn_block_option()
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self):
        check_seed(self.seed)
        # not given: the default two, or none besides a preset's (given, even as the default two: added to it)
        object.__setattr__(self, "points", default_points(self.preset) if self.points is None else tuple(self.points))
        for name in ("tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ParamError(name, ">= 1", getattr(self, name))
        if self.seq_len is not None and self.seq_len < 1:
            raise ParamError("seq_len", ">= 1 (or None for the default)", self.seq_len)
        if self.sink_k < 1:
            raise ParamError("sink_k", ">= 1 key positions", self.sink_k)
        for name in ("massive_abs", "massive_rel"):
            if not getattr(self, name) >= 0:
                raise ParamError(name, "a threshold >= 0", getattr(self, name))
        if self.preset is not None and self.preset not in PRESETS:
            raise ParamError("preset", f"one of {', '.join(PRESETS)}", self.preset)
        if not self.points and self.preset is None:
            raise ParamError("points", "at least one point or pattern (or a preset)", self.points)
        if self.quant is not None:
            from outlierscope.quant.specs.spec import QuantSpec

            QuantSpec.parse(self.quant)  # a bad spec: before anything loads
        check_placement(self.device, self.dtype, self.device_map, self.attn_block)

    def stats_options(self) -> dict:
        return {"k": self.k, "sink_k": self.sink_k, "massive_abs": self.massive_abs, "massive_rel": self.massive_rel,
                "compile": self.compile}


def default_points(preset: str | None) -> tuple[str, ...]:
    """The points profiled when none are given: the paper's two, or none besides a preset's.

    Args:
        preset: the preset given, or None."""
    return DEFAULT_POINTS if preset is None else ()


def _replaced(settings: ProfileSettings, overrides: dict) -> ProfileSettings:
    """``settings`` with ``overrides``; a new preset without points replaces the default points it had."""
    if "preset" in overrides and "points" not in overrides and settings.points == default_points(settings.preset):
        overrides = {**overrides, "points": None}
    return dataclasses.replace(settings, **overrides)


def _quantized(module, tokenizer, quant: str | None, attn_block: int | None):
    """The model quantized by ``quant`` (with its calibration pass, if it needs one), or as it is for None."""
    import contextlib

    if quant is None:
        return contextlib.nullcontext()
    from outlierscope.quant.apply import quantize_model
    from outlierscope.quant.specs.spec import QuantSpec
    from outlierscope.quant.weights.calibration import calibration_for

    spec = QuantSpec.parse(quant)
    return quantize_model(module, spec, attn_block, calibration_for(module, tokenizer, spec))


@torch.no_grad()
def diff_lambdas(model) -> list[tuple[float, float]]:
    """``(lambda_init, lambda_full)`` per layer of a DiffLlama model, as its forward computes lambda.

    Args:
        model: the model (not DiffLlama: empty)."""
    out = []
    for layer in decoder_layers(model):
        a = getattr(layer, "self_attn", None)
        if a is None or not hasattr(a, "lambda_q1"):
            return []
        out.append((float(a.lambda_init), float(diff_lambda(a))))
    return out


@torch.no_grad()
def profile_model(model, tokenizer=None, settings: ProfileSettings | None = None, *, name: str | None = None,
                  progress: bool = True, shard: Shard | None = None, world: World | None = None,
                  **overrides) -> ProfileResult | None:
    """Stream text through a model and return its outlier statistics, exactly mergeable over processes.

    Batch ``b`` belongs to virtual shard ``b % 16``; any split over processes or ``--shard`` jobs gives the bytes of
    one process (see the GPUs guide).

    Args:
        model: a ``LoadedModel``, or a module (with ``tokenizer``).
        tokenizer: the module's tokenizer; None with a ``LoadedModel``.
        settings: the profile's settings; None: ``ProfileSettings()``.
        name: the model's name in the result; None: the model's spec or class.
        progress: show a progress bar.
        shard: stream only this share of the virtual shards and return its part (``merge_profile`` joins parts).
        world: the ``torchrun`` processes; rank 0 gets the merged statistics.
        **overrides: fields of ``settings`` to replace (``tokens=20_000``).

    Returns:
        The ``ProfileResult``; None on ranks other than 0."""
    from tqdm.auto import tqdm

    try:
        settings = _replaced(settings or ProfileSettings(), overrides)
    except TypeError as e:
        raise OutlierscopeError(f"profile_model: {e}; valid settings: {', '.join(f.name for f in dataclasses.fields(ProfileSettings))}") from None
    if isinstance(model, LoadedModel):
        lm = model
        module, tokenizer = lm.model, tokenizer or lm.tokenizer
        name = name or lm.name
        facts = {"spec": lm.spec, "path": str(lm.path), **({"source": lm.source.record()} if lm.source else {}),
                 **({"quantization_config": q} if (q := lm.quantization_config()) else {}),
                 **({"packed_weights": lm.decoded} if lm.decoded else {})}  # as LoadedModel.provenance says it
        digest = lm.weights_sha256
    else:
        if tokenizer is None:
            raise ParamError("tokenizer", "a tokenizer when model is a bare torch module", None)
        module, name = model, name or type(model).__name__
        facts = {"spec": None, "path": None}
        digest = lambda: state_dict_sha256(module)  # noqa: E731 (hashed on save only)
    seq_len = resolve_seq_len(module, settings.seq_len)
    seqs = pack_sequences(tokenizer, shuffled(text_documents(settings.text), settings.seed), seq_len, settings.tokens)
    stats = OutlierStats.for_model(module, seq_len, **settings.stats_options(), delimiters=delimiter_ids(tokenizer))
    dev = model_device(module)
    n_tok = seqs.numel()
    shard, world = shard or Shard(), world or World()
    own = set(owned_shards(shard, world))
    starts = [i for b, i in enumerate(range(0, len(seqs), settings.batch_size)) if shard_of(b) in own]
    t0 = time.time()
    with tqdm(total=sum(min(settings.batch_size, len(seqs) - i) * seq_len for i in starts), desc=f"profile {name}",
              unit="tok", unit_scale=True, disable=not progress or not world.is_main or None) as bar:
        # quantized outside the capture: the capture observes what the quantized model computes
        with world.failing_together(), _quantized(module, tokenizer, settings.quant, settings.attn_block), \
                capture(module, list(settings.points), reducers=[stats], block_rows=settings.attn_block,
                        preset=settings.preset) as cap, float64_model(module):
            for i in starts:
                stats.set_shard(shard_of(i // settings.batch_size))
                cap.sequences = i  # the global number of the batch's first sequence (top-k locations)
                batch = seqs[i : i + settings.batch_size].to(dev)  # (B, T)
                module(input_ids=batch, attention_mask=torch.ones_like(batch), use_cache=False)
                bar.update(batch.numel())
    wall = time.time() - t0
    if world.size > 1:
        parts = world.gather(stats)
        if not world.is_main:
            return None
        for other in parts[1:]:
            stats.merge(other)
    facts.update({"model_type": module.config.model_type, "tokens": n_tok, "sequences": len(seqs), "seq_len": seq_len,
                  "tokens_requested": settings.tokens, "seconds": round(wall, 2),
                  "tokens_per_s": round(n_tok / max(wall, 1e-9), 1), "n_layers": stats.n_layers,
                  "n_heads": stats.n_heads, "is_diff": stats.is_diff, "lambda": diff_lambdas(module),
                  "dtype": model_dtype(module), "device": dev,
                  "processes": world.size, "peak_rss_mb": peak_rss_mb(),
                  "kinds": stats.kinds(), "forward_order": stats.order, "massive_capped": stats.massive_capped()})
    if not shard.whole:
        facts["shard"] = [shard.index, shard.count]
    return ProfileResult({name: stats}, {name: facts}, settings, {name: digest})


def profile(specs: list[str], settings: ProfileSettings, out: str | Path | None = None,
            progress: bool = True, shard: Shard | None = None, world: World | None = None) -> ProfileResult | None:
    """Load and profile each model spec, and write the results.

    Args:
        specs: model specs (``pair-tiny:diff``, a directory, a Hub id ...).
        settings: the profile's settings.
        out: the output directory (rank 0 writes); None: nothing written.
        progress: show progress bars.
        shard: profile only this share and write ``profile.shard-i-of-N.pt`` for ``merge_profile``.
        world: the ``torchrun`` processes.

    Returns:
        The ``ProfileResult`` of every model (this shard's part for a partial ``shard``); None on ranks other than 0."""
    from outlierscope.models.loading import inspect_model, load_model, meta_model

    if not specs:
        raise ParamError("specs", "at least one model spec (e.g. pair-tiny:diff or a model directory)", specs)
    records = {}
    for spec in specs:  # every model found (a Hub id: downloaded) and its points resolved before the first one runs
        records[spec] = inspect_model(spec, settings.trust_remote_code)
        config = records[spec].config
        resolve_points(meta_model(config, settings.trust_remote_code), settings.points, settings.preset)
        seq_len = resolve_seq_len(config, settings.seq_len)
        if settings.sink_k >= seq_len:  # every key would be a sink: each share 1.0
            raise ParamError("sink_k", f"below the sequence length ({seq_len} tokens for {spec})", settings.sink_k)
    shard, world = shard or Shard(), world or World()
    main_out = out is not None and world.is_main
    with output_dir(out) if main_out else contextlib.nullcontext():
        result = None
        for spec in specs:
            lm = load_model(spec, dtype=settings.dtype, device=world.device(settings.device), device_map=settings.device_map,
                            trust_remote_code=settings.trust_remote_code, record=records[spec])
            name = lm.name if result is None or lm.name not in result.stats else spec
            r = profile_model(lm, settings=settings, name=name, progress=progress, shard=shard, world=world)
            if r is not None:
                result = r if result is None else result | r
        if main_out:
            if shard.whole:
                result.save(out)
            else:
                result.save_shard(out, shard)
    return result


def _stats(state, path: Path) -> OutlierStats:
    """The statistics stored in the profile shard file ``path``; a one-line error when they are not."""
    try:
        return OutlierStats.from_state(state)
    except (ValueError, TypeError, KeyError) as e:
        raise OutlierscopeError(f"{path} is not a readable profile shard file ({e}); run that shard again") from None


def merge_profile(dirs: list[str | Path], out: str | Path | None = None) -> ProfileResult:
    """Combine the ``profile.shard-i-of-N.pt`` files of a ``--shard i/N`` profile into the whole: one process's bytes.

    Args:
        dirs: the directories holding the shards.
        out: where the profile goes; None: the first directory."""
    dirs = [Path(d) for d in dirs]
    files = find_shards(dirs, "profile", ".pt", "profile")
    n = len(files)
    parts = [read_torch_record(f, ("settings", "stats", "facts", "shard"), "profile shard file") for f in files]
    for i, (f, p) in enumerate(zip(files, parts)):
        if list(p["shard"]) != [i, n]:
            raise OutlierscopeError(f"{f} holds shard {p['shard'][0]}/{p['shard'][1]} of a profile, not {i}/{n} (swapped "
                                    "or renamed); rerun that shard, then merge again")
    first = parts[0]
    for p in parts[1:]:
        if p["settings"] != first["settings"] or list(p["stats"]) != list(first["stats"]):
            raise OutlierscopeError("the profile shards were run with different settings or models; merge one run")
    stats = {name: _stats(st, files[0]) for name, st in first["stats"].items()}
    for p, f in zip(parts[1:], files[1:]):
        for name, st in p["stats"].items():
            stats[name].merge(_stats(st, f))
    facts = {}
    for name, f in first["facts"].items():
        facts[name] = {k: v for k, v in f.items() if k != "shard"}
        facts[name]["seconds"] = round(max(p["facts"][name]["seconds"] for p in parts), 2)
        facts[name]["tokens_per_s"] = round(f["tokens"] / max(facts[name]["seconds"], 1e-9), 1)
        facts[name]["merged_shards"] = n
        if all("peak_rss_mb" in p["facts"][name] for p in parts):
            facts[name]["peak_rss_mb"] = max(p["facts"][name]["peak_rss_mb"] for p in parts)
    settings = ProfileSettings(**{k: tuple(v) if k == "points" else v for k, v in first["settings"].items()})
    result = ProfileResult(stats, facts, settings)
    result.save(Path(out) if out is not None else dirs[0])
    return result
