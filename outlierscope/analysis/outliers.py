"""Streaming outlier statistics of attention logits and hidden states (Table 5 and finer).

``OutlierStats`` is a reducer for ``outlierscope.hooks.capture``. Per observation
point it keeps, with memory independent of the number of tokens:

* exact top-k of |x| with locations: pooled over all layers (k, default 100) and per layer (``layer_k``);
  logits: (layer, head, sequence, query, key); hidden states: (layer, channel, sequence, token);
* a log-spaced histogram of |x| per layer and head (logits) or per layer (hidden states), from
  which medians are estimated with relative error <= ``bins.rel_error_bound`` (0.4988%);
* float64 power sums of x (count, mean, std, Pearson kurtosis) and max |x|, per layer and head
  (logits) or per layer and channel (hidden states), kept per virtual shard of the run
  (``outlierscope.parallel``; set with ``OutlierStats.set_shard``) and merged in shard order,
  so any split of the work over processes gives the same bytes;
* hidden states: per (layer, channel) counts of |x| >= 6 (LLM.int8 outlier features) and |x| > 100,
  per (layer, position) counts of |x| >= 6; massive activations (Sun et al. 2024) are the
  recorded top values above 100 and above 1000 x the layer's median |x|.

Only valid entries count: masked (future, padding, outside-window) logits and padding tokens are
excluded. Pooled statistics are over all layers, heads (both maps of a differential head) and
tokens, the paper's Table 5 method.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pandas as pd
import torch

from outlierscope.analysis import activations as act
from outlierscope.analysis.activations import INT8_LAYER_SHARE, INT8_THRESHOLD, INT8_TOKEN_SHARE, SinkStats
from outlierscope.analysis.kernels import kernel, map_pass, token_pass, working
from outlierscope.analysis.reducers import Exceedances, LogBins, Moments, TopK, masked_mean, row_candidates
from outlierscope.errors import ParamError
from outlierscope.hooks.capture import Observation
from outlierscope.hooks.points import ATTN_KINDS, KINDS, LM_HEAD, MAP_KINDS
from outlierscope.parallel import VIRTUAL_SHARDS
from outlierscope.state import from_plain, to_plain

MASSIVE_ABS = 100.0  # Sun et al. 2024: massive activation magnitude
MASSIVE_REL = 1000.0  # ... and this many times the median |x|
TABLE5_RANKS = (1, 2, 3, 10, 100)
KIND_LABEL = {"attn.logits": "Attention Logits", "hidden": "Hidden States"}


def pooled_moments(m: Moments, layer: int) -> dict:
    """Moments of one layer pooled over its groups (heads or channels), combined exactly from each group's shifted sums.

    The raw moments about 0 follow from each group's sums of ``(x - shift)^k`` by the binomial expansion, in float64.

    Args:
        m: the layer's ``Moments``.
        layer: the layer."""
    n = m.count[layer].numpy()
    c = m.shift[layer].numpy()
    s1, s2, s3, s4 = (m.sums[i, layer].numpy() for i in range(4))
    # sums of x^k = sum of (y + c)^k with y = x - c
    r1 = s1 + n * c
    r2 = s2 + 2 * c * s1 + n * c**2
    r3 = s3 + 3 * c * s2 + 3 * c**2 * s1 + n * c**3
    r4 = s4 + 4 * c * s3 + 6 * c**2 * s2 + 4 * c**3 * s1 + n * c**4
    total = n.sum()
    mu = r1.sum() / total
    # re-centre the pooled raw sums on the pooled mean
    t2 = r2.sum() - 2 * mu * r1.sum() + total * mu**2
    t3 = r3.sum() - 3 * mu * r2.sum() + 3 * mu**2 * r1.sum() - total * mu**3
    t4 = r4.sum() - 4 * mu * r3.sum() + 6 * mu**2 * r2.sum() - 4 * mu**3 * r1.sum() + total * mu**4
    return Moments.describe(total, 0.0, t2, t3, t4, shift=mu)


class _KindStats:
    """Top-k (pooled and per layer), histograms and moments of one activation kind: the shared parts."""

    kind = ""
    n_loc = 0
    tie: tuple[int, ...] = ()  # location fields by tie priority: the sequence first, then an observation's flat order

    def __init__(self, n_layers: int, n_groups: int, n_hist: int, k: int, layer_k: int, bins: LogBins,
                 compile: bool = False):
        self.n_layers, self.bins, self.compile = n_layers, bins, compile
        self.top = TopK(k, self.n_loc, self.tie)
        self.layer_top = [TopK(layer_k, self.n_loc, self.tie) for _ in range(n_layers)]
        self.hist = torch.zeros(n_layers, n_hist, bins.n + 2, dtype=torch.int64)
        self.shard_moments = [Moments((n_layers, n_groups)) for _ in range(VIRTUAL_SHARDS)]
        self.shard = 0  # the virtual shard the next updates belong to
        self.seen = False

    @property
    def moments(self) -> Moments:
        """The moments of all data: the virtual shards' merged in shard order (the same for any split)."""
        out = Moments(tuple(self.shard_moments[0].count.shape))
        for m in self.shard_moments:
            out.merge(m)
        return out

    def _check_mergeable(self, other: _KindStats) -> None:
        if type(other) is not type(self) or other.hist.shape != self.hist.shape or other.bins != self.bins \
                or other.top.k != self.top.k or other.shard_moments[0].count.shape != self.shard_moments[0].count.shape:
            raise ValueError(f"cannot merge {type(other).__name__} of shape {tuple(other.hist.shape)} into "
                             f"{type(self).__name__} of shape {tuple(self.hist.shape)}: expected the same model and settings")

    def merge(self, other: _KindStats) -> None:
        """Add ``other`` (statistics of other data of the same model) into this one: top-k and histograms
        exactly; moments shard by shard (exact when each virtual shard's data is on one side, as with
        data-parallel processes; within float64 rounding otherwise)."""
        self._check_mergeable(other)
        self.top.merge(other.top)
        for a, b in zip(self.layer_top, other.layer_top):
            a.merge(b)
        self.hist += other.hist
        for a, b in zip(self.shard_moments, other.shard_moments):
            a.merge(b)
        self.seen = self.seen or other.seen

    def _bins(self, x: torch.Tensor) -> tuple:
        """The bin arguments of a kernel for a tensor on x's device."""
        return (*self.bins.table(x.device), self.bins.n)

    def _topk(self, layer: int, rowmax: torch.Tensor, row_values, shape, coords) -> None:
        vals, locs = row_candidates(rowmax, row_values, shape, self.top.k, coords)
        self.top.update(vals, locs)
        self.layer_top[layer].update(vals, locs)


