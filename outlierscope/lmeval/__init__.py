"""lm-evaluation-harness with our attention: a model type ``outlierscope`` for lm-eval 0.4.13.

    pip install "outlierscope[lmeval]"
    python -m outlierscope.lmeval --model outlierscope \
        --model_args pretrained=DIR,bits=4,granularity=per_tensor --tasks arc_easy

or in Python::

    import lm_eval
    from outlierscope.lmeval import OutlierscopeLM
    lm_eval.simple_evaluate(model=OutlierscopeLM("pair-tiny:diff", bits=4), tasks=["hellaswag_local"], ...)

``OutlierscopeLM`` is lm-eval's Hugging Face model (``HFLM``) whose
forwards and generations run inside ``quantize_model``; the model
comes from ``load_model`` (preset roles, HF directories, fetched
models). ``write_task_yamls`` writes task YAMLs that point lm-eval's
own tasks at the data ``outlierscope data fetch`` cached, for offline use.

Importing this package does not import lm-eval; the names below load it on first use and say how to
install it when it is missing.
"""

from __future__ import annotations

from outlierscope.errors import OutlierscopeError

LMEVAL_VERSION = "0.4.13"


def require_lmeval():
    """The ``lm_eval`` module, or a one-line error naming the extra to install."""
    try:
        import lm_eval
    except ImportError:
        raise OutlierscopeError(f"lm-evaluation-harness is not installed; pip install \"outlierscope[lmeval]\" "
                                f"(lm_eval[hf]=={LMEVAL_VERSION})") from None
    return lm_eval


def __getattr__(name: str):
    if name == "OutlierscopeLM":
        require_lmeval()
        from outlierscope.lmeval.adapter import OutlierscopeLM

        return OutlierscopeLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
