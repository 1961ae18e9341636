"""Tensor operations of attention quantization (pure: no state, never mutate the input): quantize q/k/v (B, H, T, d)
and probabilities (B, H, t, S) at a ``TensorQuant``'s granularity, and the
transforms that are exact in full precision (K and Q smoothing, a random-sign Hadamard rotation).

Valid tokens (``valid``: (B, T), False for padding) never enter a scale, a mean or a block's max, and come back
unchanged. Groups of tokens (``per_block:N``, ``per_channel:N``, Q smoothing's blocks of rows, v's MX/NVFP4 blocks,
P's blocks along the keys) are counted from each sequence's first real token, as a varlen kernel and a KV cache see
it: a sequence gets the same blocks alone, left-padded or right-padded in a batch. Granules, for q/k/v (B, H, T, d)::

    per_tensor     (H, T, d) of one sequence          per_channel    (T,) of one head and channel
    per_head       (T, d) of one head                  per_channel:N  N consecutive tokens of one channel
    per_token      (d,) of one token and head          per_block:N    (N, d): N consecutive tokens of one head
    per_group:G    G consecutive channels of a token    MX / NVFP4     32 / 16 along head_dim (q, k) or tokens (v)
"""

from __future__ import annotations

import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.numerics.exact import hadamard, smooth_k  # noqa: F401 (the attention transforms' arithmetic)
from outlierscope.quant.numerics.formats import pad_to
from outlierscope.quant.numerics.fused import fusable
from outlierscope.quant.numerics.primitives import every
from outlierscope.quant.numerics.registry import Block
from outlierscope.quant.specs.parts import TensorQuant


def first_real(valid: torch.Tensor) -> torch.Tensor:
    """The index of each row's first True (0 for a row with none): ``(B,)``.

    Args:
        valid: bool ``(B, T)``."""
    return valid.to(torch.int8).argmax(-1)


def _rolled(x: torch.Tensor, start: torch.Tensor, dim: int, back: bool = False) -> torch.Tensor:
    """``x`` with each sequence b rolled along ``dim`` so that index ``start[b]`` comes first (``back``: the inverse).
    Padding is contiguous (left or right), so the real tokens stay in order and the padding follows them."""
    n = x.shape[dim]
    shift = -start if back else start
    idx = (torch.arange(n, device=x.device)[None] + shift[:, None]) % n  # (B, n)
    shape = [1] * x.dim()
    shape[0], shape[dim] = x.shape[0], n
    return x.gather(dim, idx.view(shape).expand(x.shape))


def _from_start(fn, x: torch.Tensor, valid: torch.Tensor, start: torch.Tensor | None, dim: int,
                valid_dim: int) -> torch.Tensor:
    """``fn(x', valid')`` with each sequence of ``x`` (along ``dim``) and ``valid`` (along ``valid_dim``) rolled so that
    index ``start[b]`` comes first, the result rolled back: groups counted from there. Where every start is 0 (right
    padding, no padding) or ``start`` is None nothing is copied."""
    if start is None or every(start == 0):  # while compiling: rolled by 0, the same bytes
        return fn(x, valid)
    return _rolled(fn(_rolled(x, start, dim), _rolled(valid, start, valid_dim)), start, dim, back=True)