class LogitStats(_KindStats):
    """Statistics of attention maps (logits, probabilities) ``(B, H, T, S)``, a reducer to call with observations.

    Locations are (layer, head, sequence, query, key); histograms and moments are per head.

    Args:
        n_layers: the model's decoder layers.
        n_heads: the maps' heads.
        k: the largest values kept.
        layer_k: the largest values kept per layer.
        bins: the histogram's ``LogBins``.
        kind: the point kind it reads.
        compile: run the per-element passes compiled."""

    n_loc = 5
    tie = (2, 0, 1, 3, 4)  # (seq, layer, head, query, key): (b, h, t, s) is the flat order of one observation

    def __init__(self, n_layers: int, n_heads: int, k: int, layer_k: int, bins: LogBins, kind: str = "attn.logits",
                 compile: bool = False):
        super().__init__(n_layers, n_heads, n_heads, k, layer_k, bins, compile)
        self.n_heads, self.kind = n_heads, kind
        self.is_diff = False

    def merge(self, other: LogitStats) -> None:
        super().merge(other)
        self.is_diff = self.is_diff or other.is_diff

    def __call__(self, obs: Observation) -> None:
        x, layer = obs.x, obs.point.layer  # (B, H, T, S)
        B, H, T, S = x.shape
        self.seen, self.is_diff = True, obs.is_diff
        valid = obs.valid  # (B, 1|H, T, S): kept compact, broadcast by each op
        moments = self.shard_moments[self.shard]
        n = valid.sum((0, 2, 3)).double().cpu().expand(H)  # valid entries per head
        shift = moments.centre(layer, n, lambda: masked_mean(working(x), valid, 3, (0, 2), n))
        rowmax, idx, sums = kernel(map_pass, self.compile)(x, valid, shift.to(x.device, working(x).dtype), *self._bins(x))
        _check_finite(obs, rowmax)  # rowmax (B, H, T), idx (B, H, T, S), sums (4, B, H, T)
        off = obs.seq_offset
        q0 = S - T if obs.query_offset is None else obs.query_offset  # key position of x's first query row

        def coords(m):  # (N, 4) of (b, h, t, s) -> (layer, head, seq, query, key)
            return torch.stack([torch.full_like(m[:, 0], layer), m[:, 1], m[:, 0] + off, m[:, 2] + q0, m[:, 3]], 1)

        def row_values(rows):  # flat rows of (B, H, T) -> |x| (R, S), -1 where invalid
            bht = torch.unravel_index(rows, (B, H, T))
            v = valid[tuple(i if n > 1 else 0 for i, n in zip(bht, valid.shape))]  # valid broadcasts: size-1 dims
            return torch.where(v, x[bht].abs(), -1.0)

        self._topk(layer, rowmax, row_values, x.shape, coords)
        nb = self.bins.n + 2
        counts = torch.bincount(idx.view(-1), minlength=H * (nb + 1)).view(H, nb + 1)  # (B*H*T*S,) -> (H, nb+1)
        self.hist[layer] += counts[:, :nb].cpu()
        moments.add(layer, n, sums.cpu().double().sum((1, 3)), rowmax.clamp_min(0).amax((0, 2)))


