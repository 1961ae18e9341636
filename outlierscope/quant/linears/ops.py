"""Tensor operations of linear-layer quantization (pure: no state, never mutate the input).

* ``quantize_activation(x, valid, tq, outlier_cols)``: a linear's input (B, T, C) quantized-dequantized per a
  ``TensorQuant`` ``a=`` part: ``per_token`` (C values of a token), ``per_group:G``
  (G consecutive channels of a token), ``per_tensor`` (a sequence's valid tokens), ``static`` (one given absmax),
  MX / NVFP4 blocks along C (NVFP4's per-tensor scale: the sequence's absmax). Padding (``valid`` False) never enters a
  scale and comes back unchanged. ``outlier_cols`` (B, 1, C): columns kept in full precision and left out of the
  scales (LLM.int8's decomposition).
* ``quantize_weight(w, tq)``: a weight (O, I) per a ``w=`` part: ``per_channel`` (an output row), ``per_group:G``
  (G consecutive inputs of a row), ``per_tensor``; MX / NVFP4 blocks along I (NVFP4's per-tensor scale: the weight's).
* ``smooth_scales(act_max, weight_max, alpha)``: SmoothQuant's ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``.
* ``outlier_columns(x, valid, threshold)``: LLM.int8's outlier feature dimensions per sequence.
* ``rotation(d, seed)``: an orthonormal random-sign Hadamard matrix (signs on the input side, as QuaRot's) of any
  order ``2^k * m`` where a Hadamard matrix of order m comes from Paley's constructions (QuaRot's non-power-of-2 sizes: 12, 20, 28, 36, 44, 60, 108, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.numerics.exact import random_sign_hadamard, random_signs, sylvester
from outlierscope.quant.numerics.fused import fusable
from outlierscope.quant.numerics.registry import Block
from outlierscope.quant.specs.parts import TensorQuant


def _grouped(x: torch.Tensor, size: int, what: str) -> torch.Tensor:
    if x.shape[-1] % size:
        raise OutlierscopeError(f"{what}: {x.shape[-1]} channels are not a multiple of the group size {size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)  # (..., C/G, G)


@fusable
def quantize_activation(x: torch.Tensor, valid: torch.Tensor | None, tq: TensorQuant,
                        outlier_cols: torch.Tensor | None = None, static_amax: torch.Tensor | None = None,
                        scale_skip: torch.Tensor | None = None) -> torch.Tensor:
    """A linear's input quantized-dequantized per an ``a=`` part; a new tensor in x's dtype.

    Args:
        x: the input ``(B, T, C)``.
        valid: bool ``(B, T)``: the real tokens; None: all.
        tq: the ``a=`` part.
        outlier_cols: ``(B, 1, C)`` channels that come back unquantized and enter no scale (LLM.int8's decomposition).
        static_amax: the calibrated absmax of ``a=.../static``.
        scale_skip: ``(B, T, C)`` entries left out of the scales instead of the outlier columns (bitsandbytes' rule:
            the outlier elements alone)."""
    B, T, C = x.shape
    v = None  # every entry real and quantized: no mask to build or apply (the common token-local case)
    if valid is not None or outlier_cols is not None:
        v = (torch.ones(B, T, dtype=torch.bool, device=x.device) if valid is None else valid)[..., None].expand(B, T, C)
    keep = v
    if outlier_cols is not None:
        keep = v & ~outlier_cols  # (B, T, C): outlier columns stay as they are
        v = keep if scale_skip is None else v & ~scale_skip  # (B, T, C): what enters the scales
    w = x if v is None else x.masked_fill(~v, 0)
    fmt = tq.fmt
    if isinstance(fmt, Block):
        amax = w.abs().amax((1, 2))[:, None] if fmt.global_scale else None  # (B, 1): each sequence's
        out = fmt.blocks(w, amax)
    elif tq.granularity == "static":
        out = fmt.quantize_static(w, static_amax.to(torch.float64 if x.dtype == torch.float64 else torch.float32),
                                  tq.bits)
    elif tq.granularity == "per_group":
        out = fmt.quantize(_grouped(w, tq.size, str(tq)), (-1,), None if v is None else _grouped(v, tq.size, str(tq)),
                           tq.bits).reshape(B, T, C)
    else:
        out = fmt.quantize(w, (-1,) if tq.granularity == "per_token" else (1, 2), v, tq.bits)
    return out if keep is None else torch.where(keep, out, x)


@fusable
def quantize_weight(w: torch.Tensor, tq: TensorQuant) -> torch.Tensor:
    """A weight quantized-dequantized per a ``w=`` part; a new tensor in w's dtype.

    Args:
        w: the weight ``(O, I)``.
        tq: the ``w=`` part (per_channel, per_group, per_tensor or a block format)."""
    fmt = tq.fmt
    if isinstance(fmt, Block):
        return fmt.blocks(w, w.abs().amax()[None] if fmt.global_scale else None)
    if tq.granularity == "per_group":
        return fmt.quantize(_grouped(w, tq.size, str(tq)), (-1,), None, tq.bits).reshape(w.shape)
    return fmt.quantize(w, (1,) if tq.granularity == "per_channel" else (0, 1), None, tq.bits)


def smooth_scales(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors ``max|X_j|^alpha / max|W_j|^(1 - alpha)``, in float64.

    Clamped at 1e-5 as smoothquant's ``smooth_ln_fcs``; a channel never seen nonzero gets 1.

    Args:
        act_max: max |X_j| per input channel, from calibration.
        weight_max: max |W_ij| per input channel.
        alpha: the migration strength."""
    a = act_max.double().clamp(min=1e-5)
    s = (a.pow(alpha) / weight_max.double().clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-5)
    return torch.where(act_max > 0, s, torch.ones_like(s))


def outlier_columns(x: torch.Tensor, valid: torch.Tensor | None, threshold: float) -> torch.Tensor:
    """The input channels of each sequence where some valid token has |x| >= threshold: ``(B, 1, C)`` bool.

    Args:
        x: the input ``(B, T, C)``.
        valid: bool ``(B, T)``; None: all.
        threshold: LLM.int8's outlier threshold."""
    a = x.abs() >= threshold  # (B, T, C)
    if valid is not None:
        a = a & valid[..., None]
    return a.any(1, keepdim=True)


def _paley(q: int) -> torch.Tensor:
    """A Hadamard matrix from the prime ``q``: order q + 1 (Paley I, q = 3 mod 4) or 2(q + 1) (Paley II, q = 1 mod
    4), entries +-1, float64."""
    squares = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if i in squares else -1.0 for i in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    jac = chi[(idx[None, :] - idx[:, None]) % q]  # (q, q): Jacobsthal Q[i, j] = chi(j - i)
    n = q + 1
    c = torch.zeros(n, n, dtype=torch.float64)  # the conference matrix [[0, 1^T], [+-1, Q]]
    c[0, 1:] = 1
    c[1:, 0] = -1 if q % 4 == 3 else 1
    c[1:, 1:] = jac
    if q % 4 == 3:
        return c + torch.eye(n, dtype=torch.float64)
    one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    two = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, one) + torch.kron(torch.eye(n, dtype=torch.float64), two)


