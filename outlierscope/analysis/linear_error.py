"""What quantizing the linear layers does to each one's output: the relative error per token
``||x W^T - x~ W~^T|| / ||x W^T||`` (the reference: the layer's unquantized weight on the input the quantized model
gives it, so each linear's own error, not what earlier layers passed on), per decoder layer and linear (its path
inside the layer: ``self_attn.q_proj`` ... ``mlp.down_proj``), over the real tokens.

``LinearErrorStats`` keeps the sums per virtual shard (``outlierscope.parallel``), as
``AttentionErrorStats`` does, so 1 process, N processes and N ``--shard``
runs give the same bytes. ``quantize_linears`` (``error=stats``) feeds it.
"""

from __future__ import annotations

import pandas as pd
import torch

from outlierscope.analysis.attention_error import _ordered_sum
from outlierscope.parallel import VIRTUAL_SHARDS


class LinearErrorStats:
    """Per (layer, linear): the number of real tokens, and the sum and maximum of their relative output errors.

    Args:
        n_layers: the model's decoder layers.
        linears: the names of the quantized linears in a layer (``mlp.down_proj``, ...)."""

    FIELDS = ("rows", "rel_sum", "rel_max")
    SHARD_COLUMNS = ["vshard", "layer", "k", "linear", *FIELDS]  # k: the linear's index (its order in the layer)

    def __init__(self, n_layers: int, linears: list[str]):
        self.n_layers, self.linears = n_layers, list(linears)
        shape = (VIRTUAL_SHARDS, n_layers, len(self.linears))  # (S, L, K)
        self.per_shard = {f: torch.zeros(shape, dtype=torch.int64 if f == "rows" else torch.float64)
                          for f in self.FIELDS}
        self.shard = 0

    def set_shard(self, shard: int) -> None:
        """Set the virtual shard the next tokens belong to (the batch's: ``shard_of(batch)``).

        Args:
            shard: 0 .. VIRTUAL_SHARDS - 1."""
        self.shard = shard

    def update(self, layer: int, linear: str, ref: torch.Tensor, out: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Add the tokens of one forward of a linear.

        Args:
            layer: the decoder layer.
            linear: the linear's name (one of ``linears``).
            ref: the unquantized output ``(..., out_features)``.
            out: the quantized output, the same shape.
            valid: bool over the leading dims: the real tokens; None: every token."""
        r = ref.double().reshape(-1, ref.shape[-1])  # (N, O)
        err = (out.double().reshape(r.shape) - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(torch.finfo(torch.float64).tiny)
        keep = torch.ones_like(err, dtype=torch.bool) if valid is None else valid.reshape(-1).to(err.device)
        err = torch.where(keep, err, 0.0).cpu()
        k, s, at = self.linears.index(linear), self.shard, self.per_shard
        at["rows"][s, layer, k] += int(keep.sum())
        at["rel_sum"][s, layer, k] += err.sum()
        at["rel_max"][s, layer, k] = torch.maximum(at["rel_max"][s, layer, k], err.max() if err.numel() else err.sum())

    def merge(self, other: LinearErrorStats) -> LinearErrorStats:
        """Add another's tokens: other virtual shards of the same run, exactly.

        Args:
            other: statistics of the same layers and linears.

        Returns:
            self."""
        if (other.n_layers, other.linears) != (self.n_layers, self.linears):
            raise ValueError(f"shapes differ: ({self.n_layers}, {self.linears}) vs ({other.n_layers}, {other.linears})")
        for f, t in self.per_shard.items():
            t.copy_(torch.maximum(t, other.per_shard[f]) if f == "rel_max" else t + other.per_shard[f])
        return self

    def shard_table(self) -> pd.DataFrame:
        """The raw numbers per virtual shard, layer and linear with tokens: what a ``--shard`` run saves."""
        idx = torch.nonzero(self.per_shard["rows"] > 0)  # (R, 3): (shard, layer, linear)
        cols = {"vshard": idx[:, 0].numpy(), "layer": idx[:, 1].numpy(), "k": idx[:, 2].numpy(),
                "linear": [self.linears[int(k)] for k in idx[:, 2]]}
        cols.update({f: self.per_shard[f][idx[:, 0], idx[:, 1], idx[:, 2]].numpy() for f in self.FIELDS})
        return pd.DataFrame(cols, columns=self.SHARD_COLUMNS)

    @classmethod
    def from_shard_tables(cls, tables: list[pd.DataFrame], n_layers: int) -> LinearErrorStats:
        """The statistics of ``shard_table`` parts (disjoint virtual shards) combined.

        Args:
            tables: the parts' shard tables.
            n_layers: the model's decoder layers."""
        rows = pd.concat([t for t in tables if len(t)], ignore_index=True) if any(len(t) for t in tables) else None
        names = dict(zip(rows["k"], rows["linear"])) if rows is not None else {}
        linears = [names.get(k, f"unseen_{k}") for k in range(1 + max(names, default=-1))]
        st = cls(n_layers, linears)
        if rows is None:
            return st
        i = [torch.as_tensor(rows[c].to_numpy().copy()) for c in ("vshard", "layer", "k")]
        for f, t in st.per_shard.items():
            t[i[0], i[1], i[2]] = torch.as_tensor(rows[f].to_numpy().copy(), dtype=t.dtype)
        return st

    def table(self) -> pd.DataFrame:
        """One row per layer and linear with tokens: tokens, mean and max relative output error."""
        rows, rel_sum = _ordered_sum(self.per_shard["rows"]), _ordered_sum(self.per_shard["rel_sum"])  # (L, K)
        rel_max = self.per_shard["rel_max"].amax(0)
        recs = [{"layer": layer, "linear": name, "tokens": int(rows[layer, k]),
                 "rel_err_mean": float(rel_sum[layer, k] / rows[layer, k]), "rel_err_max": float(rel_max[layer, k])}
                for layer in range(self.n_layers) for k, name in enumerate(self.linears) if rows[layer, k] > 0]
        return pd.DataFrame(recs, columns=["layer", "linear", "tokens", "rel_err_mean", "rel_err_max"])
