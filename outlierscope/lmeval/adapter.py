"""``OutlierscopeLM``: lm-eval's Hugging Face model with quantized attention logits (imports lm-eval).

Every forward (``_model_call``: loglikelihood, rolling loglikelihood) and every generation
(``_model_generate``: queries of length 1 against the growing key cache) runs inside
``quantize_model`` with the spec of ``model_args``; 16 bits goes
through the same attention function unquantized.

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings

import numpy as np
import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.models.float64 import float64_model
from outlierscope.models.loading import check_placement, num_layers
from outlierscope.quant.apply import check_layers, check_spec, quantize_model
from outlierscope.quant.specs.spec import QuantSpec, build_spec, parse_layers
from outlierscope.quant.weights.calibration import calibration_for


def make_spec(bits, format: str | None = None, granularity: str | None = None, layers=None) -> QuantSpec:
    """A ``QuantSpec`` of the paper's logits from lm-eval ``model_args`` values (strings or numbers).

    Args:
        bits: the width (16: unquantized).
        format: None: ``int``.
        granularity: None: ``per_tensor``.
        layers: ``0-3`` or ``0+2+5`` (lm-eval splits its arguments at commas); None: all."""
    bits = _as_int("bits", bits, "an integer number of bits (16 = unquantized)")
    return build_spec(bits, str(format or "int"), str(granularity or "per_tensor"), _layers(layers))


def attention_spec(quant: str, bits, layers, format=None, granularity=None) -> QuantSpec:
    """A recipe or spec text from ``model_args``, on some layers; not together with the logits' axis.

    Args:
        quant: a recipe name or spec text (``sage2-int4``; lists inside a spec take ``+``, lm-eval splits at commas).
        bits: must be 16 (``bits`` below 16 is the logits' axis, not a spec's).
        layers: only these layers; None: the spec's own.
        format: must be None (a spec says its own).
        granularity: must be None."""
    if _as_int("bits", bits, "an integer number of bits (16 = unquantized)") != 16:
        raise OutlierscopeError("pass bits (the logits' bit width) or quant (a recipe or spec), not both")
    given = [f"{k}={v}" for k, v in (("format", format), ("granularity", granularity)) if v is not None]
    if given:
        raise OutlierscopeError(f"{' and '.join(given)} describe the logits' axis (bits), not quant={quant}: a spec "
                                "says its own format and granularity (e.g. quant=k=int4/per_token); leave them out")
    spec = QuantSpec.parse(str(quant))
    return spec if layers is None else spec.with_layers(_layers(layers))


def _layers(layers) -> tuple[int, ...] | None:
    try:
        if layers is not None and not isinstance(layers, (tuple, list)):
            layers = parse_layers(str(layers).replace("+", ","))
    except ValueError as e:
        raise OutlierscopeError(str(e)) from None
    return tuple(layers) if layers is not None else None


def _as_int(name: str, value, expected: str) -> int:
    """An lm-eval ``model_args`` value (a string from the command line, or a number) as an int, or a one-line error."""
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ParamError(name, expected, value) from None


def _device(device) -> str:
    """lm-eval's default device is ``cuda:0`` whether or not there is a GPU, and its own ``hf`` model then falls back
    to the CPU; we do the same (with a warning) instead of refusing. Any other device is passed on as asked."""
    device = str(device or "auto")
    if device == "cuda:0" and not torch.cuda.is_available():
        warnings.warn("lm-eval asked for device cuda:0 (its default) but torch sees no CUDA GPU: running on the CPU",
                      stacklevel=3)
        return "cpu"
    return device


def model_args_spec(bits=16, format: str | None = None, granularity: str | None = None, layers=None, quant=None,
                    attn_block=None, dtype: str = "auto", device_map=None, **_) -> tuple:
    """The spec and attention block rows of the adapter's ``model_args``, checked without a model.

    What ``python -m outlierscope.lmeval`` checks before lm-eval indexes its tasks.

    Args:
        bits: the logits' width (16: unquantized).
        format: the logits' format.
        granularity: the logits' granularity.
        layers: the layers quantized.
        quant: a recipe or spec instead (empty is an error, not "unquantized").
        attn_block: query rows per attention block.
        dtype: the model's dtype.
        device_map: accelerate's placement.
        **_: the other ``model_args`` (checked by lm-eval)."""
    spec = make_spec(bits, format, granularity, layers)
    if quant is not None and str(quant).strip() in ("", "None"):
        raise ParamError("quant", "a recipe name (see `outlierscope recipes`), or leave quant out for bits/format/"
                         "granularity (bits=16: unquantized)", quant)
    if quant is not None:
        spec = attention_spec(quant, bits, layers, format, granularity)
    block = None if attn_block in (None, "", "None") else \
        _as_int("attn_block", attn_block, "a positive number of query rows")
    check_placement("auto", str(dtype), device_map, block)
    return spec, block


def _key(tokens) -> bytes:
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


@register_model("outlierscope")
class OutlierscopeLM(HFLM):
    """lm-eval's ``hf`` model, loaded by ``load_model``, with quantized attention (``--model outlierscope``).

    A spec with SmoothQuant or static scales runs its calibration pass once, when the model loads.

    Args:
        pretrained: a Hub id (``ORG/NAME[@REVISION]``), a model directory, a ``.gguf`` file, a preset role or a fetched
            model.
        bits: the logits' width (16: unquantized).
        format: the logits' format; None: ``int``.
        granularity: the logits' granularity; None: ``per_tensor``.
        layers: the layers quantized; None: all.
        attn_block: query rows per attention block.
        dtype: as in ``load_model``.
        device: as in ``load_model``.
        device_map: as in ``load_model``.
        points: also stream these observation points of every forward into ``reducers`` (Python only), after
            quantization: the reducers see what the model uses.
        reducers: the reducers of ``points``.
        trust_remote_code: as in ``load_model``.
        quant: a recipe or spec instead of the logits' axis (``quant=sage2-int4``, ``quant=w8a8``).
        **kwargs: ``HFLM``'s (``batch_size``, ``max_length``, ...)."""

    def __init__(self, pretrained, bits=16, format: str | None = None, granularity: str | None = None, layers=None,
                 attn_block: int | None = None, dtype: str = "auto", device: str | None = "auto",
                 device_map: str | None = None, points=None, reducers=None, trust_remote_code: bool = False,
                 quant: str | None = None, **kwargs):
        from outlierscope.models.loading import load_model

        # checked before the model loads
        self.quant, self.attn_block = model_args_spec(bits, format, granularity, layers, quant, attn_block, dtype,
                                                      device_map)
        lm = load_model(str(pretrained), dtype=str(dtype), device=_device(device), device_map=device_map,
                        trust_remote_code=str(trust_remote_code).lower() in ("true", "1"))
        n_layers = num_layers(lm.model.config)
        check_layers(self.quant, n_layers)  # now, not at the first forward
        check_spec(self.quant, lm.model.config)
        if max(_layers(layers) or (0,)) >= n_layers:  # at 16 bits too: a typo is not silently ignored
            raise OutlierscopeError(f"layers {layers} out of range: the model has layers 0..{n_layers - 1}")
        self.spec_name = str(pretrained)
        self.calibration = calibration_for(lm.model, lm.tokenizer, self.quant)  # SmoothQuant / static scales: once, before any request
        if bool(points) != bool(reducers):
            raise OutlierscopeError("points and reducers go together: pass both (observation points and the reducers "
                                    "that receive them) or neither")
        self.points, self.reducers = list(points or []), list(reducers or [])
        self._inputs: set[bytes] | None = None
        super().__init__(pretrained=lm.model, tokenizer=lm.tokenizer, backend="causal", **kwargs)

    @contextlib.contextmanager
    def _attention(self):
        from outlierscope.hooks.capture import capture

        with quantize_model(self.model, self.quant, block_rows=self.attn_block, calibration=self.calibration), (
                capture(self.model, self.points, reducers=self.reducers, block_rows=self.attn_block)
                if self.reducers else contextlib.nullcontext()):
            yield

    def _loglikelihood_tokens(self, requests, *args, **kwargs):
        """lm-eval's, with every input indexed first so that ``_model_call`` can mask the padding."""
        self._inputs = {_key((ctx + cont)[-(self.max_length + 1):][:-1]) for _, ctx, cont in requests}
        try:
            return super()._loglikelihood_tokens(requests, *args, **kwargs)
        finally:
            self._inputs = None

    def _padding_mask(self, inps: torch.Tensor) -> torch.Tensor:
        """(B, T) mask of each row's real tokens: the longest indexed prefix, followed only by zeros."""
        mask = torch.zeros_like(inps)
        for i, row in enumerate(inps.tolist()):
            end = len(row)
            while end > 0 and row[end - 1] == 0:  # zeros: lm-eval's right padding, or real tokens with id 0
                end -= 1
            n = next((k for k in range(len(row), max(end, 1) - 1, -1) if _key(row[:k]) in self._inputs), None)
            if n is None:
                raise OutlierscopeError("an lm-eval input row matches none of its requests; the adapter cannot tell "
                                        "its padding (please report this with the task name)")
            mask[i, :n] = 1
        return mask

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        with self._attention(), float64_model(self.model):
            if self._inputs is None or attn_mask is not None or labels is not None:
                return super()._model_call(inps, attn_mask, labels)
            mask = self._padding_mask(inps)
            with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                                 enabled=self.mixed_precision_dtype is not None):
                return self.model(input_ids=inps, attention_mask=mask).logits  # (B, T, V)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        with self._attention(), float64_model(self.model):
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
