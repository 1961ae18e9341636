"""Fast loglikelihood scoring of HellaSwag requests, numerically the lm-eval computation.

Two layouts, same numbers (up to float summation order):

* ``shared``: one row per item, ``[ctx | cont_0[:-1] | ... | cont_3[:-1]]`` with a tree-shaped
  boolean mask (each continuation sees the context and its own earlier tokens) and positions that
  restart after the context. The context is run once for its 4 endings. Exact when every row's
  attention depends on its own keys only: unquantized or ``per_row`` logit quantization.
* ``separate``: one row per (item, choice), as lm-eval builds it. Needed for ``per_tensor`` and
  ``per_head`` quantization (the scale sees the whole sequence) and for items lm-eval truncates.

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.eval.requests import Request
from outlierscope.hooks.attention import attention_stages
from outlierscope.hooks.points import trunk
from outlierscope.models.float64 import float64_model
from outlierscope.models.loading import model_device
from outlierscope.parallel import shard_of

LAYOUTS = ("shared", "separate")
HEAD_ROWS = 256  # continuation positions per LM-head block (measured best on the project's CPU: 128-256)


def unchanged_logits(ctx, logits):
    """The logits stage that changes nothing: the unquantized path through our attention.

    Args:
        ctx: the call's ``LogitContext``.
        logits: the scaled logits ``(B, H, t, S)``."""
    return logits


def lm_head(model, frozen: bool = False):
    """The model's LM head as a function of the last hidden states, with its logit scale and soft cap.

    Args:
        model: the causal LM.
        frozen: use the weights the head holds now, whatever a quantization context later puts in its place (the
            unquantized head of a KL divergence, computed inside the quantized model's context).

    Raises:
        OutlierscopeError: a model without output embeddings."""
    head = model.get_output_embeddings()
    if head is None:
        raise OutlierscopeError(f"{type(model).__name__} has no output embeddings (LM head); expected a causal LM")
    cap = getattr(model.config, "final_logit_softcapping", None)
    scale = getattr(model.config, "logit_scale", None)
    if frozen:
        weight, bias = head.weight, head.bias
        head = lambda h: torch.nn.functional.linear(h, weight, bias)  # noqa: E731

    def apply(h: torch.Tensor) -> torch.Tensor:
        logits = head(h)
        if scale is not None:
            logits = logits * scale
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return apply


def gathered_hidden(model, rows: list[dict]) -> tuple[torch.Tensor, list[tuple[int, int]], list[int]]:
    """Run one right-padded batch through the trunk and gather the last hidden states at the scored positions.

    Args:
        model: the causal LM.
        rows: one dict per row: ``ids``, ``pos``, ``mask`` (an L x L bool tree mask, or None: causal) and ``gathers``
            ``[(positions, targets)]``.

    Returns:
        ``(hidden (N, D), owners [(row, gather)], targets)``, in row and gather order."""
    L = max(len(r["ids"]) for r in rows)
    B = len(rows)
    ids = torch.zeros(B, L, dtype=torch.long)
    pos = torch.zeros(B, L, dtype=torch.long)
    tree = rows[0]["mask"] is not None
    mask = torch.zeros(B, 1, L, L, dtype=torch.bool) if tree else torch.zeros(B, L, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r["ids"])
        ids[b, :n] = torch.tensor(r["ids"])
        pos[b, :n] = torch.tensor(r["pos"])
        pos[b, n:] = torch.arange(r["pos"][-1] + 1, r["pos"][-1] + 1 + L - n)  # padding continues the count
        if tree:
            mask[b, 0, :n, :n] = r["mask"]
        else:
            mask[b, :n] = 1
    dev = model_device(model)
    with float64_model(model):
        out = trunk(model)(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev), use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]  # (B, L, D)
    b_idx, p_idx, tgt, owner = [], [], [], []
    for b, r in enumerate(rows):
        for j, (ps, ts) in enumerate(r["gathers"]):
            b_idx += [b] * len(ps)
            p_idx += ps
            tgt += ts
            owner += [(b, j)] * len(ps)
    return hidden[torch.tensor(b_idx), torch.tensor(p_idx)], owner, tgt  # (N, D)


def score_rows(model, head, rows: list[dict]) -> list[np.ndarray]:
    """The summed log-probabilities of each row's gathers, for one padded batch.

    Args:
        model: the causal LM.
        head: ``lm_head(model)``.
        rows: the batch's rows (``batch_rows``)."""
    h, owner, tgt = gathered_hidden(model, rows)
    tgt_t = torch.tensor(tgt, device=h.device)
    # The LM head and log-softmax in blocks of rows: the (rows, V) logits stay in cache (about 2x faster on CPU).
    tok_lp = torch.cat([
        torch.log_softmax(head(h[s : s + HEAD_ROWS]), dim=-1).gather(1, tgt_t[s : s + HEAD_ROWS, None])[:, 0]  # (rows,)
        for s in range(0, len(tgt), HEAD_ROWS)
    ]).double().cpu().numpy()
    sums = [np.zeros(len(r["gathers"])) for r in rows]
    for (b, j), v in zip(owner, tok_lp):
        sums[b][j] += v
    return sums


def _shared_row(req: Request) -> dict:
    c = len(req.ctx)
    ids, pos = list(req.ctx), list(range(c))
    segs = []
    for cont in req.conts:
        start = len(ids)
        ids += list(cont[:-1])
        pos += list(range(c, c + len(cont) - 1))
        segs.append((start, len(cont) - 1))
    n = len(ids)
    m = torch.zeros(n, n, dtype=torch.bool)
    m[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
    gathers = []
    for (start, k), cont in zip(segs, req.conts):
        m[start : start + k, :c] = True
        m[start : start + k, start : start + k] = torch.ones(k, k, dtype=torch.bool).tril()
        gathers.append(([c - 1] + list(range(start, start + k)), list(cont)))
    return {"ids": ids, "pos": pos, "mask": m, "gathers": gathers}


def _separate_row(req: Request, j: int) -> dict:
    inp = req.inputs(j)
    n, k = len(inp), len(req.conts[j])
    if k > n:
        raise OutlierscopeError(
            f"item {req.index}: continuation of {k} tokens does not fit the model's context of {req.max_length}; "
            "lm-eval cannot score it either"
        )
    return {"ids": inp, "pos": list(range(n)), "mask": None, "gathers": [(list(range(n - k, n)), list(req.conts[j]))]}


@torch.no_grad()
def score_requests(model, requests: Sequence[Request], layout: str = "shared", batch_size: int = 32,
                   progress=None, shards: Collection[int] | None = None, on_batch=None) -> np.ndarray:
    """The summed log-probabilities ``(N, C)`` of each item's continuations, in request order (NaN past its choices).

    Args:
        model: the causal LM.
        requests: the items' requests.
        layout: ``shared`` (a context's choices in one tree-masked row) or ``separate``; items lm-eval truncates and
            items with one context per choice are always separate.
        batch_size: (context, ending) sequences per forward; a shared row counts its item's choices.
        progress: called as ``progress(n_items)`` as items finish.
        shards: compute only the batches of these virtual shards (the other scores NaN); the batches are the same
            whatever the shards, so every score equals a whole run's.
        on_batch: called as ``on_batch(k)`` before the forward of batch ``k`` (virtual shard ``shard_of(k)``)."""
    numbered = plan_batches(requests, layout, batch_size, shards)
    scores = empty_scores(requests)
    head = lm_head(model)
    done = BatchProgress(requests, numbered, progress)
    with attention_stages(model, unchanged_logits):
        for k, batch in numbered:
            if on_batch is not None:
                on_batch(k)
            fill_scores(scores, batch, score_rows(model, head, batch_rows(requests, batch)))
            done.batch_done(batch)
    return scores


def plan_batches(requests: Sequence[Request], layout: str, batch_size: int,
                 shards: Collection[int] | None = None) -> list[tuple[int, list[tuple]]]:
    """The numbered batches ``score_requests`` runs, the same whatever ``shards`` keeps.

    Args:
        requests: the items' requests.
        layout: ``shared`` or ``separate``.
        batch_size: sequences per forward.
        shards: keep only the batches of these virtual shards (batch k is in ``shard_of(k)``); None: all.

    Returns:
        ``[(k, [(length, item index, choice or None), ...])]``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if batch_size <= 0:
        raise ParamError("batch_size", ">= 1", batch_size)
    shared, separate = [], []  # (length, item index, choice or None)
    for i, r in enumerate(requests):
        if layout == "shared" and r.ctxs is None and not r.truncated:
            shared.append((len(r.ctx) + sum(len(c) - 1 for c in r.conts), i, None))
        else:
            separate += [(len(r.inputs(j)), i, j) for j in range(len(r.conts))]
    batches = []
    for units, rows in ((shared, max(1, batch_size // 4)), (separate, batch_size)):
        units.sort(key=lambda u: (-u[0], u[1], -1 if u[2] is None else u[2]))  # longest first: little padding
        batches += [units[s : s + rows] for s in range(0, len(units), rows)]
    numbered = list(enumerate(batches))
    if shards is not None:
        keep = set(shards)
        numbered = [(k, b) for k, b in numbered if shard_of(k) in keep]
    return numbered


def empty_scores(requests: Sequence[Request]) -> np.ndarray:
    """An ``(N, C)`` array of NaN, C the most choices of an item.

    Args:
        requests: the items' requests."""
    return np.full((len(requests), max((len(r.conts) for r in requests), default=0)), np.nan)


def batch_rows(requests: Sequence[Request], batch: list[tuple]) -> list[dict]:
    """The rows (ids, positions, mask, gathers) of one planned batch.

    Args:
        requests: the items' requests.
        batch: one batch of ``plan_batches``."""
    return [_shared_row(requests[i]) if j is None else _separate_row(requests[i], j) for _, i, j in batch]


def fill_scores(scores: np.ndarray, batch: list[tuple], values: list[np.ndarray]) -> None:
    """Put one batch's summed log-probabilities in their items' places.

    Args:
        scores: the ``(N, C)`` scores, filled in place.
        batch: the batch.
        values: ``score_rows``' values for it."""
    for (_, i, j), v in zip(batch, values):
        if j is None:
            scores[i, : len(v)] = v
        else:
            scores[i, j] = v[0]


class BatchProgress:
    """Calls ``progress(n)`` with the number of items whose every row has been scored, after each batch.

    Args:
        requests: the items' requests.
        numbered: ``plan_batches``' batches.
        progress: the callback; None: none."""

    def __init__(self, requests: Sequence[Request], numbered: list[tuple[int, list[tuple]]], progress=None):
        self.progress = progress
        self.done = np.zeros(len(requests), dtype=np.int64)
        self.need = np.bincount([u[1] for _, b in numbered for u in b], minlength=len(requests))  # rows per item

    def batch_done(self, batch: list[tuple]) -> None:
        """Count a scored batch and report the items it finished.

        Args:
            batch: the batch."""
        for _, i, _ in batch:
            self.done[i] += 1
        if self.progress is not None:
            self.progress(int(((self.done == self.need) & (self.need > 0)).sum()))
