"""A model inspected once: ``inspect_model`` reads what a model spec is (where it led, config.json, the config
transformers builds from it, the checkpoint's quantization scheme and packed layout, the safetensors headers, the
tokenizer and its files' digest), runs every check that needs no weights, and returns one ``ModelRecord``.
The checks, the loader (``load_model(..., record=)``), the text windows, the cells' identity and the run records
take it from there; nothing reads the config or the tokenizer again.

    record = inspect_model("smollm2-135m")       # config, headers, tokenizer: read and checked once
    check_spec(spec, record.config)              # the specs against the shapes, before the weights load
    windows = protocol_windows(..., record.tokenizer, ...)
    lm = load_model(record.spec, record=record)  # only the weights are read now
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.io import sha256_files
from outlierscope.models.checks import (
    NOT_CAUSAL,
    _check_auto_map,
    _check_quantization_packages,
    _check_vocab,
    _check_weight_headers,
    _decodes_packed,
    _linear_shapes,
    _quantization_config,
    _read_config_json,
    header_shapes,
    load_tokenizer,
    meta_model,
    num_layers,
    tokenizer_record,
)
from outlierscope.models.packed import check_packed
from outlierscope.models.quiet import quiet_transformers
from outlierscope.models.resolve import ModelSource, resolve_model


@dataclass(frozen=True, eq=False)
class ModelRecord:
    """What a model spec is, as ``inspect_model`` read it once (no weights loaded).

    Attributes:
        spec: the spec as the user gave it.
        source: where it led (a directory, preset, fetched model, Hub snapshot or converted GGUF).
        trust_remote_code: whether the model's own code may run.
        config_json: config.json as stored.
        config: transformers' config built from it.
        quantization: a checkpoint saved quantized: its checked ``quantization_config``; else None.
        shapes: every tensor's shape, from the safetensors headers.
        tokenizer: the tokenizer, checked against the vocabulary."""

    spec: str
    source: ModelSource
    trust_remote_code: bool
    config_json: dict
    config: object
    quantization: dict | None
    shapes: dict
    tokenizer: object

    @property
    def path(self) -> Path:
        return self.source.path

    @property
    def layers(self) -> int:
        """The number of decoder layers the config states."""
        return num_layers(self.config)

    @property
    def packed(self) -> bool:
        """A GPTQ/AWQ checkpoint that outlierscope decodes itself (its kernels are not installed)."""
        return _decodes_packed(self.quantization)

    @property
    def stored_dtype(self) -> str | None:
        """The dtype config.json says the weights were saved in (None where it says none)."""
        stored = self.config_json.get("dtype") or self.config_json.get("torch_dtype")
        return stored if isinstance(stored, str) else None

    @cached_property
    def tokenizer_files(self) -> dict:
        """The tokenizer's record: class, number of tokens, its files and one sha256 over them."""
        return tokenizer_record(self.path, self.tokenizer)

    @cached_property
    def weights_sha256(self) -> str:
        """sha256 over the weight files (sorted by name): read once, whatever asks for it."""
        return sha256_files(sorted(self.path.glob("*.safetensors")) or sorted(self.path.glob("*.bin")))

    def float_config(self):
        """A copy of the config without its quantization_config: transformers builds plain linears from it (a
        packed checkpoint's linears are then filled with its decoded weights)."""
        config = copy.deepcopy(self.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        return config

    def check_for(self, spec: str, trust_remote_code: bool) -> None:
        """Refuse a record made for another spec or another ``trust_remote_code``.

        Args:
            spec: the spec the caller loads.
            trust_remote_code: the caller's setting."""
        if (spec, trust_remote_code) != (self.spec, self.trust_remote_code):
            raise ParamError("record", f"the record of {spec} with trust_remote_code={trust_remote_code}",
                             f"{self.spec} with trust_remote_code={self.trust_remote_code}",
                             "pass inspect_model(spec, trust_remote_code), or no record")


def _config(path: Path, cfg_json: dict, spec: str, trust_remote_code: bool):
    """transformers' config of a causal LM it knows (or custom code the user trusts), or one line saying why not."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

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
    return config


def _check_weight_files(path: Path, source: ModelSource) -> None:
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise OutlierscopeError(f"{path} has no weights (*.safetensors or *.bin); expected a saved Hugging Face model")
    if source.kind != "hub" and not any(path.glob("*.safetensors")):  # a Hub download already warned
        warnings.warn(f"{path} has only *.bin weights: pickle files, which run code when loaded; prefer safetensors",
                      stacklevel=3)


def inspect_model(spec: str, trust_remote_code: bool = False) -> ModelRecord:
    """Read and check everything about a model that needs no weights, once; runs hand the record on.

    Reads the directory (or preset, fetched model, Hub snapshot, converted GGUF), config.json, the architecture
    (transformers' own, or custom code the user trusts), the weight files' headers against the config, a quantized
    checkpoint's packages and packed layout, and the tokenizer against the vocabulary. For a Hub id this is the download.

    Args:
        spec: a directory, a ``.gguf`` file, a preset role, a fetched model or a Hub id ``ORG/NAME[@REVISION]``.
        trust_remote_code: run Python code shipped with the model.

    Returns:
        The ``ModelRecord``: source, config, weight files, quantization and tokenizer, as read.

    Raises:
        OutlierscopeError: the first thing that does not fit, in one line."""
    source = resolve_model(spec, trust_remote_code)
    path = source.path
    cfg_json = _read_config_json(path)
    quant = _quantization_config(path, cfg_json)
    config = _config(path, cfg_json, spec, trust_remote_code)
    _check_weight_files(path, source)
    shapes = header_shapes(path)  # every safetensors header read once for the checks below
    _check_quantization_packages(path, quant, shapes)
    meta = meta_model(config, trust_remote_code) if shapes else None
    if _decodes_packed(quant):
        check_packed(path, quant, shapes, _linear_shapes(meta))
    _check_weight_headers(path, config, shapes, meta)
    tokenizer = load_tokenizer(path, trust_remote_code, config)
    rows = getattr(config.get_text_config(), "vocab_size", None)
    _check_vocab(path, rows if isinstance(rows, int) else None, tokenizer)
    return ModelRecord(spec, source, trust_remote_code, cfg_json, config, quant, shapes, tokenizer)


def check_model(spec: str, trust_remote_code: bool = False):
    """``(source, config)`` of ``inspect_model`` (its record has the rest).

    Args:
        spec: the model spec.
        trust_remote_code: the model's own code may run."""
    record = inspect_model(spec, trust_remote_code)
    return record.source, record.config
