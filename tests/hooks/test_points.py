"""Every observation point beyond Table 5's two, against independent references: q/k/v from a float64 recomputation
from the layer's own weights (RoPE, QK-norm) and from what transformers' eager attention receives, probabilities
against eager's ``output_attentions``, module inputs/outputs and ``attn.out`` against plain forward hooks."""

import math
import sys

import pytest
import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.capture import capture
from outlierscope.hooks.points import PRESETS, all_points, resolve_points
from outlierscope.models.float64 import float64_model
from tests.hooks.test_capture import attention_module, make, projections, rope64

ARCHS = ["llama", "qwen2", "gemma2", "gemma3_text", "gpt2", "olmo2", "diffllama"]
FROM_WEIGHTS = {"llama", "qwen2", "gemma2", "gpt2", "olmo2", "diffllama"}  # what tests.hooks.test_capture.projections covers


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(1, 101, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, -3:] = 0  # right padding (left padding gives fully masked rows, NaN in eager float64: it adds finfo.min)
    return ids, mask


def _eager_record(model, ids, mask):
    """Run the model through a recording attention function registered here (query, key, value as eager attention
    gets them, then transformers' own eager attention); returns the records and eager's outputs."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    rec = []

    def fn(module, query, key, value, attention_mask, **kw):
        rec.append((module, query, key, value))
        return sys.modules[type(module).__module__].eager_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("test-record", fn)
    AttentionMaskInterface.register("test-record", eager_mask)  # eager attention adds a float mask
    prev = model.config._attn_implementation
    model.set_attn_implementation("test-record")
    try:
        with torch.no_grad(), float64_model(model):  # as capture runs a float64 model: float64 in every operation
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    finally:
        model.set_attn_implementation(prev)
        AttentionInterface._global_mapping.pop("test-record", None)
        AttentionMaskInterface._global_mapping.pop("test-record", None)
    return rec, out


def _observe(model, points, ids, mask, block_rows=None):
    seen = {}

    def red(o):
        seen.setdefault(o.point.name, []).append((o.x.clone(), o.valid.clone(), o.query_offset))

    with torch.no_grad(), capture(model, points, reducers=red, block_rows=block_rows):
        model(input_ids=ids, attention_mask=mask)
    return seen


def _map(obs):
    """Blocks of a map (B, H, t, S) put back in query order."""
    obs = sorted(obs, key=lambda o: o[2])
    return torch.cat([o[0] for o in obs], 2), torch.cat([o[1].expand_as(o[0]) for o in obs], 2)


def _tokens(x):  # (B, H, T, d) -> (B, T, H*d)
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)


@pytest.mark.parametrize("block_rows", [None, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_attention_points(arch, block_rows):
    model = make(arch).double()
    ids, mask = _batch()
    rec, ref = _eager_record(model, ids, mask)
    diff = arch == "diffllama"
    kinds = ["attn.q", "attn.k", "attn.v", "attn.probs", "attn.out"] + (["attn.probs_diff"] if diff else [])
    real = mask.bool()  # (B, T)
    attn_in = {}  # the attention module's input (after the layer's input norm, if any)
    hooks = [attention_module(model, i).register_forward_pre_hook(
        lambda m, a, kw, i=i: attn_in.__setitem__(i, (a[0] if a else kw["hidden_states"]).clone()), with_kwargs=True)
        for i in range(2)]
    o_in = {}  # the output projection's input, by a plain hook, in the same forward as the capture
    hooks += [attention_module(model, i).get_submodule("c_proj" if arch == "gpt2" else "o_proj").register_forward_pre_hook(
        lambda m, a, i=i: o_in.__setitem__(i, a[0].clone())) for i in range(2)]
    seen = _observe(model, [f"layers.*.{k}" for k in kinds], ids, mask, block_rows)
    for h in hooks:
        h.remove()
    calls = rec[::2] if diff else rec  # DiffLlama calls attention twice per layer (one half of the values each)
    for layer in range(2):
        module, q, k, v = calls[layer]
        if diff:  # the values a KV cache holds: v_proj's output, unsplit
            v = module.v_proj(attn_in[layer])
            v = v.view(2, 7, -1, q.shape[-1]).transpose(1, 2)
        for kind, want, valid in (("attn.q", q, real), ("attn.k", k, real), ("attn.v", v, real)):
            ((x, vmask, _),) = seen[f"layers.{layer}.{kind}"]
            assert torch.equal(vmask, valid)
            # layer 0: the same tensors; later layers: the earlier layers' attention summed in another order
            tol = 0 if layer == 0 else 1e-12
            torch.testing.assert_close(x[valid], _tokens(want)[valid], rtol=tol, atol=tol)
        if arch in FROM_WEIGHTS:  # q and k against the layer's own weights, float64, RoPE written in the test
            _check_from_weights(model, layer, attn_in[layer], seen, real)
        x, valid = _map(seen[f"layers.{layer}.attn.probs"])
        eager = ref.attentions[layer]
        # float32 softmax as Llama's eager attention (GPT-2's softmaxes in the model's dtype): ~1e-7
        torch.testing.assert_close(x[valid], eager.expand_as(x)[valid], rtol=1e-6, atol=1e-7)
        assert valid.sum() == _valid_entries(model, layer, mask) * x.shape[1]
        ((x, _, _),) = seen[f"layers.{layer}.attn.out"]
        torch.testing.assert_close(x[real], o_in[layer][real], rtol=0, atol=0)
        if diff:
            _check_diff(module, seen[f"layers.{layer}.attn.probs_diff"], eager)


def _check_from_weights(model, layer, x, seen, real):
    cfg = model.config
    q, k = projections(attention_module(model, layer), x.double(), cfg)  # (B, H, T, d), pre-RoPE
    if cfg.model_type != "gpt2":
        d = q.shape[-1]
        pos = torch.arange(7)[None].expand(2, 7) - (~real).sum(1, keepdim=True) * 0  # positions as the model counts them
        theta = cfg.rope_parameters["rope_theta"]
        q = torch.stack([rope64(q[b : b + 1], d, theta, pos[b])[0] for b in range(2)])
        k = torch.stack([rope64(k[b : b + 1], d, theta, pos[b])[0] for b in range(2)])
    for kind, want in (("attn.q", q), ("attn.k", k)):
        ((got, _, _),) = seen[f"layers.{layer}.{kind}"]
        # the model's RoPE tables are float32 (inv_freq): about 1e-7 relative
        torch.testing.assert_close(got[real], _tokens(want)[real], rtol=1e-6, atol=1e-6)


def _valid_entries(model, layer, mask):
    """Causal, non-padding entries of real query rows, inside a sliding window: counted by hand."""
    from tests.hooks.test_capture import _window

    w = _window(model, layer)
    n = 0
    for b in range(mask.shape[0]):
        real = mask[b].bool().tolist()
        for t in range(len(real)):
            for s in range(t + 1):
                n += real[t] and real[s] and (w is None or t - s < w)
    return n


def _check_diff(module, obs, eager):
    """The differential map p1 - lambda p2 with lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init (the paper's
    re-parameterisation), and each row's sum: 1 - lambda."""
    x, valid = _map(obs)
    lam = (math.exp(float(module.lambda_q1.detach() @ module.lambda_k1.detach())) - math.exp(float(module.lambda_q2.detach() @ module.lambda_k2.detach()))
           + module.lambda_init)
    H = eager.shape[1]
    want = eager[:, : H // 2] - lam * eager[:, H // 2 :]
    torch.testing.assert_close(x[valid], want.expand_as(x)[valid], rtol=1e-6, atol=1e-6)
    rows = x.masked_fill(~valid, 0).sum(-1)[valid.any(-1)]
    torch.testing.assert_close(rows, torch.full_like(rows, 1 - lam), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3_text"])
def test_module_points_equal_plain_hooks(arch):
    """Every module input and output (and lm_head.input) against plain forward hooks written here; padding is
    never observed."""
    model = make(arch)
    ids, mask = _batch()
    seen = _observe(model, ["layers.*.*.input", "layers.*.*.output", "lm_head.input"], ids, mask)
    modules = dict(model.named_modules())
    want, hooks = {}, []
    for p in all_points(model):
        if p.module is None:
            continue
        side = p.kind.rsplit(".", 1)[1]
        m = modules[p.module]
        if side == "input":
            hooks.append(m.register_forward_pre_hook(
                lambda mod, a, kw, n=p.name: want.__setitem__(n, (a[0] if a else kw["hidden_states"]).clone()), with_kwargs=True))
        else:
            hooks.append(m.register_forward_hook(
                lambda mod, a, out, n=p.name: want.__setitem__(n, (out[0] if isinstance(out, tuple) else out).clone())))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    real = mask.bool()
    assert set(seen) == set(want)
    for name, ref in want.items():
        ((x, valid, _),) = seen[name]
        assert torch.equal(valid, real), name
        if ref.dim() == 4 and ref.shape[2] == 7:  # per-head (B, H, T, d) (Gemma3's q_norm): tokens second
            ref = ref.transpose(1, 2)
        torch.testing.assert_close(x[real], ref.reshape(*ref.shape[:2], -1)[real], rtol=0, atol=0)


def test_patterns_presets_and_typos():
    model = make("llama")
    names = [p.name for p in resolve_points(model, ["layers.*.self_attn.*_proj.input"])]
    assert names == [f"layers.{i}.self_attn.{x}_proj.input" for i in range(2) for x in "qkvo"]
    sq = resolve_points(model, preset="smoothquant")
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(p.module for p in sq) == sorted(linear)  # every nn.Linear, the LM head included
    assert {p.kind for p in resolve_points(model, preset="kv")} == {"attn.q", "attn.k", "attn.v"}
    assert set(PRESETS) >= {"kv", "sinks", "smoothquant"}
    with pytest.raises(OutlierscopeError, match=r"did you mean layers\.\*\.mlp\.down_proj\.input"):
        resolve_points(model, ["layers.*.mlp.down_prj.input"])
    with pytest.raises(OutlierscopeError, match=r"did you mean layers\.\*\.attn\.k"):
        resolve_points(model, ["layers.*.attn.kk"])
    with pytest.raises(OutlierscopeError, match="unknown point preset 'kvv'"):
        resolve_points(model, preset="kvv")
    with pytest.raises(OutlierscopeError, match="unknown observation point"):
        resolve_points(model, ["layers.*.attn.probs_diff"])  # Diff models only


def test_a_point_kind_is_one_entry_of_the_table():
    """A new kind defined here (the MLP's output) is one entry: it resolves by name and pattern on every layer and
    capture observes exactly what the module returns (read by a hook of the test's own)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from outlierscope.hooks.capture import capture
    from outlierscope.hooks.points import PointKind, register_point_kind, resolve_points, unregister_point_kind

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=32)).eval()
    register_point_kind(PointKind("mlp.out", "the MLP's output", tap="module", attention=False,
                                  hook=lambda block: (block.mlp, "output")))
    try:
        assert [p.name for p in resolve_points(model, "layers.*.mlp.out")] == ["layers.0.mlp.out", "layers.1.mlp.out"]
        seen, want = [], []
        h = model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: want.append(out.detach().clone()))
        try:
            with capture(model, ["layers.1.mlp.out"], reducers=lambda obs: seen.append(obs.x.clone())):
                model(torch.tensor([[1, 2, 3, 4, 5]]))
        finally:
            h.remove()
        assert len(seen) == 1 and torch.equal(seen[0], want[0])
    finally:
        unregister_point_kind("mlp.out")
    with pytest.raises(OutlierscopeError, match="unknown observation point 'layers.0.mlp.out'"):
        resolve_points(model, "layers.0.mlp.out")
