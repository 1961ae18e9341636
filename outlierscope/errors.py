"""The exceptions that the CLI turns into a one-line message and a non-zero exit."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator


class OutlierscopeError(Exception):
    """A user-facing error: the message names the problem and the fix, on one line."""


class ParamError(OutlierscopeError, ValueError):
    """A bad value of one Python parameter: ``f"{param} must be {expected}, got {got!r}"``.

    Library code names the parameter; the CLI re-renders the message with its flag (``renamed``).

    Args:
        param: the parameter's name.
        expected: what it must be.
        got: the value received.
        hint: the fix, where the message alone does not say it."""

    def __init__(self, param: str, expected: str, got, hint: str = ""):
        self.param, self.expected, self.got, self.hint = param, expected, got, hint
        super().__init__(self.render(param))

    def render(self, name: str) -> str:
        """The message with the parameter called ``name``.

        Args:
            name: how the caller spells the parameter."""
        return f"{name} must be {self.expected}, got {self.got!r}" + (f"; {self.hint}" if self.hint else "")

    def renamed(self, names: dict[str, str]) -> str:
        """The message with the parameter called as in ``names``.

        Args:
            names: parameter -> its name for the caller (``{"batch_size": "--batch-size"}``)."""
        return self.render(names.get(self.param, self.param))


class Refused(OutlierscopeError):
    """A refusal one Python parameter overrides: the library says ``param=True``, the CLI its flag (``--force``).

    Args:
        template: the message, with ``{fix}`` where the override is named.
        param: the parameter that overrides it."""

    def __init__(self, template: str, param: str = "force"):
        self.template, self.param = template, param
        super().__init__(template.replace("{fix}", f"pass {param}=True"))

    def renamed(self, names: dict[str, str]) -> str:
        """The message with the override called as in ``names``.

        Args:
            names: parameter -> its name for the caller (``{"force": "--force"}``)."""
        return self.template.replace("{fix}", f"pass {names.get(self.param, self.param)}")


SEED_LIMIT = 2**32  # numpy's seeds: 0 <= seed < 2**32


def check_seed(seed, name: str = "seed") -> None:
    """Check a seed numpy and torch both take: an int in [0, 2**32).

    Args:
        seed: the seed.
        name: the parameter's name, for the error.

    Raises:
        ParamError: naming ``name``."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < SEED_LIMIT:
        raise ParamError(name, f"an integer from 0 to {SEED_LIMIT - 1}", seed)


def lookup(registry: dict, name: str, what: str):
    """A registry's entry by name, or a one-line error listing the names, with "did you mean" for near misses.

    Args:
        registry: name -> entry.
        name: the name.
        what: what the registry holds, for the error."""
    if name in registry:
        return registry[name]
    import difflib

    close = difflib.get_close_matches(name, list(registry), n=3, cutoff=0.4)
    raise OutlierscopeError(f"unknown {what} {name!r}: expected one of {', '.join(registry)}"
                            + (f"; did you mean {', '.join(close)}?" if close else ""))


@contextlib.contextmanager
def warnings_to(log: Callable[[str], object]) -> Iterator[None]:
    """Within the block, a warning that outlierscope's own code raises (not a deprecation) is one line of ``log``,
    ``warning: ...``, each message once; any other warning is shown as before.

    Args:
        log: the run's log (the CLI's: standard output)."""
    import warnings

    previous, said = warnings.showwarning, set()
    own = f"{os.sep}outlierscope{os.sep}"

    def show(message, category, filename, lineno, file=None, line=None):
        if own in str(filename) and not issubclass(category, DeprecationWarning):
            text = f"warning: {str(message).removeprefix('outlierscope: ')}"
            if text not in said:
                said.add(text)
                log(text)
        else:
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous
