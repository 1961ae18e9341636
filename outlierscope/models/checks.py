"""What can be checked of a model without reading its weights, before any expensive step: config.json, a causal LM
architecture, custom code trusted or not, weight files and their safetensors headers against the config, a
checkpoint's quantization_config and the packages it needs, GPTQ/AWQ packed tensors, the tokenizer's size. The checks
are run, in order and on what is read once, by ``outlierscope.models.record.inspect_model``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from outlierscope.errors import OutlierscopeError
from outlierscope.models.packed import (
    packed_names,
    packed_scheme,
)
from outlierscope.models.quiet import quiet_transformers

NOT_CAUSAL = {"bert", "roberta", "t5", "mt5", "bart", "mbart", "distilbert", "electra", "deberta", "deberta-v2",
              "xlm-roberta", "albert", "encoder-decoder", "pegasus", "marian", "longt5", "umt5", "mpnet"}


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__


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
    """A spec's config where reading it is cheap but ``check_model`` is not: a ``.gguf`` file's, from its metadata.

    Runs check their specs against it first, so a spec that does not fit fails before the conversion (minutes).

    Args:
        spec: the model spec.

    Returns:
        The config; None for any other spec (``check_model`` reads those in seconds)."""
    path = Path(spec).expanduser()
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        return None
    from outlierscope.models.fetch import gguf_config

    return gguf_config(path)


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
    """Every tensor's shape from the safetensors headers of a directory, nothing loaded.

    Args:
        path: the model directory.

    Raises:
        OutlierscopeError: a cut or foreign file, naming it."""
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
    second model of a run is checked before the first one's cells). ``shapes``: ``header_shapes``."""
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
    """A GPTQ/AWQ checkpoint that outlierscope decodes itself (``outlierscope.models.packed``): the packages
    transformers would load it with (GPT-QModel's kernels) are not installed."""
    return packed_scheme(quant) is not None and bool(_missing_packages(quant)[1])


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
    """What ``_check_loading_info`` refuses at load time, read from the safetensors headers before anything
    loads (a second model of a run is checked before the first one's cells): a tensor the model needs that no file
    holds, a shape the config does not expect. Only where the files name the tensors as the model does (at least
    90% of them): a checkpoint that transformers converts on loading (renamed or fused tensors) is left to load.
    ``shapes``: ``header_shapes``; ``meta``: the model on the meta device (None without safetensors)."""
    if not shapes:
        return
    want = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    if sum(k in want for k in shapes) < 0.9 * len(shapes):
        return
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)
    missing = sorted(k for k in want if k not in shapes and not (tied and k == "lm_head.weight"))
    mismatched = [(k, shapes[k], want[k]) for k in sorted(shapes) if k in want and shapes[k] != want[k]]
    _check_loading_info(path, {"missing_keys": missing, "mismatched_keys": mismatched})


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json")


def tokenizer_record(path: Path, tokenizer) -> dict:
    """What a record says of a tokenizer: its class, its number of tokens, its files and one sha256 over them.

    Args:
        path: the directory it was read from.
        tokenizer: the tokenizer."""
    import hashlib

    files = [n for n in TOKENIZER_FILES if (Path(path) / n).is_file()]
    digest = hashlib.sha256()
    for n in files:
        digest.update(n.encode() + b"\0" + (Path(path) / n).read_bytes())
    return {"class": type(tokenizer).__name__, "tokens": len(tokenizer), "files": files,
            "files_sha256": digest.hexdigest()}


def load_tokenizer(path: Path, trust_remote_code: bool = False, config=None):
    """The tokenizer of a model directory, local files only.

    Args:
        path: the directory.
        trust_remote_code: run the tokenizer's own code.
        config: the model's config where the caller read it (not read again to choose the tokenizer's class).

    Raises:
        OutlierscopeError: one that cannot be loaded, in one line."""
    from transformers import AutoTokenizer

    with quiet_transformers():
        try:
            return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code,
                                                 **({"config": config} if config is not None else {}))
        except Exception as e:  # tokenizers raise many types; all mean the same to the user
            raise OutlierscopeError(f"{path}: tokenizer cannot be loaded ({_first_line(e)}); expected tokenizer.json or "
                                    "tokenizer files in the directory") from None


def meta_model(config, trust_remote_code: bool = False):
    """The model's module tree on the meta device (no memory, no weights): what points are resolved against.

    Args:
        config: the model's config.
        trust_remote_code: run the model's own code."""
    import torch
    from transformers import AutoModelForCausalLM

    with quiet_transformers(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def check_causal(model) -> None:
    """Refuse a transformers model that does not predict each token from the earlier ones only.

    A masked LM such as BERT, or an encoder-decoder: its scores would see the continuation. Other modules are the
    caller's to vouch for.

    Args:
        model: the model."""
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
    """``num_hidden_layers`` of a config (or of its ``text_config``).

    Args:
        config: the config.

    Raises:
        OutlierscopeError: a config that states none."""
    cfg = getattr(config, "text_config", None) or config
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise OutlierscopeError(f"{type(config).__name__} states no num_hidden_layers; expected a decoder-only LM config")
    return n


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


def _check_vocab(path: Path, rows: int | None, tokenizer) -> None:
    """Refuse a tokenizer whose ids reach past the model's embedding table of ``rows`` (the first forward would fail
    deep inside)."""
    if rows is None:
        return
    top = max(len(tokenizer) - 1, *(i for i in tokenizer.all_special_ids if i is not None), -1)
    if top >= rows:
        raise OutlierscopeError(f"{path}: the tokenizer has ids up to {top} but the model's embedding has {rows} rows "
                                "(vocab_size); the tokenizer and the weights do not belong together")
