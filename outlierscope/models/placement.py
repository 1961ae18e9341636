"""Where and in what dtype a model runs, and the run settings that say so: ``--device``, ``--dtype``, ``--device-map``,
``--attn-block``, ``--trust-remote-code`` declared once for every run's dataclass; device and dtype resolution; a
model's context length."""

from __future__ import annotations

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.settings import option

# weights and activations; bf16/fp16 halve the memory of a big model; float64: scores that do not depend on the batch's
# shape or the processor's kernels (quantized float32 scores can: a last-bit difference crosses a rounding boundary)
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
DEVICES = ("auto", "cpu", "cuda", "cuda:N")  # auto: cuda when available, else cpu
# config names under which architectures state their context length, in the order they are read
CONTEXT_NAMES = ("max_position_embeddings", "n_positions", "max_target_positions", "max_sequence_length",
                 "seq_length", "max_seq_len", "n_ctx")


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


# the placement settings every run shares, declared once (outlierscope.settings): the runs' dataclasses use these
def dtype_option():
    return option("auto", "weights and activations (auto: the checkpoint's bf16/fp16 on cuda, float32 on the cpu; "
                  "attention logits are float32 at least; float64: independent of batch size and processor but for the "
                  "rounding ties of full-range grids such as W8A8's (the perplexity guide), slower)",
                  choices=DTYPES)


def device_option():
    return option("auto", "where the model runs (auto: cuda when available, else cpu)", metavar="{auto,cpu,cuda,cuda:N}")


def device_map_option():
    return option(None, "spread a model larger than one GPU over the GPUs (accelerate); replaces --device",
                  choices=DEVICE_MAPS)


def attn_block_option():
    return option(None, "query rows per attention block (default: so one block's float32 logits stay under 256 MiB)",
                  metavar="ROWS")


def fused_option():
    return option(False, "compile the quantizers' elementwise chains (torch.compile: the same bytes, tested; CPU only; "
                  "seconds of compiling at each scheme's first quantized forward)")


def trust_remote_code_option():
    return option(False, "run Python code shipped with a model that needs it (auto_map in its config); only for "
                  "models whose authors you trust")


def check_dtype(dtype: str) -> str:
    """A dtype setting, checked.

    Args:
        dtype: one of ``DTYPES``."""
    if dtype not in DTYPES:
        raise ParamError("dtype", f"one of {', '.join(DTYPES)}", dtype)
    return dtype


def _is_device(device: str) -> bool:
    """Whether ``device`` is spelled as one of DEVICES (``cuda:N`` with a number)."""
    return device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())


def check_placement(device: str, dtype: str, device_map, attn_block: int | None, fused: bool = False) -> None:
    """Validate the placement settings the runs share, before anything loads.

    Args:
        device: one of ``DEVICES``.
        dtype: one of ``DTYPES``.
        device_map: accelerate's placement (``auto``, ``balanced``, ..., or a dict); None: ``device``.
        attn_block: query rows per attention block; None: from a 256 MiB budget.
        fused: compiled quantizers (``fused_kernels``); refused where the model would run on a GPU."""
    check_dtype(dtype)
    if not _is_device(device):
        raise ParamError("device", f"one of {', '.join(DEVICES)}", device)
    if device_map not in (None, *DEVICE_MAPS) and not isinstance(device_map, dict):
        raise ParamError("device_map", "auto, balanced, balanced_low_0, sequential or a dict (accelerate's placement)", device_map)
    if attn_block is not None and (not isinstance(attn_block, int) or attn_block < 1):
        raise ParamError("attn_block", "a positive number of query rows (or None: from a 256 MiB budget)", attn_block)
    if fused not in (False, True):
        raise ParamError("fused", "True or False", fused)
    if fused and (device_map is not None or resolve_device(device) != "cpu"):
        raise ParamError("fused", "False where the model runs on a GPU", fused,
                         "compiled float32 division there is approximate (Triton's div.full.f32), so the bytes would "
                         "differ from the eager quantizers'; fused kernels are proven on the CPU")


def resolve_device(device: str) -> str:
    """The device a setting names: ``auto`` is ``cuda`` when torch sees a GPU, else ``cpu``.

    Args:
        device: one of ``DEVICES``; ``cuda`` and ``cuda:N`` are checked against the GPUs present."""
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
    """The dtype a setting names: ``auto`` is the checkpoint's bf16/fp16 on CUDA, float32 otherwise.

    Args:
        dtype: one of ``DTYPES``.
        device: the resolved device.
        stored: config.json's dtype."""
    check_dtype(dtype)
    if dtype != "auto":
        return dtype
    if device.startswith("cuda") and stored in ("bfloat16", "float16"):
        return stored
    return "float32"


def model_dtype(model) -> str:
    """A model's dtype as a name (``float32``, ``bfloat16``, ...): its first parameter's.

    Args:
        model: the model."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def model_device(model) -> str:
    """Where a model's inputs go: the device of its input embeddings (the first layer under a device map).

    Args:
        model: the model."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    p = emb.weight if emb is not None else next(model.parameters())
    return str(p.device)


def context_length(model) -> int:
    """The model's context in tokens, from the first of ``CONTEXT_NAMES`` its config states.

    Args:
        model: a model or its config.

    Raises:
        OutlierscopeError: a config that states none (guessing would index past the position table)."""
    config = getattr(model, "config", model)
    cfg = getattr(config, "text_config", None) or config
    for attr in CONTEXT_NAMES:
        v = getattr(cfg, attr, None)
        if isinstance(v, int) and v > 0:
            return int(v)
    raise OutlierscopeError(f"{type(model).__name__}: its config states no context length (none of "
                            f"{', '.join(CONTEXT_NAMES)}); set one of them in config.json")


def resolve_seq_len(model, seq_len: int | None, default: int = 256) -> int:
    """A sequence length checked against the model's context.

    Args:
        model: a model or its config.
        seq_len: tokens per sequence; None: min(context, ``default``).
        default: the length without one."""
    ctx = context_length(model)
    if seq_len is None:
        return min(ctx, default)
    if seq_len <= 0:
        raise ParamError("seq_len", "a positive number of tokens", seq_len)
    if seq_len > ctx:
        raise ParamError("seq_len", f"at most the model's context of {ctx} tokens", seq_len)
    return seq_len
