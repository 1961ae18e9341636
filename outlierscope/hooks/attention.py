"""An attention function for transformers' ``AttentionInterface`` that exposes the logits.

No forward is monkey-patched: inside :func:`attention_stages` a model is switched (with
``set_attn_implementation``) to a uniquely named attention function, registered together
with a boolean mask function in ``AttentionMaskInterface``; both are unregistered and the
original implementation is restored in ``finally``.

The function computes, per layer::

    logits = (query @ repeat_kv(key)^T) * scaling      # (B, H, T, S), fp32 accumulate as eager
    for stage in stages: logits = stage(ctx, logits)    # observe and/or quantize, in entry order
    logits = softcap * tanh(logits / softcap)           # only for models with logit soft-capping
    probs  = softmax(where(allowed, logits, min), float32)
    out    = probs @ repeat_kv(value)

Stages see the logits after scaling and before soft-capping and masking, with ``valid``: the
entries the mask allows (causal, not padding, inside a sliding window) in the rows of real
(non-padding) queries. The softmax uses ``allowed``, the model's own mask, so a padding query row
attends as in eager attention; padding rows are never observed, never enter a quantization scale,
and are never scored. With no stage the output equals transformers' eager attention everywhere,
padding positions included. DiffLlama calls the function twice per layer
with the same query and key (once per half of the value); the second call reuses the
probabilities of the first, so stages run once per layer.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.points import decoder_layers

# kwargs transformers passes for bookkeeping; they do not change the attention arithmetic
_IGNORED_KWARGS = {
    "position_ids", "use_cache", "cache_position", "output_attentions", "output_hidden_states",
    "num_items_in_batch", "is_causal", "sliding_window", "layer_idx", "cache", "past_key_values",
    "return_dict", "position_embeddings",
}
_PREFIX = "outlierscope-"
_counter = itertools.count()


@dataclass
class LogitContext:
    """What a stage learns about the logits it gets."""

    module: nn.Module
    layer: int
    valid: torch.Tensor  # (B, 1 or H, T, S) bool: causal, not padding, inside the window
    n_heads: int
    is_diff: bool


Stage = Callable[[LogitContext, torch.Tensor], torch.Tensor]
"""Gets the logits (B, H, T, S), returns them or a new tensor. It must not modify its input. A stage that
passes the tensor on to user code sets ``stage.observes = True``; otherwise the attention function may
reuse the tensor's memory after the stages (masking in place)."""


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)  # (B, H, S, d)


def _bool_mask(*args, **kwargs):
    """``sdpa_mask`` that always materialises the boolean mask (never skips it for ``is_causal``)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _allowed_and_valid(mask: torch.Tensor | None, q_len: int, k_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Booleans (B, 1|H, T, S): ``allowed`` by the model's mask, and ``valid`` = allowed *and* in a
    non-padding query row (the entries that are observed and quantized).

    transformers' masks only hide padding keys; a padding query (right padding) still sees the real
    keys. A token always attends to itself unless it is padding, so the mask's diagonal (offset
    S - T, as with a cache) marks the real queries.
    """
    if mask is None:  # no mask given: plain causal (aligned to the end, as with a cache)
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)[None, None]
        return causal, causal
    allowed = mask[..., :k_len] if mask.dtype == torch.bool else mask[..., :k_len] == 0  # float: 0 where allowed
    own = torch.diagonal(allowed, offset=k_len - q_len, dim1=-2, dim2=-1)  # (B, 1|H, T)
    return allowed, allowed & own[..., None]


