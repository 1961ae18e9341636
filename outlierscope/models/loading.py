"""Load a model by spec: a local HF directory (sharded or not) or ``.gguf`` file, a bundled preset role
(``pair-tiny:diff``), a fetched model (``smollm2-135m``) or a Hugging Face Hub id (``Qwen/Qwen2.5-7B@main``).

Only a Hub id reaches the network, through ``huggingface_hub`` (``outlierscope.models.hub``); every
``from_pretrained`` then reads local files (``local_files_only=True``). Importing this module changes no environment
variable and no logging level; ``load_model`` quiets transformers' loading messages only while it runs.

The steps live in their own modules: ``resolve`` (spec -> directory),
``checks`` (what is checked before the weights load), ``placement``
(device, dtype, the shared run settings), ``compressed`` and
``packed`` (quantized checkpoints); their public names are importable from here too.
"""

from __future__ import annotations

import copy
import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.io import sha256_files
from outlierscope.models.checks import (  # noqa: F401 (re-exported: callers import the model API from here)
    NOT_CAUSAL,
    QUANT_PACKAGES,
    _check_loading_info,
    _check_vocab,
    _decodes_packed,
    _first_line,
    _read_config_json,
    check_causal,
    header_shapes,
    meta_model,
    num_layers,
    preview_config,
)
from outlierscope.models.compressed import decompress_now
from outlierscope.models.float64 import build_options, float64_build, float64_model
from outlierscope.models.packed import (
    PACKED_SUFFIXES,
    decode_into,
    packed_names,
    tensor_files,
)
from outlierscope.models.placement import (  # noqa: F401 (re-exported)
    CONTEXT_NAMES,
    DEVICE_MAPS,
    DEVICES,
    DTYPES,
    attn_block_option,
    check_dtype,
    check_placement,
    context_length,
    device_map_option,
    device_option,
    dtype_option,
    fused_option,
    model_device,
    model_dtype,
    resolve_device,
    resolve_dtype,
    resolve_seq_len,
    trust_remote_code_option,
)
from outlierscope.models.quiet import quiet_transformers
from outlierscope.models.record import ModelRecord, check_model, inspect_model  # noqa: F401 (re-exported)
from outlierscope.models.resolve import (  # noqa: F401 (re-exported)
    PRETRAINED_DIR,
    ModelSource,
    _is_name,
    bundled_specs,
    resolve_model,
    resolve_spec,
)


def state_dict_sha256(model) -> str:
    """The sha256 over the parameters and buffers of an in-memory model: name, dtype, shape and bytes, by name.

    Args:
        model: the model."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass
class LoadedModel:
    """A model, its tokenizer and where they came from, as ``load_model`` returns them.

    Attributes:
        spec: the spec it was loaded from.
        path: its directory.
        model: the causal LM module, in eval mode.
        tokenizer: its tokenizer.
        source: where the spec led; None for a model built in Python.
        decoded: a GPTQ/AWQ checkpoint whose packed weights were decoded: what was decoded; else None.
        record: what ``inspect_model`` read of it (config, tokenizer, digests)."""

    spec: str
    path: Path
    model: object
    tokenizer: object
    source: ModelSource | None = None
    decoded: dict | None = None
    record: ModelRecord | None = None

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
        """What a run record says of the model.

        The spec as given, its kind, the Hub commit or GGUF details, the weight files' sha256, and for a checkpoint
        saved quantized its ``quantization_config`` as transformers read it.

        Args:
            weights_sha256: the weights' digest, when the caller has it already; None: computed here."""
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
        """sha256 over the model's safetensors/bin files (sorted by name): identifies the exact weights (read once
        per ``ModelRecord``)."""
        if self.record is not None:
            return self.record.weights_sha256
        return sha256_files(sorted(self.path.glob("*.safetensors")) or sorted(self.path.glob("*.bin")))


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


def _embedding_rows(model) -> int | None:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return emb.num_embeddings if emb is not None and hasattr(emb, "num_embeddings") else None


