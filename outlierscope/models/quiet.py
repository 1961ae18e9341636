"""transformers' loading messages off for a block (loading, converting), restored after: nothing global is changed."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def quiet_transformers():
    """transformers' progress bars and info messages off while loading; the previous settings restored after."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # transformers imports torchao when it is installed (its quantizers): torchao's GPU-kernel and torch's pytree
    # warnings at import say nothing about this model
    others = {name: logging.getLogger(name).level for name in ("torchao", "torch.utils._pytree")}
    for name in others:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
        for name, lvl in others.items():
            logging.getLogger(name).setLevel(lvl)
