"""Objects as tensors and plain containers, for files read back with ``torch.load(weights_only=True)``.

``to_plain`` turns an object of an allowed class (and everything it holds) into dicts, lists, tuples, numbers,
strings and tensors; ``from_plain`` rebuilds it from exactly those, constructing only the classes it is given.
Nothing read back this way can run code: a file that holds anything else is refused by torch's loader.
"""

from __future__ import annotations

import torch

_OBJECT, _REF, _FROZENSET = "__object__", "__ref__", "__frozenset__"
_ATOMS = (type(None), bool, int, float, str)


def _state(obj) -> dict:
    """The attributes ``obj`` pickles (its class's own ``__getstate__`` where it has one)."""
    own = type(obj).__dict__.get("__getstate__") or next(
        (c.__dict__["__getstate__"] for c in type(obj).__mro__[1:-1] if "__getstate__" in c.__dict__), None)
    return own(obj) if own is not None else vars(obj)


def to_plain(obj, classes: tuple[type, ...]):
    """``obj`` as plain containers and tensors; instances of ``classes`` by name and attributes (an object met
    twice is stored once and referred to after).

    Args:
        obj: what to convert.
        classes: the classes whose instances may be stored.

    Raises:
        TypeError: for a value of any other type."""
    allowed = {c.__qualname__: c for c in classes}
    memo: dict[int, int] = {}

    def walk(x):
        if isinstance(x, _ATOMS) or isinstance(x, torch.Tensor):
            return x
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, frozenset):
            return {_FROZENSET: sorted(x)}
        if allowed.get(type(x).__qualname__) is not type(x):
            raise TypeError(f"cannot store a {type(x).__qualname__} as plain state; expected one of {sorted(allowed)}")
        if id(x) in memo:
            return {_REF: memo[id(x)]}
        memo[id(x)] = len(memo)
        return {_OBJECT: type(x).__qualname__, "id": memo[id(x)], "state": walk(dict(_state(x)))}

    return walk(obj)


def from_plain(data, classes: tuple[type, ...]):
    """The object ``to_plain`` stored, built from ``classes`` only.

    Args:
        data: what ``to_plain`` returned (as read back).
        classes: the classes that may be constructed.

    Raises:
        ValueError: for a class name not in ``classes`` or a reference to no stored object."""
    allowed = {c.__qualname__: c for c in classes}
    built: dict[int, object] = {}

    def walk(x):
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        if not isinstance(x, dict):
            return x
        if _FROZENSET in x:
            return frozenset(x[_FROZENSET])
        if _REF in x:
            if x[_REF] not in built:
                raise ValueError(f"a reference to stored object {x[_REF]}, which is not stored before it")
            return built[x[_REF]]
        if _OBJECT not in x:
            return {k: walk(v) for k, v in x.items()}
        cls = allowed.get(x[_OBJECT])
        if cls is None:
            raise ValueError(f"stored object of class {x[_OBJECT]!r}; expected one of {sorted(allowed)}")
        obj = cls.__new__(cls)
        built[x["id"]] = obj
        obj.__dict__.update(walk(x["state"]))
        return obj

    return walk(data)
