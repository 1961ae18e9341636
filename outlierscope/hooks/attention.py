"""An attention function for transformers' ``AttentionInterface`` that exposes the logits.

No forward is monkey-patched: inside ``attention_stages`` a model is switched (with
``set_attn_implementation``) to a uniquely named attention function, registered together
with a boolean mask function in ``AttentionMaskInterface``; both are unregistered and the
original implementation is restored in ``finally``.

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.hooks.points import decoder_layers

# kwargs transformers passes for bookkeeping; they do not change the attention arithmetic
_IGNORED_KWARGS = {
    "position_ids", "use_cache", "cache_position", "output_attentions", "output_hidden_states",
    "num_items_in_batch", "is_causal", "sliding_window", "layer_idx", "cache", "past_key_values",
    "return_dict", "position_embeddings",
}
_PREFIX = "outlierscope-"


@dataclass
class LogitContext:
    """What a stage learns about the logits it gets.

    Attributes:
        module: the attention module.
        layer: its decoder layer.
        valid: bool ``(B, 1|H, T, S)``: causal, not padding, inside the window.
        n_heads: the logits' heads.
        is_diff: a DiffLlama call (both maps of each differential head in one tensor).
        q_start: the block's first query row among the call's ``q_total`` rows.
        q_total: the call's query rows; None: this block is all of them.
        state: Stage -> its reduction over all blocks; None when there is one block.
        value: the call's values ``(B, H, S, d)``, repeated per query head.
        scaling: the call's logit scale (the logits are ``(q @ k^T) * scaling``).
        softcap: the model's logit soft cap, applied after the stages.
        key_start: ``(B,)`` each sequence's first real key (left padding; blocks along keys start there)."""

    module: nn.Module
    layer: int
    valid: torch.Tensor
    n_heads: int
    is_diff: bool
    q_start: int = 0
    q_total: int | None = None
    state: dict | None = None
    value: torch.Tensor | None = None
    scaling: float = 1.0
    softcap: float | None = None
    key_start: torch.Tensor | None = None

    @property
    def query_offset(self) -> int:
        """Key position of the block's first query row (queries are aligned to the end of the keys)."""
        total = self.q_total if self.q_total is not None else self.valid.shape[-2]
        return self.q_start + self.valid.shape[-1] - total

    def reduced(self, stage: Stage) -> torch.Tensor | None:
        """``stage.reduce`` over all blocks of rows of this call (elementwise max).

        Args:
            stage: the stage.

        Returns:
            The reduction; None when the call is one block (the stage reduces its own logits) or nothing was reduced."""
        return None if self.state is None else self.state.get(stage)


@dataclass(eq=False, frozen=True)
class Stage:
    """One step of the attention function, run on every block of logits ``(B, H, t, S)`` in the order stages were added.

    Stages are compared by identity (each is a key of ``ctx.state``).

    Attributes:
        apply: ``apply(ctx, logits)``: the logits or a new tensor, never its input changed; deterministic (a block may
            be recomputed and applied again).
        observes: it hands the tensor to user code (returning its input unchanged); run once per layer, not again in
            DiffLlama's second call.
        keeps: that user code may keep the tensor past its call, so it is never masked in place (a copy of every
            block); False for code that only reduces it (the library's reducers).
        reduce: ``reduce(ctx, logits)``: a block's reduction for a stage that needs one over all query rows (an absmax
            per head or per tensor), None for a layer it leaves alone; the stage reads the max as ``ctx.reduced(self)``.
        name: a name for errors.
        taps: the kinds of ``Tap`` it asks for (``attn.q``, ``attn.probs`` ...).
        tap: receives each ``Tap`` of those kinds.
        qkv: ``qkv(ctx, query, key, value)``: the ``QKV`` the logits are computed from (quantized q/k/v).
        probs: ``probs(ctx, p)``: the probabilities the values are multiplied with (quantized P)."""

    apply: Callable[[LogitContext, torch.Tensor], torch.Tensor]
    observes: bool = False
    keeps: bool = True
    reduce: Callable[[LogitContext, torch.Tensor], torch.Tensor | None] | None = None
    name: str = "stage"
    taps: frozenset[str] = frozenset()
    tap: Callable[[Tap], None] | None = None
    qkv: Callable[[QKVContext, torch.Tensor, torch.Tensor, torch.Tensor], QKV] | None = None
    probs: Callable[[LogitContext, torch.Tensor], torch.Tensor] | None = None


