"""Tables of every observation point beyond Table 5's two: per channel, per position, massive activations and where
they recur, LLM.int8 outlier features, attention sinks, and SmoothQuant's ``act_scales.pt``.

Each function reads one reducer of ``OutlierStats`` (a ``TokenStats`` for
(B, T, C) points, a ``SinkStats`` for attention probabilities) and returns a tidy DataFrame, so one process and
N processes give the same bytes (every quantity below is a count, a max or a float64 sum kept per virtual shard).

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from outlierscope.parallel import VIRTUAL_SHARDS

INT8_THRESHOLD = 6.0  # LLM.int8 (Dettmers et al. 2022): outlier feature magnitude
INT8_LAYER_SHARE = 0.25  # ... in at least 25% of layers
INT8_TOKEN_SHARE = 0.06  # ... and at least 6% of token positions
HEAD_KINDS = ("attn.q", "attn.k", "attn.v", "attn.out")  # token kinds whose channels are (head, dim)


class SinkStats:
    """Attention mass on the first key positions per (layer, head), from probability maps; a reducer.

    Sums over valid query rows of the mass on key 0 and on keys [0, ``sink_k``), and the rows counted; float64 sums
    kept per virtual shard (merged in shard order).

    Args:
        n_layers: the model's decoder layers.
        n_heads: heads per layer.
        sink_k: the key positions counted as the sink.
        kind: the probability point it reads (``attn.probs``)."""

    def __init__(self, n_layers: int, n_heads: int, sink_k: int = 4, kind: str = "attn.probs"):
        self.kind, self.sink_k, self.n_heads = kind, sink_k, n_heads
        self.sums = torch.zeros(VIRTUAL_SHARDS, 2, n_layers, n_heads, dtype=torch.float64)  # (shard, first|first_k, L, H)
        self.rows = torch.zeros(n_layers, n_heads, dtype=torch.int64)
        self.shard = 0
        self.is_diff = False

    def __call__(self, obs) -> None:
        x, layer = obs.x, obs.point.layer  # (B, H, t, S)
        self.is_diff = obs.is_diff
        valid = obs.valid.expand(x.shape[0], -1, -1, -1)  # (B, 1|H, t, S)
        rows = valid.any(-1)  # (B, 1|H, t): real query rows
        k = min(self.sink_k, x.shape[-1])
        head = x[..., :k].masked_fill(~valid[..., :k], 0.0)  # (B, H, t, k)
        first = head[..., 0].masked_fill(~rows, 0.0).sum(-1).double().sum(0)  # (H,)
        first_k = head.sum(-1).masked_fill(~rows, 0.0).sum(-1).double().sum(0)  # (H,)
        self.sums[self.shard, 0, layer] += first.cpu()
        self.sums[self.shard, 1, layer] += first_k.cpu()
        self.rows[layer] += rows.sum((0, 2)).expand(x.shape[1]).cpu()

    def merge(self, other: SinkStats) -> None:
        """Add another's sums (other data of the same model), exactly.

        Args:
            other: sink statistics of the same shape and ``sink_k``."""
        if other.sums.shape != self.sums.shape or other.sink_k != self.sink_k:
            raise ValueError(f"cannot merge sink statistics of shape {tuple(other.sums.shape)} (k={other.sink_k}) "
                             f"into {tuple(self.sums.shape)} (k={self.sink_k})")
        self.sums += other.sums
        self.rows += other.rows
        self.is_diff = self.is_diff or other.is_diff

    def frame(self) -> pd.DataFrame:
        total = self.sums.sum(0)  # shard order: the same for any split
        L, H = self.rows.shape
        layer, head = np.meshgrid(np.arange(L), np.arange(H), indexing="ij")
        rows = self.rows.numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            first, first_k = total[0].numpy() / rows, total[1].numpy() / rows
        df = pd.DataFrame({"point": self.kind, "layer": layer.ravel(), "head": head.ravel(),
                           "map": _maps(head.ravel(), H) if self.is_diff and self.kind == "attn.probs" else "",
                           "rows": rows.ravel(), "mass_first": first.ravel(), "sink_k": self.sink_k,
                           "mass_first_k": first_k.ravel()})
        return df[df["rows"] > 0].reset_index(drop=True)


def _maps(head: np.ndarray, n_heads: int) -> np.ndarray:
    return np.where(head < n_heads // 2, "map1", "map2")


def _layers(st) -> list[int]:
    return [layer for layer in range(st.tokens.shape[0]) if st.tokens[layer] > 0]


def channels_frame(st) -> pd.DataFrame:
    """The ``channels`` table of one token kind.

    Args:
        st: its ``TokenStats``."""
    sumabs = st.shard_sumabs.sum(0)  # in shard order: the same for any split
    frames = []
    for layer in _layers(st):
        ch = np.arange(st.channels)
        n = int(st.tokens[layer])
        heads = st.kind in HEAD_KINDS and st.head_dim
        d = {"point": st.kind, "layer": layer, "channel": ch, "head": ch // st.head_dim if heads else -1,
             "dim": ch % st.head_dim if heads else -1}
        d.update({"tokens": n, "absmax": st.ch_max[layer].numpy(), "argmax_seq": st.ch_at[layer, :, 0].numpy(),
                  "argmax_token": st.ch_at[layer, :, 1].numpy(), "mean_abs": sumabs[layer].numpy() / n,
                  "n_ge6": st.ge6[layer].numpy(), "n_gt100": st.gt100[layer].numpy()})
        frames.append(pd.DataFrame(d))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def positions_frame(st) -> pd.DataFrame:
    """The ``positions`` table of one token kind.

    Args:
        st: its ``TokenStats``."""
    pos_sum = st.shard_pos_sum.sum(0)
    frames = []
    for layer in _layers(st):
        n = st.tokens_pos[layer].numpy()
        at = np.flatnonzero(n)
        with np.errstate(invalid="ignore", divide="ignore"):
            frames.append(pd.DataFrame({"point": st.kind, "layer": layer, "position": at, "tokens": n[at],
                                        "absmax_max": st.pos_max[layer].numpy()[at],
                                        "absmax_mean": pos_sum[layer].numpy()[at] / n[at],
                                        "share_ge6": st.ge6_pos[layer].numpy()[at] / n[at]}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


MASSIVE_COLUMNS = ["point", "layer", "seq", "token", "channel", "token_id", "position_kind", "value", "times_median"]


def massive_frame(st, medians: dict[int, float], rel: float, delimiters: frozenset[int]) -> pd.DataFrame:
    """Every recorded value above the absolute threshold that is also above ``rel`` times its layer's median |x|.

    Args:
        st: the kind's ``TokenStats``.
        medians: layer -> its median |x|.
        rel: the relative threshold.
        delimiters: token ids whose positions are labelled ``delimiter``."""
    st.massive.flush()
    top = st.massive.top
    if not len(top.values):
        return pd.DataFrame(columns=MASSIVE_COLUMNS)
    loc = top.locs.numpy()
    df = pd.DataFrame({"point": st.kind, "layer": loc[:, 0], "seq": loc[:, 2], "token": loc[:, 3], "channel": loc[:, 1],
                       "token_id": loc[:, 4], "value": top.values.numpy()})
    df["position_kind"] = np.where(df["token"] == 0, "first", np.where(df["token_id"].isin(delimiters), "delimiter", "other"))
    df["times_median"] = df["value"] / df["layer"].map(medians)
    df = df[df["times_median"] > rel]
    df = df.sort_values(["layer", "seq", "token", "channel"], kind="stable")
    return df[MASSIVE_COLUMNS].reset_index(drop=True)


def recurrence_frame(massive: pd.DataFrame, sequences: int) -> pd.DataFrame:
    """Where massive activations recur: per (point, layer, channel, position kind), occurrences and sequences.

    Args:
        massive: ``massive_frame``'s table.
        sequences: the sequences seen (for the share)."""
    cols = ["point", "layer", "channel", "position_kind"]
    if massive.empty:
        return pd.DataFrame(columns=[*cols, "occurrences", "sequences", "share_of_sequences"])
    g = massive.groupby(cols, sort=True)
    out = g.size().rename("occurrences").to_frame().join(g["seq"].nunique().rename("sequences")).reset_index()
    out["share_of_sequences"] = out["sequences"] / sequences
    return out


def int8_frame(st) -> pd.DataFrame:
    """LLM.int8's outlier features of one token kind: channels with |x| >= 6 on >= 6% of tokens in >= 25% of layers.

    Args:
        st: the kind's ``TokenStats``."""
    layers = _layers(st)
    cols = ["point", "channel", "layers", "n_layers", "max_share_ge6", "linear"]
    if not layers:
        return pd.DataFrame(columns=cols)
    share = st.ge6[layers].numpy() / st.tokens[layers].numpy()[:, None]  # (L', C)
    hit = share >= INT8_TOKEN_SHARE
    need = math.ceil(INT8_LAYER_SHARE * len(layers))
    rows = [{"point": st.kind, "channel": int(c), "layers": [layers[i] for i in np.flatnonzero(hit[:, c])],
             "n_layers": int(hit[:, c].sum()), "max_share_ge6": float(share[:, c].max()),
             "linear": st.linear_input}
            for c in np.flatnonzero(hit.sum(0) >= need)]
    return pd.DataFrame(rows, columns=cols)


def act_scales(token_stats) -> dict[str, torch.Tensor]:
    """SmoothQuant's ``act_scales.pt``: each observed ``nn.Linear`` input's per-channel max |x|, float32 on the CPU.

    Args:
        token_stats: the ``TokenStats`` of the observed kinds.

    Returns:
        Full module name -> max |x| per channel, in module order."""
    out = {}
    for st in token_stats:
        if not st.linear_input:
            continue
        for layer, name in sorted(st.modules.items()):
            if st.linear.get(layer) and st.tokens[layer] > 0:
                out[name] = st.ch_max[layer].float()
    return dict(sorted(out.items(), key=lambda kv: _natural(kv[0])))


def _natural(name: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
