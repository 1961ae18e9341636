"""Old module paths of ``outlierscope.quant`` (before the sub-packages, #65): each still imports, for one release,
with a DeprecationWarning at the importer's line naming the new path."""

from __future__ import annotations

import importlib
import sys
import warnings

REMOVED_IN = "0.2"


def _importer_level(shim: str) -> int:
    """The ``stacklevel`` that points at the user's import line: past this module and the shim ``shim`` (the import
    machinery's frames in between are walked past and, as ``warnings.warn`` skips them itself, not counted; so is
    ``importlib.import_module``, which is counted)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib")
                                 or frame.f_globals.get("__name__") in (__name__, shim, "importlib")):
        if not frame.f_code.co_filename.startswith("<frozen importlib"):
            level += 1
        frame = frame.f_back
    return level


def moved(old: str, new: str) -> None:
    """Make module ``old`` the module ``new`` (the same object: its private names and patches too), warning once per
    import of the old path."""
    warnings.warn(f"{old} moved to {new}; the old path goes in {REMOVED_IN}", DeprecationWarning,
                  stacklevel=_importer_level(old))
    sys.modules[old] = importlib.import_module(new)