class TokenStats(_KindStats):
    """Statistics of token tensors ``(B, T, C)`` (hidden states, q/k/v, module inputs and outputs), a reducer.

    Locations are (layer, channel, sequence, token); moments per layer (per layer and channel with
    ``channel_moments``). Per (layer, channel): max |x| and where it first occurs, sum of |x| (per virtual shard),
    counts of |x| >= 6 and > 100; per (layer, position): max and sum of each token's max |x|, tokens, tokens with a
    |x| >= 6; every value above ``massive_abs`` with its token id, up to ``massive_cap``.

    Args:
        n_layers: the model's decoder layers.
        channels: C.
        seq_len: tokens per sequence.
        k: the largest values kept.
        layer_k: the largest values kept per layer.
        bins: the histogram's ``LogBins``.
        kind: the point kind it reads.
        channel_moments: moments per (layer, channel).
        head_dim: q/k/v's head size, to name a channel's head and dim.
        massive_abs: the massive activations' absolute threshold.
        massive_cap: the most massive activations kept.
        compile: run the per-element passes compiled."""

    n_loc = 4
    tie = (2, 0, 3, 1)  # (seq, layer, token, channel): (b, t, c) is the flat order of one observation

    def __init__(self, n_layers: int, channels: int, seq_len: int, k: int, layer_k: int, bins: LogBins,
                 kind: str = "hidden", channel_moments: bool = False, head_dim: int | None = None,
                 massive_abs: float = MASSIVE_ABS, massive_cap: int = 100_000, compile: bool = False):
        super().__init__(n_layers, channels if channel_moments else 1, 1, k, layer_k, bins, compile)
        self.kind, self.channels, self.seq_len, self.head_dim = kind, channels, seq_len, head_dim
        self.channel_moments = channel_moments
        L, C = n_layers, channels
        self.ge6 = torch.zeros(L, C, dtype=torch.int64)
        self.gt100 = torch.zeros(L, C, dtype=torch.int64)
        self.ge6_pos = torch.zeros(L, seq_len, dtype=torch.int64)
        self.tokens_pos = torch.zeros(L, seq_len, dtype=torch.int64)
        self.ch_max = torch.full((L, C), -1.0, dtype=torch.float64)  # -1: no valid entry yet
        self.ch_at = torch.zeros(L, C, 2, dtype=torch.int64)  # (seq, token) of the first max
        self.shard_sumabs = torch.zeros(VIRTUAL_SHARDS, L, C, dtype=torch.float64)
        self.pos_max = torch.zeros(L, seq_len, dtype=torch.float64)
        self.shard_pos_sum = torch.zeros(VIRTUAL_SHARDS, L, seq_len, dtype=torch.float64)
        self.massive = Exceedances(massive_abs, massive_cap, 5)  # (layer, channel, seq, token, token id)
        self.sequences = 0  # 1 + the largest sequence number seen
        self.tokens = torch.zeros(L, dtype=torch.int64)  # valid tokens per layer
        self.modules: dict[int, str] = {}  # module points: layer -> the module's full name
        self.linear: dict[int, bool] = {}

    @property
    def linear_input(self) -> bool:
        """Whether this kind is the input of an ``nn.Linear`` (what SmoothQuant and LLM.int8 look at)."""
        return self.kind.endswith(".input") and any(self.linear.values())

    def merge(self, other: TokenStats) -> None:
        super().merge(other)
        if other.ge6_pos.shape != self.ge6_pos.shape:
            raise ValueError(f"cannot merge {self.kind} statistics of sequence length {other.seq_len} into {self.seq_len}")
        self.modules.update(other.modules)
        self.linear.update(other.linear)
        for name in ("ge6", "gt100", "ge6_pos", "tokens_pos", "shard_sumabs", "shard_pos_sum", "tokens"):
            getattr(self, name).add_(getattr(other, name))
        self.ch_max, self.ch_at = _argmax_merge(self.ch_max, self.ch_at, other.ch_max, other.ch_at)
        self.pos_max = torch.maximum(self.pos_max, other.pos_max)
        self.massive.merge(other.massive)
        self.sequences = max(self.sequences, other.sequences)

    def __call__(self, obs: Observation) -> None:
        x, layer = obs.x, obs.point.layer  # (B, T, C)
        B, T, C = x.shape
        self.seen = True
        if self.head_dim is None and obs.n_heads:
            self.head_dim = C // obs.n_heads
        valid, valid3 = obs.valid, obs.valid[:, :, None]  # (B, T), (B, T, 1)
        xw = working(x)
        moments = self.shard_moments[self.shard]
        per_channel = self.channel_moments
        n = valid.sum().double().cpu().expand(C if per_channel else 1) * (1 if per_channel else C)  # per group
        shift = moments.centre(layer, n, lambda: masked_mean(xw, valid3, 1 if per_channel else 2,
                                                             (0,) if per_channel else (0, 1), n))
        rowmax, chmax, n_big, n_huge, sumabs, idx, sums = kernel(token_pass, self.compile)(
            x, valid3, shift.to(x.device, xw.dtype), *self._bins(x), INT8_THRESHOLD, MASSIVE_ABS, per_channel)
        _check_finite(obs, rowmax)  # rowmax (B, T); chmax, n_big, n_huge, sumabs (B, C); idx (B, T, C)
        off = obs.seq_offset

        def row_values(rows):  # flat rows of (B, T) -> |x| (R, C), -1 on padding
            return torch.where(valid.reshape(-1)[rows, None], xw.reshape(B * T, C)[rows].abs(), -1.0)

        self._topk(layer, rowmax, row_values, x.shape,
                   lambda m: torch.stack([torch.full_like(m[:, 0], layer), m[:, 2], m[:, 0] + off, m[:, 1]], 1))
        nb = self.bins.n + 2
        self.hist[layer, 0] += torch.bincount(idx.view(-1), minlength=nb + 1)[:nb].cpu()  # over (B*T*C,)
        maxabs = chmax.clamp_min(0).amax(0) if per_channel else rowmax.clamp_min(0).amax().view(1)
        moments.add(layer, n, sums.cpu().double().sum(1).reshape(4, -1) if per_channel  # (4, B, C) -> (4, C)
                    else sums.cpu().double().sum((1, 2)).view(4, 1), maxabs)  # (4, B, T) -> (4, 1)
        self.ge6[layer] += n_big.sum(0).cpu()
        self.gt100[layer] += n_huge.sum(0).cpu()
        self.shard_sumabs[self.shard, layer] += sumabs.cpu().double().sum(0)  # float32 over T
        self._channels(layer, xw, valid, chmax, off)
        self._positions(layer, valid, rowmax)
        self._exceedances(layer, xw, rowmax, obs, off)
        self.sequences = max(self.sequences, off + B)
        self.tokens[layer] += int(valid.sum())
        if obs.point.module is not None:
            self.modules[layer], self.linear[layer] = obs.point.module, obs.point.linear

    def _channels(self, layer: int, xw: torch.Tensor, valid: torch.Tensor, chmax: torch.Tensor, off: int) -> None:
        """Each channel's max |x| and where it first occurs in (sequence, token) order: the first sequence holding
        the max (from the per-sequence maxima ``chmax`` (B, C)), then the first token there."""
        C = xw.shape[-1]
        vmax, b = chmax.max(0)  # (C,): the first sequence with the max
        col = torch.arange(C, device=xw.device)
        am = torch.where(valid[b], xw[b, :, col].abs(), -1.0)  # (C, T): that sequence's tokens, per channel
        t = (am == vmax[:, None]).to(torch.uint8).argmax(1)  # (C,): the first token with the max
        at = torch.stack([b + off, t], -1).cpu()  # (C, 2) = (seq, token)
        self.ch_max[layer], self.ch_at[layer] = _argmax_merge(self.ch_max[layer], self.ch_at[layer], vmax.double().cpu(), at)

    def _positions(self, layer: int, valid: torch.Tensor, rowmax: torch.Tensor) -> None:
        T = min(rowmax.shape[1], self.seq_len)
        r = rowmax[:, :T]  # (B, T): -1 on padding
        self.pos_max[layer, :T] = torch.maximum(self.pos_max[layer, :T], r.amax(0).double().cpu())
        self.shard_pos_sum[self.shard, layer, :T] += r.clamp_min(0).double().sum(0).cpu()
        self.ge6_pos[layer, :T] += (r >= INT8_THRESHOLD).sum(0).cpu()  # tokens with a |x| >= 6
        self.tokens_pos[layer, :T] += valid[:, :T].sum(0).cpu()

    def _exceedances(self, layer: int, xw: torch.Tensor, rowmax: torch.Tensor, obs: Observation, off: int) -> None:
        rows = torch.nonzero(rowmax > self.massive.threshold)  # (R, 2) of (b, t), row-major; padding has -1
        if rows.numel() == 0:
            return
        a = xw[rows[:, 0], rows[:, 1]].abs()  # (R, C)
        hit = torch.nonzero(a > self.massive.threshold)  # (N, 2) of (row, c): (b, t, c) order
        b, t, c = rows[hit[:, 0], 0], rows[hit[:, 0], 1], hit[:, 1]
        ids = obs.ids[b, t] if obs.ids is not None else torch.full_like(b, -1)
        locs = torch.stack([torch.full_like(b, layer), c, b + off, t, ids.to(b.device)], 1)
        self.massive.update(a[hit[:, 0], hit[:, 1]], locs)


