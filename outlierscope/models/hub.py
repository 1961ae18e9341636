"""Models by Hugging Face Hub id: ``ORG/NAME`` or ``ORG/NAME@REVISION`` (branch, tag or commit), downloaded with
``huggingface_hub`` into its usual cache and loaded from there.

The Hub's settings are the user's, read when a model is resolved (not at import): ``HF_ENDPOINT`` (default
https://huggingface.co), ``HF_HUB_CACHE`` / ``HF_HOME`` (the cache), ``HF_TOKEN`` or a saved ``hf auth login``
(gated and private repositories), ``HF_HUB_OFFLINE=1`` (no request at all: the cache only). A model already in
the cache for the asked revision loads without a request when offline; online, ``huggingface_hub`` checks the
revision (one metadata request) and downloads only what is missing. Downloads go to ``.incomplete`` files that
become blobs only when whole, so an interrupted download is resumed by the next call and never loaded.

What is downloaded: the config, tokenizer and generation files and the safetensors weights (one file or the shards
of ``model.safetensors.index.json``); ``*.bin`` weights only when the revision has no safetensors (with a warning:
they are pickle files, which run code when loaded); ``*.py`` files only with ``trust_remote_code``.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from outlierscope.errors import OutlierscopeError

DEFAULT_ENDPOINT = "https://huggingface.co"
# ORG/NAME with Hub's characters, optionally @REVISION (a branch or tag may contain '/')
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[\w])(?:@(?P<rev>[\w./-]+))?$")
FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer*",
         "special_tokens_map.json", "vocab.json", "merges.txt", "*.tiktoken", "added_tokens.json"]
PICKLE_FILES = ["*.bin", "pytorch_model.bin.index.json"]


@dataclass(frozen=True)
class HubModel:
    """A resolved Hub model: where its snapshot lies and exactly which commit it is.

    Attributes:
        repo_id: ``ORG/NAME``.
        revision: as the user asked; None: the default branch.
        commit: the resolved commit sha.
        path: the snapshot directory in the cache."""

    repo_id: str
    revision: str | None
    commit: str
    path: Path


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """``("ORG/NAME", "REV" or None)`` when a spec is spelled as a Hub id, else None.

    Args:
        spec: the spec."""
    m = HUB_ID.match(spec)
    return (m["repo"], m["rev"]) if m else None


def hub_settings() -> dict:
    """The user's Hub settings now: endpoint, cache directory, offline mode."""
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    offline = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").strip().lower() in (
        "1", "true", "yes", "on")  # huggingface_hub's own rule
    return {"endpoint": (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
            "cache_dir": os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub"), "offline": offline}


def resolve_hub(spec: str, trust_remote_code: bool = False) -> HubModel:
    """Download (or find in the cache) the snapshot of a Hub id; every failure is a one-line error.

    A commit sha already in the cache needs no request; a branch or tag needs one unless ``HF_HUB_OFFLINE`` is set;
    within one process a spec is resolved once.

    Args:
        spec: ``ORG/NAME[@REVISION]``.
        trust_remote_code: the model's own code may run."""
    hs = hub_settings()
    return _resolve(spec, trust_remote_code, hs["endpoint"], hs["cache_dir"], hs["offline"])


@functools.lru_cache(maxsize=64)
def _resolve(spec: str, trust_remote_code: bool, endpoint: str, cache_dir: str, offline: bool) -> HubModel:
    """``resolve_hub`` for these settings (the arguments are the cache's key)."""
    hs = {"endpoint": endpoint, "cache_dir": cache_dir, "offline": offline}
    repo_id, revision = parse_hub_id(spec)
    patterns = FILES + (["*.py"] if trust_remote_code else [])
    path = Path(_snapshot(repo_id, revision, patterns, hs))
    if not any(path.glob("*.safetensors")):
        path = Path(_snapshot(repo_id, path.name, PICKLE_FILES, hs))  # the same commit
        if any(path.glob("*.bin")):
            warnings.warn(f"{repo_id} has no safetensors weights: loading its *.bin files, which are pickle files "
                          "and run code when loaded", stacklevel=2)
    return HubModel(repo_id, revision, path.name, path)


def _snapshot(repo_id: str, revision: str | None, patterns: list[str], hs: dict) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=hs["cache_dir"], endpoint=hs["endpoint"],
                                 local_files_only=hs["offline"], allow_patterns=patterns)
    except Exception as e:  # huggingface_hub and httpx raise many types; each becomes one line
        raise OutlierscopeError(_explain(e, repo_id, revision, hs)) from None


def _explain(e: Exception, repo_id: str, revision: str | None, hs: dict) -> str:
    """The one-line message for a failed download, naming the fix."""
    from huggingface_hub import errors

    name = type(e).__name__
    asked = f"{repo_id}@{revision}" if revision else repo_id
    if isinstance(e, errors.GatedRepoError):
        return (f"{repo_id} is gated: accept its licence on its page at {hs['endpoint']}/{repo_id} while logged in, then "
                "log in here (`hf auth login`, or set HF_TOKEN to a token of that account)")
    if isinstance(e, errors.RevisionNotFoundError):
        return f"revision {revision!r} of {repo_id} not found on {hs['endpoint']}; pass a branch, tag or commit it has"
    if isinstance(e, errors.RepositoryNotFoundError):
        return (f"model {repo_id} not found on {hs['endpoint']} (or it is private: log in with `hf auth login` or set "
                "HF_TOKEN); check the id, e.g. Qwen/Qwen2.5-7B")
    if isinstance(e, errors.LocalEntryNotFoundError) or name in ("ConnectError", "ConnectTimeout", "OfflineModeIsEnabled"):
        if hs["offline"]:
            return (f"{asked} is not in the Hugging Face cache ({hs['cache_dir']}) and HF_HUB_OFFLINE is set, so nothing "
                    "is downloaded; unset HF_HUB_OFFLINE to download it once")
        return (f"cannot reach {hs['endpoint']} to download {asked} ({_first_line(e)}); check the network, or set "
                "HF_HUB_OFFLINE=1 to use the models already in the cache")
    return (f"downloading {asked} from {hs['endpoint']} failed ({name}: {_first_line(e)}); run the command again: "
            "finished files are kept and an interrupted one resumes")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:160] if text else type(e).__name__
