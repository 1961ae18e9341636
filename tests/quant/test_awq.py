"""AWQ's searches (outlierscope.quant.weights.awq, the group search of awq_model) against GPT-QModel 7.6's own functions
(AutoAWQ's arithmetic; references/awq_gptqmodel_reference.py, its fixture committed) and against AutoAWQ's algorithm
written here in float64 numpy (loops over ratios, rows and groups; the MLP's forward by hand)."""


import json
from pathlib import Path

import numpy as np
import pytest
import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.specs.spec import QuantSpec
from outlierscope.quant.weights.awq import AWQConfig, clip_groups, search_clip, weight_mean
from outlierscope.quant.weights.awq_model import _group_scale

FIXTURE = Path(__file__).parent / "fixtures" / "awq_gptqmodel.safetensors"
PACKED = Path(__file__).resolve().parents[1] / "models" / "packed"


def _mlp():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(PACKED / "float").to(torch.float64).eval().model.layers[0].mlp


def _fixture():
    from safetensors import safe_open

    f = safe_open(FIXTURE, "pt")
    return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.mark.parametrize("bits, group, grid", [(4, 32, "int"), (3, 16, "int"), (4, 32, "zint")])
def test_scales_and_clipping_equal_gpt_qmodels(bits, group, grid):
    """The same inputs (recorded by the reference script) and weights, in float64 (the script says why): the chosen
    scales equal GPT-QModel's within float32 summation order of the means, every clipping bound is its bound (seen failing with ratios i/(n-1), with the
    weight mean over all rows' global max, and with clipping that keeps the last of equal errors)."""
    ref, meta = _fixture()
    assert json.loads(meta["settings"])["n_grid"] == 20
    mlp = _mlp()
    spec = QuantSpec.parse(f"w={grid}{bits}/per_group:{group}; awq")
    key = f"w{bits}g{group}" + ("zp" if grid == "zint" else "")  # zint: AutoAWQ's zero point (its groups span 0)
    x_mlp, x_down = ref["x_mlp"], ref["x_down"]
    with torch.no_grad():
        for tag, linears, judge, x in (("mlp", [mlp.gate_proj, mlp.up_proj], mlp, x_mlp),
                                       ("down", [mlp.down_proj], mlp.down_proj, x_down)):
            s = _group_scale(linears, [x], judge, [((x,), {})], spec)
            torch.testing.assert_close(s, ref[f"{key}.{tag}.scale"], rtol=1e-6, atol=0, msg=tag)
        part = spec.part("w")
        for name, x in (("gate_proj", x_mlp), ("up_proj", x_mlp), ("down_proj", x_down)):
            from outlierscope.quant.linears.ops import quantize_weight

            w = getattr(mlp, name).weight.detach()
            got = search_clip(w, x, lambda v: quantize_weight(v, part), group)
            assert torch.equal(got, ref[f"{key}.{name}.clip"]), name


# --- AutoAWQ in float64, written from its code (awq/quantize/quantizer.py) -------------------------------------------