def _argmax_merge(cur: torch.Tensor, cur_at: torch.Tensor, new: torch.Tensor, new_at: torch.Tensor):
    """Elementwise the larger max with its (sequence, token) (``*_at``: (..., 2)); on a tie the earlier location, so
    any split of the stream gives the same result. Returns (max, at)."""
    earlier = (new_at[..., 0] < cur_at[..., 0]) | ((new_at[..., 0] == cur_at[..., 0]) & (new_at[..., 1] < cur_at[..., 1]))
    take = (new > cur) | ((new == cur) & earlier)
    return torch.where(take, new, cur), torch.where(take[..., None], new_at, cur_at)


class HiddenStats(TokenStats):
    """Hidden states ``(B, T, C)``: ``TokenStats`` with moments per (layer, channel) (the ``per_channel`` table).

    Args:
        n_layers: the model's decoder layers.
        hidden_size: C.
        seq_len: tokens per sequence.
        k: the largest values kept.
        layer_k: the largest values kept per layer.
        bins: the histogram's ``LogBins``.
        **kw: the other arguments of ``TokenStats``."""

    def __init__(self, n_layers: int, hidden_size: int, seq_len: int, k: int, layer_k: int, bins: LogBins, **kw):
        super().__init__(n_layers, hidden_size, seq_len, k, layer_k, bins, kind="hidden", channel_moments=True, **kw)


