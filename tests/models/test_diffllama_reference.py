"""DiffLlamaAttention against an independent float64 implementation of the paper's formula.

Ye et al. 2024, eq. (1)-(3): for differential head j with query/key halves (Q1, K1), (Q2, K2)
and value V of width 2d,
    DiffAttn(X) = (softmax(Q1 K1^T / sqrt(d)) - lambda * softmax(Q2 K2^T / sqrt(d))) V,
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init,
    lambda_init = 0.8 - 0.6 * exp(-0.3 * (l - 1)) for the 1-based layer l,
then a per-head RMSNorm without affine weights scaled by (1 - lambda_init), heads concatenated,
and the output projection. Guards against upstream changes in transformers.
"""

import math

import pytest
import torch

from outlierscope.models.presets import PairConfig


def rope64(x, pos, theta):
    """Rotary embedding, rotate-half convention, float64. x: (B, H, T, d)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None, :]  # (T, d/2)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def diff_attention_reference(attn, x, layer, cfg):
    """The paper's differential attention from the module's weights only, in float64. x: (B, T, D)."""
    B, T, _ = x.shape
    H, d = cfg.n_heads, cfg.head_dim
    x = x.double()
    W = {n: getattr(attn, n).weight.double() for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    q = (x @ W["q_proj"].T).view(B, T, H, d).transpose(1, 2)  # (B, H, T, d)
    k = (x @ W["k_proj"].T).view(B, T, H, d).transpose(1, 2)  # (B, H, T, d)
    v = (x @ W["v_proj"].T).view(B, T, H, d).transpose(1, 2)  # (B, H, T, d)
    pos = torch.arange(T)
    q, k = rope64(q, pos, cfg.rope_theta), rope64(k, pos, cfg.rope_theta)
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * ((layer + 1) - 1))
    lam = (torch.exp((attn.lambda_q1.double() * attn.lambda_k1.double()).sum())
           - torch.exp((attn.lambda_q2.double() * attn.lambda_k2.double()).sum()) + lam_init)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    heads = []
    for j in range(H // 2):
        s1 = (q[:, j] @ k[:, j].transpose(-1, -2)) / math.sqrt(d)  # (B, T, T)
        s2 = (q[:, j + H // 2] @ k[:, j + H // 2].transpose(-1, -2)) / math.sqrt(d)  # (B, T, T)
        a1 = torch.softmax(s1.masked_fill(~causal, float("-inf")), -1)
        a2 = torch.softmax(s2.masked_fill(~causal, float("-inf")), -1)
        vj = torch.cat([v[:, j], v[:, j + H // 2]], -1)  # (B, T, 2d)
        h = (a1 - lam * a2) @ vj  # (B, T, 2d)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        heads.append((1 - lam_init) * h)
    out = torch.cat(heads, -1)  # (B, T, H/2 * 2d)
    return out @ W["o_proj"].T


@pytest.mark.parametrize("layer", [0, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_diffllama_attention_matches_paper(layer, seed):
    cfg = PairConfig(name="ref", vocab_size=97, n_layers=4, hidden_size=64, n_heads=4, seq_len=32)
    model = cfg.build("diff", seed=seed).double().eval()
    torch.manual_seed(100 + seed)
    with torch.no_grad():  # non-trivial lambdas so both maps matter
        for p in model.parameters():
            if p.ndim == 1 and p.shape[0] == cfg.head_dim:
                p.normal_(0, 0.3)
    attn = model.model.layers[layer].self_attn
    seen = {}

    def hook(mod, args, kwargs, output):
        seen["x"] = kwargs["hidden_states"]
        seen["y"] = output[0]

    h = attn.register_forward_hook(hook, with_kwargs=True)
    try:
        ids = torch.randint(0, cfg.vocab_size, (2, 17))
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        h.remove()
    ref = diff_attention_reference(attn, seen["x"], layer, cfg)
    rel = (seen["y"] - ref).abs().max() / ref.abs().max()
    assert rel <= 1e-6, rel
    assert abs(attn.lambda_init - (0.8 - 0.6 * math.exp(-0.3 * layer))) < 1e-15
