"""Reuse the unquantized model's lower layers: a forward that quantizes only layers >= s starts from the hidden state
the unquantized forward of the same batch left after layer s - 1.

    with recording_outputs(model, {s - 1 for s in starts}) as outs:   # the unquantized forward of a batch
        model(batch)                                                     # outs[j]: layer j's output, as it returned it
    with quantize_model(model, spec), replaying(model, s, outs.get(s - 1)):  # spec quantizes layers >= s only
        model(batch)                                                     # layers < s not run: each returns outs[s - 1]

Layers below ``s`` compute in the quantized forward exactly what they computed in the unquantized one (the same
weights, the same attention function, nothing of ``spec`` applies to them), so the result is the same bytes as the
whole forward. A recorded output changed in place since (its version counter moved: a later layer wrote into its
input) is not replayed: that forward runs whole. While replaying, decoder layers ``0 .. s - 1`` of the model's
``ModuleList`` are ``_Replay`` modules that return the recorded output (whatever they are given); the originals
are put back in ``finally``.
Memory: one recorded output (B, T, D) per distinct start, for one batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

from torch import nn

from outlierscope.hooks.points import decoder_layers


class _Replay(nn.Module):
    """Stands for a decoder layer below the start: returns the recorded output of the layer under the start."""

    def __init__(self, output):
        super().__init__()
        self.output = output  # a plain attribute: the tensor (or tuple) is not a buffer of the model

    def forward(self, *args, **kwargs):
        return self.output


@contextlib.contextmanager
def recording_outputs(model: nn.Module, layers: Collection[int]) -> Iterator[dict]:
    """Inside, each forward stores the output of some decoder layers in the yielded dict (the last forward's).

    The hooks are removed in ``finally``.

    Args:
        model: the model.
        layers: the layers recorded.

    Yields:
        Layer index -> (the object it returned, its version counter then)."""
    outs: dict = {}
    blocks = decoder_layers(model)
    handles = []

    def hook(j):
        def store(mod, args, out):
            outs[j] = (out, _version(out))

        return store

    try:
        for j in sorted(set(layers)):
            handles.append(blocks[j].register_forward_hook(hook(j)))
        yield outs
    finally:
        for h in handles:
            h.remove()


def _version(out) -> int:
    t = out[0] if isinstance(out, tuple) else out
    return t._version


@contextlib.contextmanager
def replaying(model: nn.Module, start: int, recorded: tuple | None) -> Iterator[bool]:
    """Inside, decoder layers ``0 .. start - 1`` are not run: each returns layer ``start - 1``'s recorded output.

    Args:
        model: the model.
        start: the first layer that runs.
        recorded: ``recording_outputs``' entry for layer ``start - 1`` of the same batch.

    Yields:
        Whether it replays: not for ``start`` 0, no record, or a record changed in place since."""
    if start == 0 or recorded is None or _version(recorded[0]) != recorded[1]:
        yield False
        return
    blocks = decoder_layers(model)  # found only when it replays: a forward that does not pays no search
    if not 0 < start < len(blocks):
        raise ValueError(f"start must be in 0..{len(blocks) - 1}, got {start}")
    originals = [blocks[j] for j in range(start)]
    try:
        for j in range(start):
            blocks[j] = _Replay(recorded[0])
        yield True
    finally:
        for j, block in enumerate(originals):
            blocks[j] = block


class _Stop(Exception):
    """Raised by ``stopping_after``'s hook to end a forward."""


@contextlib.contextmanager
def stopping_after(model: nn.Module, layer: int) -> Iterator[None]:
    """Inside, a forward ends after a decoder layer (a hook raises, the context catches it).

    A recording forward then runs no layer above the last it records; the code after the forward inside the context
    does not run. The hook is removed in ``finally``.

    Args:
        model: the model.
        layer: the last layer run."""
    handle = decoder_layers(model)[layer].register_forward_hook(lambda mod, args, out: _raise_stop())
    try:
        yield
    except _Stop:
        pass
    finally:
        handle.remove()


def _raise_stop():
    raise _Stop
