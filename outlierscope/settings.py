"""Fields of the run settings dataclasses, with what a command line needs to know about them.

Each setting of ``ProfileSettings``, ``SweepSettings``, ``SensitivitySettings``
and ``ReproduceSettings`` is declared once, with ``option``: its default, a help string and, where needed,
its choices, its flag's spelling and how a command-line string becomes the value. ``outlierscope.cli``
derives each run command's flags from these fields (``cli_options``), so a new setting is one line in
one place and the library and the command line cannot disagree::

    @dataclass(frozen=True)
    class SweepSettings:
        bits: tuple[int, ...] = option((16, 8, 6, 4), "bit widths; 16 = unquantized")
        layers: tuple[int, ...] | None = option(None, "quantize only these layers, e.g. 0-3 or 0,2", parse=parse_layers)

Flags: ``--field-name``; a bool that defaults to True becomes ``--no-field-name``; a tuple takes several
values (``nargs="+"``), or repeats (``--task A --task B``) with ``repeat=True``; ``exclusive`` names a group
of flags of which one may be given.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass


def option(default, help: str, *, flag: str | None = None, choices=None, metavar: str | None = None,
           repeat: bool = False, parse: Callable[[str], object] | None = None, exclusive: str | None = None):
    """A settings field with its command-line description; the CLI flag is derived from it.

    Args:
        default: the field's default (``MISSING``: required).
        help: the flag's help, and the field's documentation.
        flag: the flag; None: ``--`` and the field's name with dashes (``--no-`` for a bool that defaults to True).
        choices: the values it takes.
        metavar: the value's name in the help.
        repeat: a list given by repeating the flag (else: several values after one flag).
        parse: turns the command-line text into the field's value.
        exclusive: a group of flags of which at most one may be given."""
    meta = {"help": help, "flag": flag, "choices": tuple(choices) if choices is not None else None, "metavar": metavar,
            "repeat": repeat, "parse": parse, "exclusive": exclusive}
    return dataclasses.field(default=default, metadata={"cli": meta})


def check_defaults(settings, names, why: str) -> None:
    """Refuse a setting that would be silently unused: each named field must be at its default.

    Args:
        settings: the frozen settings.
        names: the fields.
        why: what the settings measure instead, for the error.

    Raises:
        ParamError: naming the first field that is not at its default."""
    from outlierscope.errors import ParamError

    defaults = {f.name: f.default for f in dataclasses.fields(settings)}
    for name in names:
        if getattr(settings, name) != defaults[name]:
            raise ParamError(name, f"its default {defaults[name]!r} {why}", getattr(settings, name))


@dataclass(frozen=True)
class CliOption:
    """How one settings field appears on the command line.

    Attributes:
        name: the field, also the argparse ``dest``.
        flag: its flag.
        kind: ``flag`` (a bool), ``list`` (a tuple) or ``value``.
        type: the type of one value as parsed.
        default: the field's default.
        help: the help text.
        choices: the values it takes.
        metavar: the value's name in the help.
        repeat: a list given by repeating the flag.
        parse: turns the command-line text into the field's value.
        exclusive: its group of mutually exclusive flags."""

    name: str
    flag: str
    kind: str
    type: type
    default: object
    help: str
    choices: tuple | None
    metavar: str | None
    repeat: bool
    parse: Callable | None
    exclusive: str | None


def _base(hint) -> tuple[str, type]:
    """(kind, element type) of a field's type hint: ``int | None`` -> value int, ``tuple[str, ...]`` -> list str."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    if hint is bool:
        return "flag", bool
    if typing.get_origin(hint) is tuple:
        return "list", typing.get_args(hint)[0]
    return "value", hint if isinstance(hint, type) else str


def cli_options(cls) -> list[CliOption]:
    """The command-line options of a settings dataclass, in field order (the fields declared with ``option``).

    Args:
        cls: the settings class."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        m = f.metadata.get("cli")
        if m is None:
            continue
        kind, base = _base(hints[f.name])
        if kind == "flag" and f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: a bool setting needs a default")
        flag = m["flag"] or ("--no-" if kind == "flag" and f.default is True else "--") + f.name.replace("_", "-")
        out.append(CliOption(f.name, flag, kind, base, f.default, m["help"], m["choices"], m["metavar"], m["repeat"],
                             m["parse"], m["exclusive"]))
    return out


def from_cli(cls, values: dict, **extra):
    """Settings from parsed command-line values; a ``parse`` function's ``ValueError`` is raised as it is.

    Args:
        cls: the settings class.
        values: parsed values by field name (None: not given, the field's default).
        **extra: values that override."""
    kw = {}
    for o in cli_options(cls):
        v = values.get(o.name)
        if v is None:
            continue
        if o.parse is not None:
            v = o.parse(v)
        elif o.kind == "list":
            v = tuple(v)
        kw[o.name] = v
    return cls(**{**kw, **extra})
