"""Checks shared by the frozen settings of a weight algorithm (``gptq:`` and ``awq:``'s configs): each field holds a
value of its declared type (what the spec's text can say), and no key is given twice in one text."""

from __future__ import annotations

import dataclasses
import math

from outlierscope.errors import OutlierscopeError


def _fits(value, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, str)


def check_field_types(cfg, name: str) -> None:
    """Check that every field of a config holds a value of its annotated type, so that ``parse(str(cfg)) == cfg``.

    ``int`` is never a float or a bool; ``float`` is a finite number.

    Args:
        cfg: the config (``GPTQConfig``, ``AWQConfig``).
        name: its key in the spec text, for the error (``name:FIELD``)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not _fits(value, str(f.type)):
            raise OutlierscopeError(f"{name}:{f.name} needs {'a finite number' if f.type == 'float' else f'an {f.type}'}"
                                    f", got {value!r}")


def check_repeat(name: str, text: str, key: str, seen: dict) -> None:
    """Refuse a key given twice in ``name:text`` (the last would silently win).

    Args:
        name: the part's key.
        text: its text, for the error.
        key: the key read.
        seen: the keys read so far."""
    if key in seen:
        raise OutlierscopeError(f"{name}:{text} sets {key} twice; give each setting once")
