"""Fused kernels, optional: the quantizers' elementwise chains compiled by ``torch.compile`` (inductor), the same bytes.

A quantizer such as NVFP4 or MX is a chain of a dozen elementwise passes over the tensor (absolute values, block
maxima, a division, a rounding built from comparisons, a product, dtype copies), each reading and writing the whole
tensor. Inside ``fused_kernels`` the functions marked ``fusable`` (``quantize_activation`` and
``quantize_weight`` of ``outlierscope.quant.linears.ops``; attention's ``quantize_tokens`` and ``quantize_probs``
of ``outlierscope.quant.attention.ops`` and the paper's ``quantize_logits``) run as one compiled graph each, which
inductor turns into a few loops over the data::

    with fused_kernels():                  # or a run's ``fused=True`` (``--fused``)
        with quantize_model(model, spec):  # its quantizers compiled at their first call (seconds), then reused
            model(ids)

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings

import torch

_FUSED = contextvars.ContextVar("outlierscope_fused_kernels", default=False)


# graphs a fusable function may compile inside fused_kernels (one per quantizer part and dtype, shapes dynamic):
# dynamo's default of 8 would fall back to eager from a study's ninth scheme on
RECOMPILE_LIMIT = 256


@contextlib.contextmanager
def fused_kernels(enabled: bool = True):
    """Within the block, run the quantizers compiled by ``torch.compile``: the same bytes as eager on the CPU.

    Every linear scheme's ``a=`` and ``w=`` parts and attention's q/k/v, P and logits parts (not bitsandbytes') run
    as one fused loop per chain of elementwise passes, after seconds of compiling at each scheme's first call. A run's
    ``fused=True`` (``--fused``) enters it; it is refused on a GPU. Dynamo's recompile limit is raised to
    ``RECOMPILE_LIMIT`` meanwhile and restored on exit::

        with fused_kernels(), quantize_model(model, QuantSpec.of("nvfp4")):
            model(ids)

    Args:
        enabled: False runs the block eager (a run's ``fused=False``)."""
    token = _FUSED.set(bool(enabled))
    limits = {"recompile_limit": RECOMPILE_LIMIT, "accumulated_recompile_limit": RECOMPILE_LIMIT}
    try:
        with torch._dynamo.config.patch(**limits) if enabled else contextlib.nullcontext():
            yield
    finally:
        _FUSED.reset(token)


def fusing() -> bool:
    """Whether the caller is inside ``fused_kernels(True)``."""
    return _FUSED.get()


def fusable(fn=None, *, eager_if=None, dynamic: bool | None = None):
    """``fn`` as it is, or compiled by ``torch.compile`` inside ``fused_kernels``: ``@fusable`` or ``@fusable(...)``.

    Where ``fn`` is already being traced (one fusable function calling another) it runs inlined into the caller's
    graph; the eager function stays reachable as ``.eager``. A graph the compiler cannot build costs speed, never the
    run: the call is made again eagerly (a quantizer never mutates its input, so the bytes are the eager ones), with a
    warning, and from then on ``fn`` runs eagerly on inputs of that dtype (``fallbacks`` lists them; known: inductor
    2.13 cannot generate ``frexp`` on float64 vectors). Inputs off the CPU run eagerly the same way.

    Args:
        fn: the function.
        eager_if: a predicate of ``fn``'s arguments under which it always runs eagerly (nothing to compile).
        dynamic: ``torch.compile``'s (None: specialised to the first shape, shape-generic after the first recompile;
            True: shape-generic from the first call)."""
    if fn is None:
        return functools.partial(fusable, eager_if=eager_if, dynamic=dynamic)
    compiled = []

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not _FUSED.get() or torch.compiler.is_compiling() or eager_if is not None and eager_if(*args, **kwargs):
            return fn(*args, **kwargs)
        key = _key(fn, args)
        if key in _FALLBACKS:
            return fn(*args, **kwargs)
        if args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            _fall_back(key, f"its input is on {args[0].device.type}; fused kernels are proven on the CPU only")
            return fn(*args, **kwargs)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=dynamic))
        try:
            return compiled[0](*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # inductor's errors reach here wrapped
            _fall_back(key, f"compiling failed ({str(e).splitlines()[0][:200]})")
            return fn(*args, **kwargs)

    run.eager = fn
    return run


_FALLBACKS: list[str] = []


def _fall_back(key: str, why: str) -> None:
    _FALLBACKS.append(key)
    warnings.warn(f"fused kernels: {key}: {why}; it runs eagerly (the eager bytes, slower)", RuntimeWarning,
                  stacklevel=3)


def _key(fn, args) -> str:
    dtype = args[0].dtype if args and isinstance(args[0], torch.Tensor) else None
    return f"{fn.__module__}.{fn.__qualname__} on {dtype}"


def fallbacks() -> list[str]:
    """The fusable functions and input dtypes (``module.name on dtype``) that failed to compile and run eagerly."""
    return list(_FALLBACKS)