def _is_prime(q: int) -> bool:
    return q > 2 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _base_order(d: int) -> tuple[int, int | None]:
    """(m, prime): ``d = 2^k * m`` with a Paley matrix of order m from ``prime`` (None: m = 1, d a power of 2)."""
    if d & (d - 1) == 0:
        return 1, None
    odd = d
    while odd % 2 == 0:
        odd //= 2
    m = odd
    while m <= d:  # the smallest m: the most of the matrix Sylvester's
        for q in (m - 1, m // 2 - 1):
            if q > 2 and (q % 4 == 3 and q + 1 == m or q % 4 == 1 and 2 * (q + 1) == m) and _is_prime(q):
                return m, q
        m *= 2
    raise OutlierscopeError(f"no Hadamard matrix of order {d} is built here (needs 2^k * m with m = q + 1, q a prime "
                            "= 3 mod 4, or m = 2(q + 1), q a prime = 1 mod 4, as QuaRot's sizes); leave out rotate")


def rotation(d: int, seed: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """A ``(d, d)`` orthonormal random-sign Hadamard matrix ``diag(signs) . H / sqrt(d)``: QuaRot's randomized one.

    H is Sylvester's for a power of 2 (the matrix of ``hadamard``), else ``kron(Paley's H_m, Sylvester's H_2^k)``. The
    dense form of ``rotation_factors``, which is what a ``rotate:`` spec computes with.

    Args:
        d: the size.
        seed: the signs' seed.
        dtype: the matrix's dtype.
        device: its device."""
    m, q = _base_order(d)
    h = sylvester(d // m)
    if q is not None:
        h = torch.kron(_paley(q), h)  # (d, d)
    return random_sign_hadamard(h, seed, dtype, device)


@dataclass(frozen=True, eq=False)
class Rotation:
    """``rotation``'s matrix ``R = diag(signs) . kron(A, B) / sqrt(d)`` kept as its two +-1 factors, d = m k.

    ``x @ R`` is ``A^T (X B)`` for X a row of x as ``(m, k)``: d (m + k) multiply-adds a row instead of d^2 (SmolLM2's
    576 = 36 x 16: 11x fewer), as QuaRot's kernels apply a non-power-of-2 Hadamard. Its sums run in another order than
    the dense product's: equal to it in float64 up to rounding (tested), not bit for bit in float32.

    Attributes:
        d: the size.
        signs: ``(d,)`` float64 +-1, the seed's, on the input side.
        outer: A ``(m, m)`` float64 +-1: Paley's, or Sylvester's for a power of 2.
        inner: B ``(k, k)`` float64 +-1: Sylvester's."""

    d: int
    signs: torch.Tensor
    outer: torch.Tensor
    inner: torch.Tensor
    _on: dict = field(default_factory=dict, repr=False)  # (dtype, device) -> (signs, A^T, B) there

    def matrix(self, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
        """The dense ``(d, d)`` matrix: ``rotation``'s bytes.

        Args:
            dtype: its dtype.
            device: its device."""
        return (self.signs[:, None] * torch.kron(self.outer, self.inner) / math.sqrt(self.d)).to(dtype=dtype, device=device)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ R`` along x's last dim, in float32 at least (float64 for float64), back in x's dtype; a new tensor.

        Args:
            x: the tensor ``(..., d)``."""
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        key = (work, x.device)
        if key not in self._on:
            self._on[key] = tuple(t.to(x.device, work) for t in (self.signs, self.outer.T.contiguous(), self.inner))
        signs, outer_t, inner = self._on[key]
        m, k = outer_t.shape[0], inner.shape[0]
        y = (x.to(work) * signs).reshape(-1, m, k) @ inner  # (N, m, k): each row's X B
        y = torch.matmul(outer_t, y)  # (N, m, k): A^T (X B)
        return y.mul_(1 / math.sqrt(self.d)).reshape(x.shape).to(x.dtype)  # (..., d)


def rotation_factors(d: int, seed: int) -> Rotation:
    """``rotation``'s matrix as its factors: A Paley's H_m and B Sylvester's H_2^k, or two Sylvester matrices.

    For a power of 2 the factors are two Sylvester matrices of about sqrt(d) each (H_2^(a+b) is kron(H_2^a, H_2^b)).

    Args:
        d: the size.
        seed: the signs' seed."""
    m, q = _base_order(d)
    if q is None:
        m = 2 ** ((d.bit_length() - 1) // 2)  # 2^floor(log2(d) / 2)
    outer = _paley(q) if q is not None else sylvester(m)
    return Rotation(d, random_signs(d, seed), outer, sylvester(d // m))