def _from_first_real(fn, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``_from_start`` for q/k/v ``x`` (B, H, T, d) and ``valid`` (B, T): token groups counted from each
    sequence's first real token."""
    return _from_start(fn, x, valid, first_real(valid), 2, 1)


def _granules(x: torch.Tensor, valid: torch.Tensor, tq: TensorQuant) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """``x`` (B, H, T, d) and its validity reshaped so that one granule is the reduced dims; returns (x', valid',
    dims), both padded (padding invalid) where a size does not divide T or d."""
    B, H, T, d = x.shape
    v = valid[:, None, :, None].expand(B, H, T, d)  # (B, H, T, d)
    g, n = tq.granularity, tq.size
    if g == "per_tensor":
        return x, v, (1, 2, 3)
    if g == "per_head":
        return x, v, (2, 3)
    if g in ("per_token", "per_row"):
        return x, v, (3,)
    if g == "per_group":
        if d % n:
            raise OutlierscopeError(f"{tq}: head_dim {d} is not a multiple of the group size {n}")
        return x.reshape(B, H, T, d // n, n), v.reshape(B, H, T, d // n, n), (4,)  # (B, H, T, d/G, G)
    if g == "per_channel" and n is None:
        return x, v, (2,)
    xp, vp = pad_to(x, 2, n), pad_to(v, 2, n)  # per_block:N, per_channel:N: groups of N tokens
    shape = (B, H, xp.shape[2] // n, n, d)  # (B, H, T/N, N, d)
    return xp.reshape(shape), vp.reshape(shape), (3, 4) if g == "per_block" else (3,)


def _sequence_blocks(w: torch.Tensor, fmt: Block) -> torch.Tensor:
    """A block format along the last dim of a (B, H, n, m) tensor whose invalid entries are zero; a global scale's
    amax per sequence."""
    amax = w.abs().amax((1, 2, 3))[:, None, None] if fmt.global_scale else None  # (B, 1, 1)
    return fmt.blocks(w, amax)


def _block_format(x: torch.Tensor, valid: torch.Tensor, tq: TensorQuant) -> torch.Tensor:
    """q, k: blocks along head_dim; v: along tokens (the dimension P.V reduces). Padding tokens enter as zeros."""
    v4 = valid[:, None, :, None]  # (B, 1, T, 1)
    w = x.masked_fill(~v4, 0)
    if tq.target == "v":
        w = w.transpose(2, 3)  # (B, H, d, T)
    q = _sequence_blocks(w, tq.fmt)
    if tq.target == "v":
        q = q.transpose(2, 3)  # (B, H, T, d)
    return torch.where(v4, q, x)


def groups_tokens(tq: TensorQuant) -> bool:
    """Whether a part groups consecutive tokens (its result then depends on where the groups start).

    Args:
        tq: the q/k/v part."""
    if isinstance(tq.fmt, Block):
        return tq.target == "v"
    return tq.granularity in ("per_block", "per_channel") and tq.size is not None


@fusable(dynamic=True)  # shape-generic from the first call: see outlierscope.quant.numerics.fused
def quantize_tokens(x: torch.Tensor, valid: torch.Tensor, tq: TensorQuant) -> torch.Tensor:
    """q, k or v quantized-dequantized per a part; groups of tokens start at each sequence's first real token.

    Args:
        x: ``(B, H, T, d)``.
        valid: bool ``(B, T)``.
        tq: the ``q=`` / ``k=`` / ``v=`` part.

    Returns:
        A new tensor in x's dtype."""
    if groups_tokens(tq):
        return _from_first_real(lambda x_, v_: _quantize_tokens(x_, v_, tq), x, valid)
    return _quantize_tokens(x, valid, tq)


def _quantize_tokens(x: torch.Tensor, valid: torch.Tensor, tq: TensorQuant) -> torch.Tensor:
    if isinstance(tq.fmt, Block):
        return _block_format(x, valid, tq)
    xg, vg, dims = _granules(x, valid, tq)
    out = tq.fmt.quantize(xg, dims, vg, tq.bits)
    B, H, T, d = x.shape
    if out.dim() == 5 and tq.granularity != "per_group":
        out = out.reshape(B, H, -1, d)[:, :, :T]  # (B, H, T, d): the padding tokens cut off
    return out.reshape(x.shape)


@fusable(dynamic=True)
def quantize_probs(p: torch.Tensor, valid: torch.Tensor, tq: TensorQuant, key_start: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities quantized-dequantized per a ``probs=`` part.

    ``per_row``: absmax over a row's keys; ``static``: scale 1 / the format's max (P <= 1); a block format: blocks
    along the keys, counted from each sequence's first real key.

    Args:
        p: the probabilities ``(B, H, t, S)``.
        valid: bool, broadcastable to ``p``.
        tq: the part.
        key_start: ``(B,)`` each sequence's first real key; None: key 0."""
    valid = valid.expand_as(p)
    if isinstance(tq.fmt, Block):
        def blocks(p_, v_):
            return torch.where(v_, _sequence_blocks(p_.masked_fill(~v_, 0), tq.fmt), p_)

        return _from_start(blocks, p, valid, key_start, 3, 3)
    if tq.granularity == "static":
        return tq.fmt.quantize_static(p, 1.0, tq.bits, valid)  # P <= 1
    return tq.fmt.quantize(p, (3,), valid, tq.bits)


def smooth_q(q: torch.Tensor, valid: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SageAttention2's q smoothing: ``(q - m, m)``, m the per-channel mean of q over blocks of rows, per head.

    Means over valid rows only, blocks counted from each sequence's first real row, broadcast back to
    ``(B, H, T, d)``. SageAttention2 adds ``m . k^T`` back in full precision, so this too is exact.

    Args:
        q: the queries ``(B, H, T, d)``.
        valid: bool ``(B, T)``.
        rows: rows per block."""
    m = _from_first_real(lambda q_, v_: _block_means(q_, v_, rows), q, valid)
    return q - m, m


def _block_means(q: torch.Tensor, valid: torch.Tensor, rows: int) -> torch.Tensor:
    B, H, T, d = q.shape
    qp = pad_to(q, 2, rows).reshape(B, H, -1, rows, d)  # (B, H, T/rows, rows, d)
    vp = pad_to(valid[:, None, :, None].to(q.dtype).expand(B, 1, T, 1), 2, rows).reshape(B, 1, -1, rows, 1)  # (B, 1, T/rows, rows, 1)
    mean = (qp * vp).sum(3, keepdim=True) / vp.sum(3, keepdim=True).clamp_min(1)  # (B, H, T/rows, 1, d)
    return mean.expand_as(qp).reshape(B, H, -1, d)[:, :, :T]  # (B, H, T, d)
