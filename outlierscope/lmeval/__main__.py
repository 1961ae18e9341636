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

    from outlierscope.lmeval.adapter import model_args_spec  # also registers the model type

    try:
        own = _own_model_args(sys.argv[1:])
        if own is not None:  # before lm-eval indexes its tasks (about a minute)
            model_args_spec(**own)
            if "pretrained" in own:
                from outlierscope.models.loading import check_model

                check_model(str(own["pretrained"]), str(own.get("trust_remote_code")).lower() in ("true", "1"))
        cli_evaluate()
    except OutlierscopeError as e:  # our model_args and model loading: one line, as in `outlierscope`
        sys.exit(f"outlierscope: error: {e}")
    except ValueError as e:
        if str(e).startswith("Tasks not found"):  # lm-eval's own message, raised as a traceback
            sys.exit(f"outlierscope: error: lm-eval: {e}; list its tasks with `lm-eval ls tasks`, or pass --include_path "
                     "DIR with the YAMLs of `outlierscope tasks lmeval-yaml --out DIR`")
        raise


def _own_model_args(argv: list[str]) -> dict | None:
    """The ``--model_args`` of ``--model outlierscope`` (lm-eval's ``k=v,k=v`` form), else None."""
    from lm_eval.utils import simple_parse_args_string

    def value(flag: str) -> str | None:
        for i, a in enumerate(argv):
            if a == flag and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    if value("--model") != "outlierscope":
        return None
    text = value("--model_args") or ""
    if text.lstrip().startswith("{"):  # lm-eval also takes a JSON object
        import json

        try:
            return json.loads(text)
        except ValueError:
            return None  # lm-eval's own parser says what is wrong
    return simple_parse_args_string(text)


if __name__ == "__main__":
    main()
