"""Load a model by spec: a bundled preset role (``pair-tiny:diff``) or any local HF causal LM directory.

Nothing here ever reaches for a hub: offline mode is set and ``local_files_only=True`` is
passed to every ``from_pretrained``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from outlierscope.errors import OutlierscopeError
from outlierscope.models.presets import PRESETS, ROLES

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PRETRAINED_DIR = Path(__file__).resolve().parent.parent / "pretrained"
DTYPES = ("float32", "bfloat16", "float16")  # weights and activations; bf16/fp16 halve the memory of a big model


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise OutlierscopeError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


@dataclass
class LoadedModel:
    """A model, its tokenizer and where they came from."""

    spec: str
    path: Path
    model: object
    tokenizer: object

    @property
    def name(self) -> str:
        """Short label for tables: the spec of a bundled model, else the directory name."""
        return self.spec if ":" in self.spec and not Path(self.spec).exists() else self.path.name

    @property
    def model_type(self) -> str:
        return self.model.config.model_type

    def weights_sha256(self) -> str:
        """sha256 over the model's safetensors/bin files (sorted by name): identifies the exact weights."""
        h = hashlib.sha256()
        for f in sorted(self.path.glob("*.safetensors")) or sorted(self.path.glob("*.bin")):
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        return h.hexdigest()


def bundled_specs() -> list[str]:
    """Specs of the bundled models that are present in this installation."""
    return [f"{p}:{r}" for p in PRESETS for r in ROLES if (PRETRAINED_DIR / p / r / "config.json").exists()]


def resolve_spec(spec: str) -> Path:
    """Map a spec to a model directory, or raise a one-line error naming what is wrong."""
    path = Path(spec).expanduser()
    if path.exists() or os.sep in spec or spec.startswith("."):
        if not path.is_dir():
            raise OutlierscopeError(f"model directory not found: {path}; pass an existing HF model directory or a preset role like pair-tiny:diff")
        if not (path / "config.json").exists():
            raise OutlierscopeError(f"{path} has no config.json; expected a Hugging Face model directory (config.json + safetensors + tokenizer)")
        return path
    if ":" not in spec:
        hint = difflib.get_close_matches(spec, bundled_specs() + list(PRESETS), n=3, cutoff=0.3)
        raise OutlierscopeError(
            f"model {spec!r} is neither a directory nor a preset role (PRESET:{'|'.join(ROLES)})"
            + (f"; did you mean {', '.join(hint)}?" if hint else "")
        )
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


def load_model(spec: str, dtype: str = "float32", attn_implementation: str = "eager") -> LoadedModel:
    """Load a causal LM and its tokenizer from a spec, in eval mode, from local files only, in ``dtype``."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    check_dtype(dtype)
    path = resolve_spec(spec)
    try:
        cfg_json = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise OutlierscopeError(f"{path / 'config.json'} is not readable JSON ({e}); fix or replace the file") from None
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        mt = cfg_json.get("model_type", "missing")
        raise OutlierscopeError(f"{path}: unsupported architecture (model_type {mt!r}) for transformers {transformers.__version__}: {str(e).splitlines()[0]}") from None
    if type(config) not in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise OutlierscopeError(f"{path}: model_type {config.model_type!r} is not a causal LM supported by transformers; expected e.g. llama, diffllama, qwen2, mistral")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise OutlierscopeError(f"{path} has no weights (*.safetensors or *.bin); expected a saved Hugging Face model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # tokenizers raise many types; all mean the same to the user
        raise OutlierscopeError(f"{path}: tokenizer cannot be loaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); expected tokenizer.json or tokenizer files in the directory") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=getattr(torch, dtype), attn_implementation=attn_implementation
        )
    except Exception as e:
        raise OutlierscopeError(f"{path}: weights cannot be loaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    model.eval()
    return LoadedModel(spec=spec, path=path, model=model, tokenizer=tokenizer)


def generate(lm: LoadedModel, prompt: str, max_new_tokens: int = 60, temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> str:
    """Sample a continuation (seeded); ``temperature=0`` is greedy."""
    import torch

    if max_new_tokens <= 0:
        raise OutlierscopeError(f"max_new_tokens must be positive, got {max_new_tokens}")
    torch.manual_seed(seed)
    ids = lm.tokenizer(prompt, return_tensors="pt").input_ids
    kw = dict(do_sample=True, temperature=temperature, top_k=top_k) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        out = lm.model.generate(ids, max_new_tokens=max_new_tokens, pad_token_id=lm.tokenizer.eos_token_id, **kw)
    return prompt + lm.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