def _check_finite(obs: Observation, rowmax: torch.Tensor) -> None:
    if not torch.isfinite(rowmax).all():  # NaN propagates through max, inf is its own max
        from outlierscope.errors import OutlierscopeError

        bad = int((~torch.isfinite(obs.x)).sum())
        raise OutlierscopeError(
            f"{obs.point.name}: {bad} non-finite values (NaN/inf) in the activations; "
            "the model or its dtype overflows: load it in float32 or check its weights"
        )


class OutlierStats:
    """Streaming statistics of every observed point of one model: a reducer to call with observations.

    One reducer per point kind in ``by_kind``: ``LogitStats`` for maps (logits, probabilities), ``TokenStats`` for
    ``(B, T, C)`` tensors (``HiddenStats`` for hidden states); Table 5's two exist from the start, the others are made
    at their first observation. Probability maps also feed a ``SinkStats`` (``sinks``). ``merge`` adds the statistics
    of other data of the same model (data-parallel shards), exactly.

    Args:
        n_layers: the model's decoder layers.
        n_heads: attention heads per layer.
        hidden_size: the hidden states' channels.
        seq_len: tokens per sequence.
        k: the largest values kept per point kind (at least Table 5's ranks).
        layer_k: the largest values kept per layer.
        bins: the log-spaced histogram bins; None: ``LogBins()``.
        sink_k: key positions counted as the attention sink.
        massive_abs: a massive activation's |x| threshold.
        massive_rel: its second threshold, times the layer's median |x|.
        massive_cap: exceedances kept per point kind.
        delimiters: token ids whose massive activations are labelled ``delimiter``.
        compile: run the per-element passes compiled (the same statistics; sums within float32 rounding)."""

    keeps_observations = False  # each call reduces its observation before returning (capture may then mask in place)

    def __init__(self, n_layers: int, n_heads: int, hidden_size: int, seq_len: int, k: int = 100,
                 layer_k: int = 10, bins: LogBins | None = None, *, sink_k: int = 4, massive_abs: float = MASSIVE_ABS,
                 massive_rel: float = MASSIVE_REL, massive_cap: int = 100_000, delimiters=(), compile: bool = False):
        if k < max(TABLE5_RANKS):
            raise ParamError("k", f">= {max(TABLE5_RANKS)} for Table 5", k)
        self.n_layers, self.n_heads, self.hidden_size, self.seq_len = n_layers, n_heads, hidden_size, seq_len
        self.k, self.layer_k, self.bins = k, layer_k, bins or LogBins()
        self.sink_k, self.massive_rel, self.delimiters = sink_k, massive_rel, frozenset(delimiters)
        self._token_kw = {"massive_abs": massive_abs, "massive_cap": massive_cap, "compile": compile}
        self.compile = compile
        self.logits = LogitStats(n_layers, n_heads, k, layer_k, self.bins, compile=compile)
        self.hidden = HiddenStats(n_layers, hidden_size, seq_len, k, layer_k, self.bins, **self._token_kw)
        self.by_kind = {"attn.logits": self.logits, "hidden": self.hidden}
        self.sinks: dict[str, SinkStats] = {}
        self._shard = 0
        self.order: list[str] = []  # kinds in the order a forward first reached them (its layer 0: module order)

    @classmethod
    def for_model(cls, model, seq_len: int, **kw) -> OutlierStats:
        """Statistics sized for a model's config (layers, heads, hidden size).

        Args:
            model: a transformers model (a multimodal one's ``text_config`` is read).
            seq_len: tokens per sequence.
            **kw: the other arguments of ``OutlierStats``."""
        c = getattr(model.config, "text_config", None) or model.config
        return cls(c.num_hidden_layers, c.num_attention_heads, c.hidden_size, seq_len, **kw)

    def _new(self, obs: Observation):
        kind = obs.point.kind
        if obs.point.is_map:
            st = LogitStats(self.n_layers, obs.x.shape[1], self.k, self.layer_k, self.bins, kind=kind, compile=self.compile)
        else:
            rows = max(self.n_layers, obs.point.layer + 1)  # lm_head.input: layer n_layers
            st = TokenStats(rows, obs.x.shape[-1], self.seq_len, self.k, self.layer_k, self.bins, kind=kind, **self._token_kw)
        st.shard = self._shard
        self.by_kind[kind] = st
        return st

    def __call__(self, obs: Observation) -> None:
        kind = obs.point.kind
        if kind not in self.order:
            self.order.append(kind)
        (self.by_kind.get(kind) or self._new(obs))(obs)
        if kind in ("attn.probs", "attn.probs_diff"):
            if kind not in self.sinks:
                self.sinks[kind] = SinkStats(self.n_layers, obs.x.shape[1], self.sink_k, kind)
                self.sinks[kind].shard = self._shard
            self.sinks[kind](obs)

    def set_shard(self, shard: int) -> None:
        """Set the virtual shard of the data that follows (profile sets it per batch).

        Args:
            shard: 0 .. VIRTUAL_SHARDS - 1."""
        if not 0 <= shard < VIRTUAL_SHARDS:
            raise ParamError("shard", f"in 0..{VIRTUAL_SHARDS - 1}", shard)
        self._shard = shard
        for st in (*self.by_kind.values(), *self.sinks.values()):
            st.shard = shard

    def state(self) -> dict:
        """These statistics as tensors and plain containers (what ``from_state`` reads back)."""
        return to_plain(self, STATE_CLASSES)

    @classmethod
    def from_state(cls, data: dict) -> OutlierStats:
        """The statistics ``state`` returned.

        Args:
            data: ``state``'s value, as read back with ``torch.load(weights_only=True)``.

        Raises:
            ValueError: for data that is not the state of an OutlierStats."""
        stats = from_plain(data, STATE_CLASSES)
        if not isinstance(stats, cls):
            raise ValueError(f"expected the state of an OutlierStats, got {type(stats).__name__}")
        return stats

    def merge(self, other: OutlierStats) -> OutlierStats:
        """Add another's statistics (same model and settings) into this one, exactly.

        Args:
            other: the statistics of other data.

        Returns:
            self."""
        self.order += [k for k in getattr(other, "order", []) if k not in self.order]
        for mine, theirs in ((self.by_kind, other.by_kind), (self.sinks, other.sinks)):
            for kind, st in theirs.items():
                if kind in mine:
                    mine[kind].merge(st)
                else:
                    mine[kind] = copy.deepcopy(st)
        return self

    # views kept for the result methods below
    @property
    def is_diff(self) -> bool:
        return self.logits.is_diff

    @property
    def seen(self) -> dict[str, bool]:
        return {k: st.seen for k, st in self.by_kind.items()}

    @property
    def top(self) -> dict[str, TopK]:
        return {k: st.top for k, st in self.by_kind.items()}

    @property
    def layer_top(self) -> dict[str, list[TopK]]:
        return {k: st.layer_top for k, st in self.by_kind.items()}

    @property
    def hist(self) -> dict[str, torch.Tensor]:
        return {k: st.hist for k, st in self.by_kind.items()}

    @property
    def moments(self) -> dict[str, Moments]:
        return {k: st.moments for k, st in self.by_kind.items()}

    @property
    def ge6(self) -> torch.Tensor:
        return self.hidden.ge6

    @property
    def gt100(self) -> torch.Tensor:
        return self.hidden.gt100

    @property
    def ge6_pos(self) -> torch.Tensor:
        return self.hidden.ge6_pos

    # -- results ---------------------------------------------------------------------------
    def kinds(self) -> list[str]:
        """Observed kinds: Table 5's two first, then attention internals, module points (by name), lm_head.input."""
        def order(kind):
            return (kind not in KINDS, kind not in ATTN_KINDS, kind == LM_HEAD,
                    ATTN_KINDS.index(kind) if kind in ATTN_KINDS else 0, kind)
        return sorted((k for k, seen in self.seen.items() if seen), key=order)

    def token_kinds(self) -> list[str]:
        return [k for k in self.kinds() if k not in MAP_KINDS]

    def median(self, kind: str, layer: int | None = None, head: int | None = None) -> float:
        """The median |x| of a point kind, from its histogram.

        Args:
            kind: the point kind (``attn.logits``, ``hidden``, ...).
            layer: only this layer; None: every layer.
            head: only this head; None: every head."""
        h = self.hist[kind]
        h = h if layer is None else h[layer : layer + 1]
        h = h if head is None else h[:, head : head + 1]
        return self.bins.quantile(h.sum((0, 1)).numpy(), 0.5)

    def count(self, kind: str) -> int:
        """The number of valid entries a point kind has seen.

        Args:
            kind: the point kind."""
        return int(self.hist[kind].sum())

    def table5(self) -> pd.DataFrame:
        """Rows per activation type: Top-1, -2, -3, -10, -100 (k-th largest |x|) and Median, pooled."""
        rows = []
        for kind in self.kinds():
            top = self.top[kind]
            row = {"activation": KIND_LABEL.get(kind, kind), "point": kind}
            row.update({f"top{r}": top.kth(r) for r in TABLE5_RANKS})
            row["median"] = self.median(kind)
            row["count"] = self.count(kind)
            rows.append(row)
        return pd.DataFrame(rows)

    def _head_label(self, h: int) -> tuple[str, int]:
        if not self.is_diff:
            return "", h
        half = self.n_heads // 2
        return ("map1" if h < half else "map2"), h % half

    @staticmethod
    def _observed_layers(m: Moments) -> list[int]:
        """The layers (rows of a kind's moments ``m``) with observations: not a hybrid model's layers without
        attention, nor layers left out of the points; ``lm_head.input``'s row is the one after the last layer."""
        return [layer for layer in range(m.count.shape[0]) if m.count[layer].sum() > 0]

    def per_layer(self) -> pd.DataFrame:
        rows = []
        for kind in self.kinds():
            m = self.by_kind[kind].moments  # the virtual shards merged: once per kind
            for layer in self._observed_layers(m):
                d = pooled_moments(m, layer)
                c = m.count[layer].sum().item()
                lt = self.layer_top[kind][layer]
                rows.append({"point": kind, "layer": layer, "count": int(c), "mean": float(d["mean"]),
                             "std": float(d["std"]), "kurtosis": float(d["kurtosis"]),
                             "max": float(m.maxabs[layer].max()), "top1": lt.kth(1), "top3": lt.kth(3),
                             "top10": lt.kth(10), "median": self.median(kind, layer)})
        return pd.DataFrame(rows)

    def per_head(self) -> pd.DataFrame:
        if not self.seen["attn.logits"]:
            return pd.DataFrame()
        m = self.logits.moments
        d = m.summary()
        rows = []
        for layer in self._observed_layers(m):
            for h in range(self.n_heads):
                mp, pair = self._head_label(h)
                rows.append({"layer": layer, "head": h, "map": mp, "diff_head": pair if self.is_diff else None,
                             "count": int(m.count[layer, h]), "mean": d["mean"][layer, h], "std": d["std"][layer, h],
                             "kurtosis": d["kurtosis"][layer, h], "max": float(m.maxabs[layer, h]),
                             "median": self.median("attn.logits", layer, h)})
        return pd.DataFrame(rows)

    def per_channel(self) -> pd.DataFrame:
        if not self.seen["hidden"]:
            return pd.DataFrame()
        m = self.hidden.moments
        d = m.summary()
        L, C = m.count.shape
        layer, ch = np.meshgrid(np.arange(L), np.arange(C), indexing="ij")
        count = m.count.numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            share = self.ge6.numpy() / count
        return pd.DataFrame({
            "layer": layer.ravel(), "channel": ch.ravel(), "count": count.ravel().astype(np.int64),
            "mean": d["mean"].ravel(), "std": d["std"].ravel(), "kurtosis": d["kurtosis"].ravel(),
            "max": m.maxabs.numpy().ravel(), "n_ge6": self.ge6.numpy().ravel(), "share_ge6": share.ravel(),
            "n_gt100": self.gt100.numpy().ravel(),
        })

    def outlier_features(self) -> pd.DataFrame:
        """LLM.int8 outlier features: channels with |x| >= 6 on >= 6% of tokens in >= 25% of layers."""
        if not self.seen["hidden"]:
            return pd.DataFrame(columns=["channel", "layers", "n_layers", "max_share_ge6", "positions_ge6"])
        count = self.hidden.moments.count.numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            share = self.ge6.numpy() / count  # (L, C)
        hit = share >= INT8_TOKEN_SHARE
        need = math.ceil(INT8_LAYER_SHARE * self.n_layers)
        rows = []
        for c in np.flatnonzero(hit.sum(0) >= need):
            layers = np.flatnonzero(hit[:, c]).tolist()
            pos = self.ge6_pos[layers].sum(0)
            rows.append({"channel": int(c), "layers": layers, "n_layers": len(layers),
                         "max_share_ge6": float(np.nanmax(share[:, c])),
                         "positions_ge6": np.flatnonzero(pos.numpy()).tolist()[:64]})
        return pd.DataFrame(rows, columns=["channel", "layers", "n_layers", "max_share_ge6", "positions_ge6"])

    def massive_activations(self) -> pd.DataFrame:
        """Recorded top hidden values with |x| > 100 and > 1000 x their layer's median |x| (Sun et al. 2024)."""
        df = self.topk_frame("hidden")
        if df.empty:
            return df
        med = {layer: self.median("hidden", layer) for layer in range(self.n_layers)}
        ratio = df["value"] / df["layer"].map(med)
        out = df[(df["value"] > MASSIVE_ABS) & (ratio > MASSIVE_REL)].copy()
        out["times_median"] = ratio[out.index]
        return out

    def topk_frame(self, kind: str) -> pd.DataFrame:
        """The largest |x| of a point kind with their locations, one row each.

        Args:
            kind: the point kind.

        Returns:
            Columns ``value`` and the location (layer, head, seq, query, key for maps; layer, channel, seq, token for
            token tensors); empty when the kind was not seen."""
        if not self.seen[kind]:
            return pd.DataFrame()
        top = self.top[kind]
        cols = ["layer", "head", "seq", "query", "key"] if kind in MAP_KINDS else ["layer", "channel", "seq", "token"]
        df = pd.DataFrame(top.locs.numpy(), columns=cols)
        df.insert(0, "value", top.values.numpy())
        df.insert(0, "rank", np.arange(1, len(df) + 1))
        if kind in ("attn.logits", "attn.probs") and self.is_diff:
            df["map"] = ["map1" if h < self.n_heads // 2 else "map2" for h in df["head"]]
        return df

    def histograms(self) -> pd.DataFrame:
        """Non-empty bins of |x| per point kind, layer and head (head -1 for hidden states); kinds beyond Table 5's
        two pooled over layers and heads (layer and head -1: per-layer medians are in ``per_layer``), so that a
        profile of every point stays a few MB."""
        edges = self.bins.edges()
        hi = np.append(edges[1:], np.inf)
        rows = []
        for kind in self.kinds():
            h = self.hist[kind].numpy()
            if kind not in KINDS:
                h = h.sum((0, 1))
                nz = np.flatnonzero(h)
                rows.append(pd.DataFrame({"point": kind, "layer": -1, "head": -1, "bin": nz, "lo": edges[nz],
                                          "hi": hi[nz], "count": h[nz]}))
                continue
            L, H, _ = h.shape
            for layer in range(L):
                for head in range(H):
                    nz = np.flatnonzero(h[layer, head])
                    rows.append(pd.DataFrame({"point": kind, "layer": layer, "head": head if kind in MAP_KINDS else -1,
                                              "bin": nz, "lo": edges[nz], "hi": hi[nz], "count": h[layer, head, nz]}))
        return pd.concat(rows, ignore_index=True) if rows else pd.DataFrame()

    # -- every point beyond Table 5's two (outlierscope.analysis.activations) ---------------------------------
    def _tokens(self) -> list[TokenStats]:
        return [self.by_kind[k] for k in self.token_kinds()]

    def channels(self) -> pd.DataFrame:
        return _concat_frames([act.channels_frame(st) for st in self._tokens()])

    def positions(self) -> pd.DataFrame:
        return _concat_frames([act.positions_frame(st) for st in self._tokens()])

    def massive(self) -> pd.DataFrame:
        """Massive activations of every token kind (Sun et al. 2024): above both thresholds, with their position kind."""
        frames = []
        for st in self._tokens():
            medians = {layer: self.median(st.kind, layer) for layer in range(st.tokens.shape[0])}
            frames.append(act.massive_frame(st, medians, self.massive_rel, self.delimiters))
        return _concat_frames(frames, act.MASSIVE_COLUMNS)

    def massive_capped(self) -> list[str]:
        """Kinds with more values above ``massive_abs`` than ``massive_cap``: their massive tables hold the largest
        ones only (raise the cap or the threshold)."""
        return [st.kind for st in self._tokens() if st.massive.overflowed]

    def massive_recurrence(self, massive: pd.DataFrame | None = None) -> pd.DataFrame:
        """Where the massive activations recur.

        Args:
            massive: ``massive()``'s table, when the caller has it already."""
        sequences = max((st.sequences for st in self._tokens()), default=0)
        return act.recurrence_frame(self.massive() if massive is None else massive, sequences)

    def int8_features(self) -> pd.DataFrame:
        return _concat_frames([act.int8_frame(st) for st in self._tokens()])

    def sink_table(self) -> pd.DataFrame:
        return _concat_frames([self.sinks[k].frame() for k in sorted(self.sinks)])

    def act_scales(self) -> dict[str, torch.Tensor]:
        """SmoothQuant's ``act_scales.pt`` of the observed ``nn.Linear`` inputs (empty when none were observed)."""
        return act.act_scales(self._tokens())

    def topk_points(self, maps: bool) -> pd.DataFrame:
        """Top-k with locations of every map kind, or of every token kind beyond Table 5's two, with a ``point`` column.

        Args:
            maps: True for the map kinds, False for the token kinds."""
        frames = []
        for kind in self.kinds():
            if kind not in KINDS and (kind in MAP_KINDS) == maps:
                df = self.topk_frame(kind)
                df.insert(0, "point", kind)
                frames.append(df)
        return _concat_frames(frames)


STATE_CLASSES = (OutlierStats, LogitStats, TokenStats, HiddenStats, SinkStats, TopK, Moments, Exceedances, LogBins)


def _concat_frames(frames: list[pd.DataFrame], columns: list[str] | None = None) -> pd.DataFrame:
    frames = [f for f in frames if not f.empty]
    if frames:
        return pd.concat(frames, ignore_index=True)
    return pd.DataFrame(columns=columns) if columns else pd.DataFrame()
