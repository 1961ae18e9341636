"""How far the damping's summation order moves GPTQ's rounded weights (issue #63): every quantized linear's weights
calibrated with the mean of a contiguous copy of the Hessian's diagonal (outlierscope today, GPT-QModel's order)
against the mean over a strided view (outlierscope before), on the same model, spec and calibration tokens; and a
control: the same calibration run twice with today's code (0 differences: the calculation is deterministic).

Usage: .venv/bin/python bench/gptq_damping_change.py MODEL SPEC [SPEC ...] >> bench/results/gptq_damping/runs.txt
"""

from __future__ import annotations

import sys
import time

import torch


def strided_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """``inverse_hessian_factor`` as it was: the damping's mean over a strided view of the diagonal."""
    h = h.clone()
    h.diagonal().add_(damp * torch.mean(h.diagonal()))
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def rounded(lm, spec, seqs, sites) -> dict[str, torch.Tensor]:
    from outlierscope.quant.weights.gptq_model import gptq_model

    return {n: r.weight(torch.float32) for n, r in gptq_model(lm.model, seqs, spec, sites, progress=False).items()}


def differ(a: dict, b: dict) -> tuple[int, int]:
    """(linears that differ, weights that differ)."""
    counts = [int((a[n] != b[n]).sum()) for n in a]
    return sum(c > 0 for c in counts), sum(counts)


def main() -> None:
    from outlierscope.io import git_commit, machine
    from outlierscope.models.loading import load_model
    from outlierscope.quant.linears.sites import linear_sites
    from outlierscope.quant.specs.spec import QuantSpec
    from outlierscope.quant.weights import gptq as G
    from outlierscope.quant.weights.sequential import calibration_sequences

    model, specs = sys.argv[1], sys.argv[2:]
    lm = load_model(model)
    print(f"# {model}; commit {git_commit()}; {machine()['cpu']}, {torch.get_num_threads()} threads", flush=True)
    for text in specs:
        spec = QuantSpec.parse(text)
        seqs = calibration_sequences(lm.tokenizer, spec.calib, spec.gptq, None)  # (N, T)
        sites = linear_sites(lm.model, spec)
        started = time.perf_counter()
        today, again = rounded(lm, spec, seqs, sites), rounded(lm, spec, seqs, sites)
        real, G.inverse_hessian_factor = G.inverse_hessian_factor, strided_factor
        try:
            before = rounded(lm, spec, seqs, sites)
        finally:
            G.inverse_hessian_factor = real
        n = sum(w.numel() for w in today.values())
        (lc, wc), (lb, wb) = differ(today, again), differ(today, before)
        print(f"{model} | {text} | {tuple(seqs.shape)} calibration | {len(today)} linears, {n} weights | control "
              f"(today twice): {lc} linears, {wc} weights differ | strided mean: {lb} linears, {wb} weights differ | "
              f"{time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