@dataclass
class QKVContext:
    """What a stage's ``qkv`` learns about a call.

    Attributes:
        module: the attention module.
        layer: its decoder layer.
        q_valid: bool ``(B, T)``: the real query rows.
        k_valid: bool ``(B, S)``: the keys a real query may attend to.
        second: DiffLlama's second call of the layer (same query and key, the other half of the values)."""

    module: nn.Module
    layer: int
    q_valid: torch.Tensor
    k_valid: torch.Tensor
    second: bool = False


@dataclass
class QKV:
    """A stage's ``qkv`` result.

    ``(q_mean @ k_for_mean^T) * scaling`` is added to the logits in full precision (SageAttention2's Q-smoothing
    correction).

    Attributes:
        query: ``(B, H, T, d)``.
        key: ``(B, KV, S, d)``.
        value: ``(B, KV, S, d)``.
        q_mean: ``(B, H, T, d)``, the smoothing's mean; None: no correction.
        k_for_mean: ``(B, KV, S, d)``, the keys it multiplies."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    q_mean: torch.Tensor | None = None
    k_for_mean: torch.Tensor | None = None


@dataclass
class Tap:
    """A tensor the attention function hands to a stage that asked for its kind (``Stage.taps``).

    Attributes:
        layer: the decoder layer.
        kind: ``attn.q`` / ``attn.k`` / ``attn.v`` (``(B, T, heads * head_dim)``, keys and values before their heads
            are repeated), ``attn.probs`` (a block ``(B, H, t, S)``) or ``attn.probs_diff`` (``p1 - lambda p2``,
            ``(B, H/2, t, S)``, float32 at least).
        x: the tensor.
        valid: q: the real query rows ``(B, T)``; k, v: the keys a real query may attend to; maps: as the logits'.
        n_heads: its heads.
        query_offset: the key position of the first query row.
        is_diff: a DiffLlama call."""

    layer: int
    kind: str
    x: torch.Tensor
    valid: torch.Tensor
    n_heads: int
    query_offset: int = 0
    is_diff: bool = False


def as_stage(stage: Stage | Callable) -> Stage:
    """A ``Stage``; a plain ``f(ctx, logits)`` is a non-observing stage without a reduction.

    Args:
        stage: a ``Stage`` or a function."""
    return stage if isinstance(stage, Stage) else Stage(apply=stage, name=getattr(stage, "__name__", "stage"))

BLOCK_BYTES = 256 * 2**20  # default budget of one block's float32 logits (B, H, t, S)


def block_rows(batch: int, heads: int, keys: int, block_bytes: int = BLOCK_BYTES) -> int:
    """Query rows per block so that one block's float32 logits ``(B, H, rows, S)`` stay within a budget.

    Args:
        batch: B.
        heads: H.
        keys: S.
        block_bytes: the budget."""
    return max(1, block_bytes // (4 * batch * heads * max(keys, 1)))


def attention_logits(q: torch.Tensor, key_t: torch.Tensor, scaling: float, q_mean: torch.Tensor | None = None,
                     k_mean_t: torch.Tensor | None = None) -> torch.Tensor:
    """``(q @ key_t) * scaling`` in key_t's dtype (float32 at least), plus SageAttention2's correction where given.

    Args:
        q: queries ``(B, H, t, d)``.
        key_t: keys repeated per query head, transposed: ``(B, H, d, S)``.
        scaling: the logit scale.
        q_mean: ``(B, H, t, d)``: adds ``(q_mean @ k_mean_t) * scaling`` in full precision.
        k_mean_t: the keys it multiplies, ``(B, H, d, S)``."""
    if q.dtype != key_t.dtype:
        q = q.float()
    logits = torch.matmul(q, key_t).mul_(scaling)  # (B, H, t, S); same rounding as eager's `* scaling`
    if q_mean is not None:
        logits += torch.matmul(q_mean.to(logits.dtype), k_mean_t.to(logits.dtype)) * scaling
    return logits


def repeat_kv_t(key: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys repeated for the query heads, float32 at least, transposed: ``(B, H, d, S)``.

    Args:
        key: ``(B, KV, S, d)``.
        heads: the query heads H."""
    k = repeat_kv(key, heads // key.shape[1])  # (B, H, S, d)
    return (k if k.dtype in (torch.float32, torch.float64) else k.float()).transpose(2, 3)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Keys or values repeated for grouped-query attention: ``(B, KV * n_rep, S, d)`` (transformers' ``repeat_kv``).

    Args:
        x: ``(B, KV, S, d)``.
        n_rep: query heads per key/value head."""
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


def _allowed_and_valid(mask: torch.Tensor | None, q_len: int, k_len: int, device, t0: int = 0,
                       t1: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Booleans (B, 1|H, t1-t0, S) for query rows [t0, t1): ``allowed`` by the model's mask, and
    ``valid`` = allowed *and* in a non-padding query row (the entries that are observed and quantized).

    transformers' masks only hide padding keys; a padding query (right padding) still sees the real
    keys. A token always attends to itself unless it is padding, so the mask's diagonal (offset
    S - T, as with a cache) marks the real queries.
    """
    t1 = q_len if t1 is None else t1
    shift = k_len - q_len + t0  # key position of row t0
    if mask is None:  # no mask given: plain causal (aligned to the end, as with a cache)
        causal = torch.ones(t1 - t0, k_len, dtype=torch.bool, device=device).tril(shift)[None, None]  # (1, 1, t, S)
        return causal, causal
    m = mask[..., t0:t1, :k_len]
    allowed = m if m.dtype == torch.bool else m == 0  # float: 0 where allowed
    own = torch.diagonal(allowed, offset=shift, dim1=-2, dim2=-1)  # (B, 1|H, t)
    return allowed, allowed & own[..., None]


def _token_valid(mask: torch.Tensor | None, B: int, T: int, S: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) real query rows (the mask's diagonal, offset S - T) and (B, S) keys that some query may attend to."""
    if mask is None:
        return torch.ones(B, T, dtype=torch.bool, device=device), torch.ones(B, S, dtype=torch.bool, device=device)
    m = mask[..., :T, :S]
    allowed = (m if m.dtype == torch.bool else m == 0).any(1)  # (B, T, S): allowed by any head's mask
    q_valid = torch.diagonal(allowed, offset=S - T, dim1=-2, dim2=-1)  # (B, T)
    return q_valid.expand(B, T), allowed.any(-2).expand(B, S)  # (B, T), (B, S)


def diff_lambda(module: nn.Module) -> torch.Tensor:
    """DiffLlama's ``lambda_full`` of one attention module, computed as its forward does (float64 for a float64 model).

    Args:
        module: a DiffLlama attention module."""
    dtype = module.lambda_q1.dtype
    acc = torch.promote_types(dtype, torch.float32)
    l1 = torch.exp(torch.sum(module.lambda_q1 * module.lambda_k1, dim=-1, dtype=acc)).to(dtype)
    l2 = torch.exp(torch.sum(module.lambda_q2 * module.lambda_k2, dim=-1, dtype=acc)).to(dtype)
    return l1 - l2 + module.lambda_init


@dataclass
class _Call:
    """The arguments of one attention call that every block needs."""

    module: nn.Module
    layer: int
    query: torch.Tensor  # (B, H, T, d)
    key: torch.Tensor  # (B, KV, S, d), as the layer passed it (identifies DiffLlama's second call)
    key_t: torch.Tensor  # (B, H, d, S): repeated for every query head, float32 at least, transposed; made once per call
    mask: torch.Tensor | None
    scaling: float
    softcap: float | None
    rows: int  # query rows per block
    value: torch.Tensor | None = None  # (B, H, S, d), repeated per query head
    q_mean: torch.Tensor | None = None  # (B, H, T, d): Q smoothing's mean, added back as (q_mean @ k_mean_t) * scaling
    k_mean_t: torch.Tensor | None = None  # (B, H, d, S)


class _AttentionFunction:
    """The registered callable: one per active stack of stages."""

    def __init__(self, model: nn.Module, stages: tuple[Stage, ...], rows: int | None = None,
                 block_bytes: int = BLOCK_BYTES):
        self.model_name = type(model).__name__
        self.stages = stages
        self.block_rows, self.block_bytes = rows, block_bytes
        # masked in place unless user code may hold the logits (taps hand over q/k/v and probs, never the logits)
        self.exposes = any(st.observes and st.keeps for st in stages)
        self.taps = frozenset().union(*(st.taps for st in stages))
        self.layer_of = {id(layer_mod): i for i, layer in enumerate(decoder_layers(model)) for layer_mod in layer.modules()}
        self.is_diff = model.config.model_type == "diffllama"
        self._memo: tuple | None = None  # (module, query, key, probs or None, state) of the last call, for DiffLlama's second call
        self._mask_memo: tuple | None = None  # (mask, (T, S), valid, masked) of the last mask seen
        self._v_half: torch.Tensor | None = None  # a Diff model's first half of the values, until its second call
        self._token_memo: tuple | None = None  # (mask, (B, T, S), (q_valid, k_valid)) of the last mask seen

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
        layer = self.layer_of.get(id(module))
        if layer is None:
            raise OutlierscopeError(f"{self.model_name}: attention module {type(module).__name__} is not inside a decoder layer")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        B, H, T, _ = query.shape
        S = key.shape[2]
        memo, given = self._memo, (query, key)  # DiffLlama's second call is known by the identity of what it was given
        second = memo is not None and memo[0] is module and memo[1] is query and memo[2] is key
        q_mean = k_mean = None
        if any(st.qkv for st in self.stages):
            query, key, value, q_mean, k_mean = self._transform_qkv(module, layer, query, key, value, attention_mask, second)
        if self.taps & {"attn.q", "attn.k", "attn.v"}:
            self._tap_qkv(layer, query, key, value, attention_mask, second)
        v = repeat_kv(value, H // value.shape[1])  # (B, H, S, d)
        if second and memo[3] is not None:  # the first call's probabilities were one block: reuse them
            return torch.matmul(memo[3], v).transpose(1, 2).contiguous(), None  # (B, T, H, d)
        rows = self.block_rows or block_rows(B, H, S, self.block_bytes)
        call = _Call(module, layer, query, key, repeat_kv_t(key, H), attention_mask, scaling, softcap, rows, v,  # (B, H, d, S)
                     q_mean, None if k_mean is None else repeat_kv(k_mean, H // k_mean.shape[1]).transpose(2, 3))
        if second:  # blocks again, with the non-observing stages and the first call's prepass state
            stages, state = tuple(st for st in self.stages if not st.observes), memo[4]
        else:
            stages, state = self.stages, self._prepass(call)
        if rows >= T:  # one block
            probs = self._block_probs(call, stages, state, 0, T, tap=not second)
            if self.is_diff:
                self._memo = (module, *given, probs, None)
            return torch.matmul(probs, v).transpose(1, 2).contiguous(), None  # (B, H, T, d) -> (B, T, H, d)
        out = query.new_empty(B, T, H, v.shape[-1])  # (B, T, H, d): each block's output goes straight in
        for t0 in range(0, T, rows):
            probs = self._block_probs(call, stages, state, t0, min(T, t0 + rows), tap=not second)
            out[:, t0 : t0 + probs.shape[2]] = torch.matmul(probs, v).transpose(1, 2)  # (B, H, t, d) -> (B, t, H, d)
        if self.is_diff:
            self._memo = (module, *given, None, state)
        return out, None

    def _logits(self, call: _Call, t0: int, t1: int) -> torch.Tensor:
        return attention_logits(call.query[:, :, t0:t1], call.key_t, call.scaling,
                                None if call.q_mean is None else call.q_mean[:, :, t0:t1], call.k_mean_t)

    def _ctx(self, call: _Call, t0: int, t1: int, state: dict | None) -> tuple[LogitContext, torch.Tensor]:
        T, S = call.query.shape[2], call.key.shape[2]
        valid, masked = self._valid(call.mask, T, S, call.query.device, t0, t1)
        _, k_valid = self._token_valid(call.mask, call.query.shape[0], T, S, call.query.device)
        ctx = LogitContext(call.module, call.layer, valid, call.query.shape[1], self.is_diff, t0, T, state, call.value,
                           call.scaling, call.softcap, k_valid.to(torch.int8).argmax(-1))  # (B,)
        return ctx, masked

    def _prepass(self, call: _Call) -> dict | None:
        """Each reducing stage's reduction over all blocks, the elementwise max (one pass per such stage, through the
        non-observing stages before it); None for one block."""
        T = call.query.shape[2]
        idx = [i for i, st in enumerate(self.stages) if st.reduce is not None]
        if call.rows >= T or not idx:
            return None
        state: dict = {}
        for g in idx:
            for t0 in range(0, T, call.rows):
                t1 = min(T, t0 + call.rows)
                ctx, _ = self._ctx(call, t0, t1, state)
                x = self._logits(call, t0, t1)
                for st in self.stages[:g]:
                    if not st.observes:
                        x = st.apply(ctx, x)
                r = self.stages[g].reduce(ctx, x)
                if r is not None:
                    prev = state.get(self.stages[g])
                    state[self.stages[g]] = r if prev is None else torch.maximum(prev, r)
        return state

    def _transform_qkv(self, module, layer: int, query, key, value, mask, second: bool):
        """Every stage's ``qkv`` in order (quantization of q, k, v and its exact transforms); returns the new query,
        key, value and Q smoothing's (q_mean, k_for_mean) or Nones."""
        q_valid, k_valid = self._token_valid(mask, query.shape[0], query.shape[2], key.shape[2], query.device)
        ctx = QKVContext(module, layer, q_valid, k_valid, second)
        q_mean = k_mean = None
        for st in self.stages:
            if st.qkv is not None:
                r = st.qkv(ctx, query, key, value)
                query, key, value = r.query, r.key, r.value
                if r.q_mean is not None:
                    q_mean, k_mean = r.q_mean, r.k_for_mean
        return query, key, value, q_mean, k_mean

    def _token_valid(self, mask, B: int, T: int, S: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``_token_valid`` of a call, computed once per mask (every layer of a forward gets the same mask, and a
        call both transforms and taps q/k/v)."""
        memo = self._token_memo
        if memo is not None and memo[0] is mask and memo[1] == (B, T, S):
            return memo[2]
        valid = _token_valid(mask, B, T, S, device)
        self._token_memo = (mask, (B, T, S), valid)
        return valid

    def _emit(self, tap: Tap) -> None:
        for st in self.stages:
            if tap.kind in st.taps:
                st.tap(tap)

    def _tap_qkv(self, layer: int, query, key, value, mask, second: bool) -> None:
        """Queries, keys and values as (B, T, heads * d) with their valid tokens; a Diff model's values (split in
        halves over its two calls) once, whole, in the second call."""
        B, H, T, d = query.shape
        S = key.shape[2]
        q_valid, k_valid = self._token_valid(mask, B, T, S, query.device)
        if "attn.q" in self.taps and not second:
            self._emit(Tap(layer, "attn.q", query.transpose(1, 2).reshape(B, T, H * d), q_valid, H))  # (B, T, H*d)
        if "attn.k" in self.taps and not second:
            self._emit(Tap(layer, "attn.k", key.transpose(1, 2).reshape(B, S, -1), k_valid, key.shape[1]))  # (B, S, KV*d)
        if "attn.v" not in self.taps:
            return
        if self.is_diff:  # the call's value is one half of the KV heads, repeated twice: (B, KV, S, d) = [half, half]
            half = value[:, : value.shape[1] // 2]
            if not second:
                self._v_half = half
                return
            value, self._v_half = torch.cat([self._v_half, half], dim=1), None  # (B, KV, S, d)
        self._emit(Tap(layer, "attn.v", value.transpose(1, 2).reshape(B, S, -1), k_valid, value.shape[1]))  # (B, S, KV*d)

    def _tap_probs(self, ctx: LogitContext, module: nn.Module, probs: torch.Tensor) -> None:
        H = probs.shape[1]
        if "attn.probs" in self.taps:
            self._emit(Tap(ctx.layer, "attn.probs", probs, ctx.valid, H, ctx.query_offset, self.is_diff))
        if "attn.probs_diff" in self.taps and self.is_diff:
            p = probs if probs.dtype == torch.float64 else probs.float()
            lam = diff_lambda(module).to(p.dtype)
            valid = ctx.valid[:, : H // 2] if ctx.valid.shape[1] == H else ctx.valid  # (B, 1|H/2, t, S)
            self._emit(Tap(ctx.layer, "attn.probs_diff", p[:, : H // 2] - lam * p[:, H // 2 :], valid, H // 2,
                           ctx.query_offset))  # (B, H/2, t, S)

    def _block_probs(self, call: _Call, stages, state: dict | None, t0: int, t1: int, tap: bool = False) -> torch.Tensor:
        ctx, masked = self._ctx(call, t0, t1, state)
        logits = self._logits(call, t0, t1)
        for stage in stages:
            logits = stage.apply(ctx, logits)
        if call.softcap is not None:
            logits = torch.tanh(logits / call.softcap) * call.softcap
        # float32's min, the softmax's dtype: float64's would become -inf there, and a row with no allowed key (a
        # left-padding query) NaN, which reaches every real row through 0 * NaN in probs @ value (eager does that)
        fill = torch.finfo(torch.float32).min
        # In place unless a stage handed the tensor to user code that may keep it (e.g. `reducers=seen.append`).
        logits = logits.masked_fill(masked, fill) if self.exposes else logits.masked_fill_(masked, fill)
        # float32 at least, as eager attention; a float64 model's in float64 (its reference runs stay float64 through
        # and cannot move with the padded length through a float32 sum)
        probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32)).to(call.query.dtype)
        for stage in stages:
            if stage.probs is not None:
                probs = stage.probs(ctx, probs)
        if tap and self.taps & {"attn.probs", "attn.probs_diff"}:
            self._tap_probs(ctx, call.module, probs)
        return probs

    def _valid(self, attention_mask, q_len: int, k_len: int, device, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid, ~allowed) of rows [t0, t1) of a mask; for a whole-call block computed once per forward
        (every layer gets the same mask object)."""
        if t0 > 0 or t1 < q_len:
            allowed, valid = _allowed_and_valid(attention_mask, q_len, k_len, device, t0, t1)
            return valid, ~allowed
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
def attention_stages(model: nn.Module, stage: Stage | Callable, block_rows: int | None = None,
                     block_bytes: int | None = None) -> Iterator[None]:
    """Run the model with its attention through our function, a stage added after any active ones, inside the block.

    Args:
        model: the model (its attention must go through transformers' ``AttentionInterface``).
        stage: a ``Stage`` or a function ``f(ctx, logits)``.
        block_rows: query rows per block; None: from ``block_bytes`` or an enclosing ``attention_stages``.
        block_bytes: the budget of one block's float32 logits (default 256 MiB)."""
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
    if block_rows is not None and (not isinstance(block_rows, int) or block_rows < 1):
        raise ParamError("block_rows", "a positive number of query rows (or None: from block_bytes)", block_rows)
    if block_bytes is not None and (not isinstance(block_bytes, int) or block_bytes < 1):
        raise ParamError("block_bytes", "a positive number of bytes", block_bytes)
    if block_rows is None and block_bytes is None and outer is not None:
        block_rows, block_bytes = outer.block_rows, outer.block_bytes
    fn = _AttentionFunction(model, (*(outer.stages if outer else ()), as_stage(stage)), block_rows,
                            block_bytes or BLOCK_BYTES)
    name = f"{_PREFIX}{id(fn):x}"  # unique while registered: fn lives until the cleanup below
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
