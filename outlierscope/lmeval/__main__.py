"""``python -m outlierscope.lmeval ARGS``: lm-eval's own command line with one more model type, ``outlierscope``."""

from __future__ import annotations

import sys


def main() -> None:
    from outlierscope.errors import OutlierscopeError
    from outlierscope.lmeval import require_lmeval

    try:
        require_lmeval()
    except OutlierscopeError as e:
        sys.exit(f"outlierscope: error: {e}")
    from lm_eval.__main__ import cli_evaluate

    import outlierscope.lmeval.adapter  # noqa: F401  (registers the model type)

    try:
        cli_evaluate()
    except OutlierscopeError as e:  # our model_args and model loading: one line, as in `outlierscope`
        sys.exit(f"outlierscope: error: {e}")


if __name__ == "__main__":
    main()
