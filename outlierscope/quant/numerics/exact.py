"""Transforms that are exact in full precision (pure tensor work: no state, never mutate the input): K smoothing
(exact under softmax) and random-sign Hadamard rotations (orthonormal)."""

from __future__ import annotations

import math

import torch

from outlierscope.errors import OutlierscopeError


def smooth_k(k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """K minus its per-channel mean over the sequence's valid tokens, per head; exact under softmax.

    It subtracts ``q . mean(k)`` from every logit of a row.

    Args:
        k: the keys ``(B, KV, S, d)``.
        valid: bool ``(B, S)``."""
    v = valid[:, None, :, None].to(k.dtype)  # (B, 1, S, 1)
    mean = (k * v).sum(2, keepdim=True) / v.sum(2, keepdim=True).clamp_min(1)  # (B, KV, 1, d)
    return k - mean


def sylvester(d: int) -> torch.Tensor:
    """Sylvester's ``(d, d)`` Hadamard matrix (entries +-1, float64).

    Args:
        d: a power of 2."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)  # (2n, 2n)
    return h


def random_sign_hadamard(h: torch.Tensor, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    """QuaRot's randomized Hadamard ``diag(signs) . h / sqrt(d)``, the signs drawn from a seed.

    The signs sit on the input side (``x @ R = (x * signs) @ h / sqrt(d)``), so they change what is quantized; on the
    output side they would only flip the signs of the rotated values, which a symmetric quantizer commutes with.

    Args:
        h: a ``(d, d)`` +-1 Hadamard matrix.
        seed: the signs' seed.
        dtype: the result's dtype.
        device: its device."""
    d = h.shape[0]
    return (random_signs(d, seed)[:, None] * h / math.sqrt(d)).to(dtype=dtype, device=device)  # (d, d): row i times signs[i]


def random_signs(d: int, seed: int) -> torch.Tensor:
    """The ``(d,)`` float64 signs +-1 a seed draws for ``random_sign_hadamard``.

    Args:
        d: the size.
        seed: the seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (d,), generator=g, dtype=torch.float64) * 2 - 1


def hadamard(d: int, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A ``(d, d)`` orthonormal random-sign Hadamard matrix ``diag(signs) . H_d / sqrt(d)`` (Sylvester's H_d).

    Args:
        d: the size, a power of 2.
        seed: the signs' seed.
        dtype: the matrix's dtype.
        device: its device.

    Raises:
        OutlierscopeError: a size that is not a power of 2."""
    if d < 1 or d & (d - 1):
        raise OutlierscopeError(f"a Hadamard rotation needs a power-of-2 head_dim, got {d}; leave out hadamard")
    return random_sign_hadamard(sylvester(d), seed, dtype, device)