def _q(w, bits, group):
    """AutoAWQ's symmetric pseudo-quantization of w (O, I) in groups (float64)."""
    o, i = w.shape
    g = w.reshape(-1, group)
    m = np.maximum(np.abs(g).max(1, keepdims=True), 1e-5) / (2 ** (bits - 1) - 1)
    return (np.clip(np.round(g / m), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * m).reshape(o, i)


def _silu(x):
    return x / (1 + np.exp(-x))


def _ref_scale(ws, forward, x, bits, group, n_grid=20):
    """_search_best_scale: w_mean over the concatenated weights, x_mean, then the ratio loop with the loss of the
    judging forward (every linear at Q(W s) / s)."""
    cat = np.concatenate(ws)
    a = np.abs(cat).reshape(-1, group)
    w_mean = (a / (a.max(1, keepdims=True) + 1e-6)).reshape(cat.shape).mean(0)
    x_mean = np.abs(x).reshape(-1, x.shape[-1]).mean(0)
    want = forward(ws, x)
    best, best_err = None, np.inf
    for r in range(n_grid):
        ratio = r / n_grid
        s = np.maximum(x_mean ** ratio / (w_mean ** (1 - ratio) + 1e-4), 1e-4)
        s = s / np.sqrt(s.max() * s.min())
        err = np.mean((forward([_q(w * s, bits, group) / s for w in ws], x) - want) ** 2)
        if err < best_err:
            best, best_err = s, err
    return best


def _ref_clip(w, x, bits, group, n_grid=20, max_shrink=0.5, n_tokens=512):
    """_compute_best_clip, row by row and group by group."""
    x = x.reshape(-1, x.shape[-1])
    x = x[:: max(1, x.shape[0] // n_tokens)]
    o, i = w.shape
    out = np.zeros((o, i // group))
    for r in range(o):
        for gi in range(i // group):
            cols = slice(gi * group, (gi + 1) * group)
            wg, xg = w[r, cols], x[:, cols]
            top = np.abs(wg).max()
            best, least = top, 1e9
            for k in range(int(max_shrink * n_grid)):
                m = top * (1 - k / n_grid)
                q = _q(np.clip(wg, -m, m)[None], bits, group)[0]
                err = np.mean((xg @ q - xg @ wg) ** 2)
                if err < least:
                    best, least = m, err
            out[r, gi] = best
    return out


def test_group_scale_and_clip_equal_autoawq_in_float64():
    """gate/up judged by the MLP's output (down(silu(gate x) * up x), by hand) and down_proj by its own, on
    bf16-valued weights and inputs spanning several groups: the scales and bounds of a float64 AutoAWQ."""
    torch.manual_seed(0)
    i, m, group, bits = 64, 96, 16, 4
    lin = [torch.nn.Linear(i, m, bias=False, dtype=torch.float64) for _ in range(2)]
    down = torch.nn.Linear(m, i, bias=False, dtype=torch.float64)
    with torch.no_grad():
        for layer in (*lin, down):
            layer.weight.copy_(layer.weight.bfloat16().double())
    x = (torch.randn(3, 40, i, dtype=torch.float64) * torch.linspace(0.1, 8, i, dtype=torch.float64)).bfloat16().double()

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate, self.up, self.down = lin[0], lin[1], down

        def forward(self, v):
            return self.down(torch.nn.functional.silu(self.gate(v)) * self.up(v))

    mlp, spec = MLP(), QuantSpec.parse(f"w=int{bits}/per_group:{group}; awq")
    wd = down.weight.detach().numpy()

    def mlp_np(ws, v):
        return (_silu(v @ ws[0].T) * (v @ ws[1].T)) @ wd.T

    with torch.no_grad():
        got = _group_scale(lin, [x], mlp, [((x,), {})], spec).numpy()
    want = _ref_scale([w.weight.detach().numpy() for w in lin], mlp_np, x.numpy(), bits, group)
    np.testing.assert_allclose(got, want, rtol=1e-6)  # the means are float32 sums, as AutoAWQ and GPT-QModel keep them
    assert got.std() > 0.01  # a scale that is not all ones: the search chose a ratio > 0

    from outlierscope.quant.linears.ops import quantize_weight

    h = torch.nn.functional.silu(lin[0](x)) * lin[1](x)  # down's input
    with torch.no_grad():
        got = search_clip(down.weight.detach(), h, lambda v: quantize_weight(v, spec.part("w")), group, rows=40)
    want = _ref_clip(wd, h.detach().numpy(), bits, group)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)
    assert (got.numpy() < np.abs(wd).reshape(i, -1, group).max(-1)).any()  # some bound shrank


def test_weight_mean_and_clip_groups_by_hand():
    w = torch.tensor([[1.0, -2.0, 4.0, 0.0], [3.0, 1.0, -1.0, 2.0]])
    # groups of 2: |w| / group max -> [[.5, 1, 1, 0], [1, 1/3, .5, 1]]; column means
    torch.testing.assert_close(weight_mean([w], 2), torch.tensor([0.75, 2 / 3, 0.75, 0.5]), rtol=1e-5, atol=0)
    got = clip_groups(w, torch.tensor([[1.5, 3.0], [2.0, 0.5]]))
    assert torch.equal(got, torch.tensor([[1.0, -1.5, 3.0, 0.0], [2.0, 1.0, -0.5, 0.5]]))
    # inputs that are zero on the second group: every bound's error there is 0, the first (no shrink) is kept
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(0)) * torch.tensor([1.0, 1.0, 0.0, 0.0])
    bound = search_clip(w, x, lambda v: v.round(), 2)
    assert torch.equal(bound[:, 1], torch.tensor([4.0, 2.0]))


def test_awq_config_text_and_errors():
    assert str(AWQConfig()) == "awq" and str(AWQConfig(grid=10, clip=0)) == "awq:grid=10,clip=0"
    assert AWQConfig.parse("grid=10+clip=0") == AWQConfig(grid=10, clip=0)
    spec = QuantSpec.parse("w=int4/per_group:32; a=int8/per_token; awq:duo=0")
    assert QuantSpec.parse(str(spec)) == spec and spec.awq == AWQConfig(duo=0)
    for text, words in (("w=nvfp4; awq", "w= part of int/fint/zint"), ("w=int4/per_group:32; awq; smooth:0.5", "awq with smooth"),
                        ("w=int4/per_group:32; awq; gptq", "awq with gptq"), ("w=int4/per_group:32; awq:clip=2", "0 or 1"),
                        ("w=int4/per_group:32; awq:shrink=1", "shrink"), ("w=int4/per_group:32; awq:foo=1", "cannot read"),
                        ("w=int4/per_group:32; awq; linears:lm_head", "lm_head"),
                        ("w=int4/per_group:32; awq; calib:a.pt", "act_scales")):
        with pytest.raises(OutlierscopeError, match=words):
            QuantSpec.parse(text)


@pytest.mark.parametrize("n_out, n_in, group, tokens, fmt", [(200, 576, 64, 700, "fint4"), (96, 1536, 64, 1100, "int3"),
                                                             (130, 384, 128, 530, "zint4"), (64, 256, None, 300, "int4")])
def test_clip_search_step_is_speed_only(n_out, n_in, group, tokens, fmt):
    """search_clip's output rows per step (``rows``; default: a product of about CLIP_STEP_ELEMENTS) change its speed,
    never its result: each row's group sums and token means reduce the same elements in the same order, so steps of
    1, 3, 7, 64 rows, the default and all rows at once give the same bytes of every error compared (clip_errors) and
    of the bounds (bfloat16-valued weights, several groups, steps that leave a remainder; under the suite's thread
    count, where a reduction may split across threads)."""
    from outlierscope.quant.linears.ops import quantize_weight
    from outlierscope.quant.weights.awq import clip_errors

    gen = torch.Generator().manual_seed(n_out)
    w = (torch.randn(n_out, n_in, generator=gen) * 0.05).bfloat16().float()
    x = (torch.randn(tokens, n_in, generator=gen) * torch.linspace(0.1, 8, n_in)).bfloat16().float()
    part = QuantSpec.parse(f"w={fmt}/" + (f"per_group:{group}" if group else "per_channel")).part("w")
    top, errs = clip_errors(w, x, lambda v: quantize_weight(v, part), group, rows=64)
    want = search_clip(w, x, lambda v: quantize_weight(v, part), group, rows=64)
    assert errs.shape == (10, n_out, n_in // (group or n_in)) and torch.equal(top, want.max(top))  # never above top
    for rows in (None, 1, 3, 7, n_out):
        got_top, got_errs = clip_errors(w, x, lambda v: quantize_weight(v, part), group, rows=rows)
        assert torch.equal(got_top, top) and torch.equal(got_errs, errs), (rows, int((got_errs != errs).sum()))
        got = search_clip(w, x, lambda v: quantize_weight(v, part), group, rows=rows)
        assert torch.equal(got, want), (rows, int((got != want).sum()))


def test_awq_weight_statistic_is_float64_in_a_float64_model():
    """AutoAWQ takes the statistic in the weights' dtype: float64 weights give float64 values equal to a float64
    computation written here (float32 rounding was 1e-7 off, enough to flip a tie on a full-range grid)."""
    import torch

    from outlierscope.quant.weights.awq import weight_mean

    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(48, 64, generator=g, dtype=torch.float64), torch.randn(16, 64, generator=g, dtype=torch.float64)]
    got = weight_mean(ws, 16)
    w = torch.cat(ws).abs().reshape(64, 4, 16)  # (O, I/G, G)
    want = (w / (w.amax(-1, keepdim=True) + 1e-6)).reshape(64, 64).mean(0)  # (I,)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