class _AttentionFunction:
    """The registered callable: one per active stack of stages."""

    def __init__(self, model: nn.Module, stages: tuple[Stage, ...]):
        self.model_name = type(model).__name__
        self.stages = stages
        self.exposes = any(getattr(st, "observes", False) for st in stages)
        self.layer_of = {id(layer_mod): i for i, layer in enumerate(decoder_layers(model)) for layer_mod in layer.modules()}
        self.is_diff = model.config.model_type == "diffllama"
        self._memo: tuple | None = None  # (module, query, key, probs) of the last call, for DiffLlama's second call
        self._mask_memo: tuple | None = None  # (mask, (T, S), valid, masked) of the last mask seen

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                 position_bias=None, **kwargs):
        unknown = [k for k, v in kwargs.items() if k not in _IGNORED_KWARGS and v is not None and v is not False]
        if position_bias is not None:
            unknown.append("position_bias")
        if dropout and module.training:
            unknown.append(f"dropout={dropout}")
        if unknown:
            raise OutlierscopeError(
                f"{self.model_name}: the outlierscope attention function does not support {', '.join(sorted(unknown))}; "
                "its logits would be computed wrongly, so this model cannot be observed or quantized"
            )
        memo = self._memo
        if memo is not None and memo[0] is module and memo[1] is query and memo[2] is key:
            probs = memo[3]  # DiffLlama's second call: same logits, stages already ran
        else:
            probs = self._probs(module, query, key, attention_mask, scaling, softcap)
            self._memo = (module, query, key, probs) if self.is_diff else None
        v = _repeat_kv(value, query.shape[1] // value.shape[1])  # (B, H, S, d)
        out = torch.matmul(probs, v)  # (B, H, T, d)
        return out.transpose(1, 2).contiguous(), None  # (B, T, H, d)

    def _probs(self, module, query, key, attention_mask, scaling, softcap):
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        k = _repeat_kv(key, query.shape[1] // key.shape[1])  # (B, H, S, d)
        logits = torch.matmul(query, k.transpose(2, 3)).mul_(scaling)  # (B, H, T, S); same rounding as eager's `* scaling`
        valid, masked = self._valid(attention_mask, logits.shape[2], logits.shape[3], logits.device)
        layer = self.layer_of.get(id(module))
        if layer is None:
            raise OutlierscopeError(f"{self.model_name}: attention module {type(module).__name__} is not inside a decoder layer")
        ctx = LogitContext(module, layer, valid, logits.shape[1], self.is_diff)
        for stage in self.stages:
            logits = stage(ctx, logits)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        fill = torch.finfo(logits.dtype).min
        # In place only when no stage handed the tensor to user code, which may keep it (e.g. `reducers=seen.append`).
        logits = logits.masked_fill(masked, fill) if self.exposes else logits.masked_fill_(masked, fill)
        return torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)

    def _valid(self, attention_mask, q_len: int, k_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid, ~allowed) of a mask, computed once per forward (every layer gets the same mask object)."""
        key = self._mask_memo
        if key is not None and key[0] is attention_mask and key[1] == (q_len, k_len):
            return key[2], key[3]
        allowed, valid = _allowed_and_valid(attention_mask, q_len, k_len, device)
        self._mask_memo = (attention_mask, (q_len, k_len), valid, ~allowed)
        return valid, self._mask_memo[3]


def _switch(model: nn.Module, name: str) -> None:
    """``set_attn_implementation``, past the ``_supports_attention_backend`` check of models that lack the flag."""
    flag = "_supports_attention_backend"
    cls = type(model)
    if getattr(cls, flag, True) is False:
        setattr(model, flag, True)  # instance attribute only; the class is never touched
        try:
            model.set_attn_implementation(name)
        finally:
            delattr(model, flag)
    else:
        model.set_attn_implementation(name)


def _current_function(model: nn.Module):
    from transformers import AttentionInterface

    name = model.config._attn_implementation
    if name and name.startswith(_PREFIX):
        return AttentionInterface._global_mapping[name]
    return None


@contextlib.contextmanager
def attention_stages(model: nn.Module, stage: Stage) -> Iterator[None]:
    """Run ``model`` with its attention through our function, ``stage`` added after any active ones."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    # Not `_supports_attention_backend`: some models (StableLM) lack the flag yet route attention through the
    # interface; whether the switch took is checked below, and layers that bypass it raise in our function.
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise OutlierscopeError(
            f"{type(model).__name__} does not route its attention through transformers' AttentionInterface; "
            "its attention logits cannot be observed or quantized"
        )
    previous = model.config._attn_implementation
    outer = _current_function(model)
    fn = _AttentionFunction(model, (*(outer.stages if outer else ()), stage))
    name = f"{_PREFIX}{next(_counter)}"
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, _bool_mask)
    try:
        _switch(model, name)
        if model.config._attn_implementation != name:
            raise OutlierscopeError(f"{type(model).__name__} refused a custom attention implementation; its logits cannot be observed")
        yield
    finally:
        try:
            _switch(model, previous)
        finally:
            AttentionInterface._global_mapping.pop(name, None)
            AttentionMaskInterface._global_mapping.pop(name, None)