def load_model(spec: str, dtype: str = "auto", attn_implementation: str = "eager", device: str = "auto",
               device_map: str | dict | None = None, trust_remote_code: bool = False,
               record: ModelRecord | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode; only a Hub id reaches the network.

    A Hub id is fetched with ``huggingface_hub`` (the user's endpoint, cache, token and ``HF_HUB_OFFLINE``); the files
    are then read with ``local_files_only``.

    Args:
        spec: a directory, a ``.gguf`` file, a preset role, a fetched model or a Hub id ``ORG/NAME[@REVISION]``.
        dtype: ``auto`` (the checkpoint's bf16/fp16 on CUDA, float32 on the CPU), ``float32``, ``bfloat16``,
            ``float16`` or ``float64``.
        attn_implementation: transformers' attention for plain forwards (``capture`` and ``quantize_model`` route
            attention through their own while active).
        device: ``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``.
        device_map: accelerate's placement (``"auto"`` spreads a large model over the GPUs, then the CPU); replaces
            ``device``.
        trust_remote_code: run Python code shipped with the model.
        record: the spec's ``inspect_model``, when the caller made it; its config and tokenizer are used as read.

    Returns:
        The ``LoadedModel``: the model, its tokenizer and its record."""
    import torch

    check_dtype(dtype)
    if record is None:
        record = inspect_model(spec, trust_remote_code)  # a wrong path is named before a wrong device
    record.check_for(spec, trust_remote_code)
    dev = resolve_device(device) if device_map is None else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(dtype, dev, record.stored_dtype)
    placement = {"device_map": device_map} if device_map is not None else {}
    if (record.quantization or {}).get("quant_method") == "bitsandbytes" and device_map is None:
        placement = {"device_map": {"": dev}}  # bitsandbytes quantizes (or reads its int8/4-bit state) only when placed
    model, info = _from_pretrained(record, dtype, attn_implementation, placement)
    decoded = None
    if record.packed:  # built as a float model, its packed linears decoded now
        decoded = _load_packed(record.path, record.quantization, model, info)
    else:
        _check_loading_info(record.path, info)
    _check_vocab(record.path, _embedding_rows(model), record.tokenizer)
    decompress_now(model, record.path)
    if not placement and dev != "cpu":
        model.to(dev)
    model.eval()
    return LoadedModel(spec=spec, path=record.path, model=model, tokenizer=record.tokenizer, source=record.source,
                       decoded=decoded, record=record)


def _from_pretrained(record: ModelRecord, dtype: str, attn_implementation: str, placement: dict):
    """transformers' model of ``record`` in ``dtype`` (its config as inspected; a packed checkpoint's without its
    quantization_config) and the loading info, or one line naming the directory."""
    import torch
    from transformers import AutoModelForCausalLM

    config = record.float_config() if record.packed else copy.deepcopy(record.config)  # the record's stays as read
    with quiet_transformers():
        try:
            with float64_build(dtype):  # float64: buffers made at construction are float64 values too
                return AutoModelForCausalLM.from_pretrained(
                    record.path, config=config, local_files_only=True, dtype=getattr(torch, dtype),
                    attn_implementation=attn_implementation, output_loading_info=True, ignore_mismatched_sizes=True,
                    trust_remote_code=record.trust_remote_code, **placement, **build_options(dtype),
                )
        except Exception as e:
            raise OutlierscopeError(f"{record.path}: weights cannot be loaded ({_first_line(e)})") from None


def check_generation(prompt: str, max_new_tokens: int, temperature: float, top_k: int, config=None) -> None:
    """Check ``generate``'s arguments before a model loads.

    Args:
        prompt: a non-empty text.
        max_new_tokens: a positive number.
        temperature: >= 0 (0: greedy).
        top_k: >= 1.
        config: the model's config, to check against its context; None: not checked."""
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
    """Sample a continuation of a prompt, seeded.

    A prompt that leaves no room in the model's context for ``max_new_tokens`` is cut from the left, and ``warn`` is
    told how many tokens were dropped.

    Args:
        lm: the ``LoadedModel``.
        prompt: the text to continue.
        max_new_tokens: tokens to add.
        temperature: the sampling temperature; 0 is greedy.
        top_k: sample among the ``top_k`` most likely tokens.
        seed: the sampling seed.
        warn: where a cut prompt is said; None: ``warnings.warn``.

    Returns:
        The continuation's text."""

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
    with torch.no_grad(), float64_model(lm.model):
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                pad_token_id=lm.tokenizer.eos_token_id, **kw)
    return prompt + lm.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
