"""Captured logits against a brute-force float64 recomputation from each layer's own q/k projections."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.capture import capture
from outlierscope.hooks.points import decoder_layers, resolve_points

SMALL = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)


def make(model_type: str):
    import transformers as tf
    from transformers import (
        DiffLlamaConfig,
        Gemma2Config,
        GPTNeoXConfig,
        LlamaConfig,
        MistralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
    )

    tiny = dict(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)

    cfgs = {
        "llama": lambda: LlamaConfig(**SMALL, num_key_value_heads=2),
        "diffllama": lambda: DiffLlamaConfig(**SMALL, num_key_value_heads=4),
        "qwen2": lambda: Qwen2Config(**SMALL, num_key_value_heads=2),
        "mistral": lambda: MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=5),
        "gemma2": lambda: Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                       attn_logit_softcapping=2.0, final_logit_softcapping=None, query_pre_attn_scalar=12),
        "olmo2": lambda: Olmo2Config(**SMALL, num_key_value_heads=4),
        "gpt_neox": lambda: GPTNeoXConfig(**SMALL, rotary_pct=0.5),
        "phi3": lambda: Phi3Config(**SMALL, num_key_value_heads=2, pad_token_id=0),
        "gpt2": lambda: tf.GPT2Config(**tiny),
        "gptj": lambda: tf.GPTJConfig(**tiny, rotary_dim=4),
        "stablelm": lambda: tf.StableLmConfig(**SMALL, num_key_value_heads=2),
        "qwen3": lambda: tf.Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=8),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**SMALL, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                                   layer_types=["sliding_attention", "full_attention"]),
        "opt": lambda: tf.OPTConfig(vocab_size=101, hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
                                    max_position_embeddings=64, word_embed_proj_dim=32),
        "starcoder2": lambda: tf.Starcoder2Config(**SMALL, num_key_value_heads=2, sliding_window=5),
        "mixtral": lambda: tf.MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfgs[model_type](), attn_implementation="eager").eval()
    with torch.no_grad():  # larger weights so that logits are not all tiny
        for n, p in model.named_parameters():
            if "norm" not in n and "layernorm" not in n and p.ndim == 2:
                p.mul_(3.0)
            if "lambda" in n:
                p.normal_(0, 0.3)
    return model


def rope64(x, rot_dim, theta, pos):
    """Rotate-half RoPE on the first ``rot_dim`` channels, float64. x: (B, H, T, d)."""
    inv = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    ang = pos[:, None].double() * inv[None]  # (T, rot/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    xr, xp = x[..., :rot_dim], x[..., rot_dim:]
    rot = torch.cat([-xr[..., rot_dim // 2 :], xr[..., : rot_dim // 2]], -1)
    return torch.cat([xr * cos + rot * sin, xp], -1)


def projections(attn, x, cfg):
    """Pre-RoPE q (B, H, T, d) and k (B, Hkv, T, d) from the attention module's own weights, float64."""
    B, T, _ = x.shape
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    lin = lambda m, v: v @ m.weight.double().T + (m.bias.double() if m.bias is not None else 0)  # noqa: E731
    if cfg.model_type == "gpt_neox":
        qkv = lin(attn.query_key_value, x).view(B, T, H, 3 * d)  # (B, T, H, 3d)
        q, k = qkv[..., :d], qkv[..., d : 2 * d]
        return q.transpose(1, 2), k.transpose(1, 2)
    if cfg.model_type == "gpt2":  # Conv1D: x @ W + b, W of shape (in, 3 * hidden)
        qkv = x @ attn.c_attn.weight.double() + attn.c_attn.bias.double()
        q, k = qkv[..., : H * d], qkv[..., H * d : 2 * H * d]
    elif cfg.model_type == "phi3":
        qkv = lin(attn.qkv_proj, x)
        q, k = qkv[..., : H * d], qkv[..., H * d : (H + Hkv) * d]
    else:
        q, k = lin(attn.q_proj, x), lin(attn.k_proj, x)
    if cfg.model_type == "olmo2":
        q, k = attn.q_norm.double()(q), attn.k_norm.double()(k)
    return q.view(B, T, H, d).transpose(1, 2), k.view(B, T, Hkv, d).transpose(1, 2)


def attention_module(model, layer):
    return [m for m in decoder_layers(model)[layer].modules() if hasattr(m, "scaling")][0]


def rope64_interleaved(x, rot_dim, theta, pos):
    """GPT-J's rotary (rotate every two channels) on the first ``rot_dim`` channels, float64. x: (B, H, T, d)."""
    inv = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    ang = pos[:, None].double() * inv[None]  # (T, rot/2)
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)  # (T, rot)
    xr, xp = x[..., :rot_dim], x[..., rot_dim:]
    rot = torch.stack([-xr[..., 1::2], xr[..., ::2]], -1).flatten(-2)
    return torch.cat([xr * cos + rot * sin, xp], -1)


def reference_logits(model, layer, x):
    """x: the attention module's input (after the layer's input norm)."""
    cfg = model.config
    attn = attention_module(model, layer)
    q, k = projections(attn, x.double(), cfg)
    d = q.shape[-1]
    pos = torch.arange(x.shape[1])
    if cfg.model_type == "gptj":
        q, k = rope64_interleaved(q, cfg.rotary_dim, 10000.0, pos), rope64_interleaved(k, cfg.rotary_dim, 10000.0, pos)
    elif cfg.model_type != "gpt2":  # GPT-2: learned absolute positions, nothing rotates
        rot = int(d * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
        q, k = rope64(q, rot, cfg.rope_parameters["rope_theta"], pos), rope64(k, rot, cfg.rope_parameters["rope_theta"], pos)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # GQA: (B, H, T, d)
    return (q @ k.transpose(-1, -2)) * attn.scaling  # (B, H, T, T)


ARCHS = ["llama", "diffllama", "qwen2", "mistral", "gemma2", "olmo2", "gpt_neox", "phi3", "gpt2", "gptj", "stablelm"]
MATRIX = [*ARCHS, "qwen3", "gemma3_text", "opt", "starcoder2", "mixtral"]


def _window(model, layer):
    cfg = model.config
    types = getattr(cfg, "layer_types", None)
    if types is not None and types[layer] != "sliding_attention":
        return None
    return getattr(cfg, "sliding_window", None)


@pytest.mark.parametrize("arch", MATRIX)
def test_matrix_probabilities_equal_eager(arch):
    """Every architecture: our outputs equal eager's at every position (right padding included), and the
    softmax of the captured logits (soft-capped where the model caps) equals eager's attention
    probabilities on the valid rows; the valid mask is causal, windowed, without padding."""
    model = make(arch)
    ids = torch.randint(0, 101, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_attentions=True)
    seen = []
    keep = lambda o: seen.append((o.point.layer, o.x.clone(), o.valid.clone()))  # noqa: E731
    with torch.no_grad(), capture(model, ["layers.*.attn.logits"], reducers=keep):
        out = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out, ref.logits, atol=1e-5, rtol=1e-5)  # padding positions too
    assert [layer for layer, _, _ in seen] == list(range(model.config.num_hidden_layers))
    cap = getattr(model.config, "attn_logit_softcapping", None)
    T = ids.shape[1]
    t, s_ = torch.arange(T)[:, None], torch.arange(T)[None]
    for layer, x, valid in seen:
        expect = (s_ <= t).expand(2, T, T).clone()
        expect[1, :, -3:] = False
        expect[1, -3:, :] = False
        w = _window(model, layer)
        if w:
            expect &= t - s_ < w
        assert torch.equal(valid.expand(2, -1, T, T)[:, 0], expect), layer
        z = torch.tanh(x / cap) * cap if cap else x
        probs = torch.softmax(z.masked_fill(~valid, -math.inf).double(), -1)
        rows = valid.any(-1, keepdim=True).expand_as(probs)
        eager = ref.attentions[layer].double()
        torch.testing.assert_close(probs[rows], eager[rows], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_equal_bruteforce_and_outputs_unchanged(arch):
    model = make(arch)
    ids = torch.randint(0, 101, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding on the second sequence
    with torch.no_grad():
        ref_out = model(input_ids=ids, attention_mask=mask).logits
    inputs, seen = {}, []
    hooks = [attention_module(model, i).register_forward_pre_hook(
        lambda m, a, kw, i=i: inputs.__setitem__(i, a[0] if a else kw["hidden_states"]), with_kwargs=True)
        for i in range(model.config.num_hidden_layers)]
    try:
        with torch.no_grad(), capture(model, ["layers.*.attn.logits"], reducers=seen.append):
            out = model(input_ids=ids, attention_mask=mask).logits
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert [o.point.name for o in seen] == ["layers.0.attn.logits", "layers.1.attn.logits"]  # once per layer (Diff too)
    for obs in seen:
        ref = reference_logits(model, obs.point.layer, inputs[obs.point.layer])
        assert obs.x.shape == ref.shape
        torch.testing.assert_close(obs.x.double(), ref, atol=1e-4, rtol=1e-4)
        # the valid mask: causal, not padding, inside the sliding window where the layer has one
        T = ids.shape[1]
        t, s = torch.arange(T)[:, None], torch.arange(T)[None]
        expect = (s <= t).expand(2, T, T).clone()
        expect[1, :, :2] = False  # padding keys
        expect[1, :2, :] = False  # padding queries
        window = None
        if arch == "mistral":
            window = 5
        if arch == "gemma2" and model.config.layer_types[obs.point.layer] == "sliding_attention":
            window = 4
        if window:
            expect &= (t - s < window)
        got = obs.valid.expand(2, -1, T, T)[:, 0]
        assert torch.equal(got, expect)
    assert model.config._attn_implementation == "eager"


def test_diff_maps_labelled():
    model = make("diffllama")
    seen = []
    with torch.no_grad(), capture(model, "layers.0.attn.logits", reducers=seen.append):
        model(input_ids=torch.randint(0, 101, (1, 5)))
    assert seen[0].is_diff and seen[0].n_heads == 4


@pytest.mark.parametrize("arch", ["llama", "diffllama"])
def test_reducers_that_let_go_spare_the_copy_of_each_map(arch):
    """A reducer declaring ``keeps_observations = False`` gets the logits in the memory the softmax then masks in
    place (what it wrongly kept shows float32's min at the masked entries: no copy was made); any other reducer gets a
    map of its own, never masked (the raw logits there). The model's output is the same either way, and equal to
    eager attention's; the observed values before masking equal the kept copy's."""
    model = make(arch)
    ids = torch.randint(0, 101, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # left padding: masked entries in padded rows and columns besides the causal ones
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits

    class LetsGo:
        keeps_observations = False

        def __init__(self):
            self.kept, self.copies = [], []

        def __call__(self, obs):
            self.kept.append(obs.x)  # breaks its own declaration, to show which memory it was given
            self.copies.append(obs.x.clone())

    lets_go, kept = LetsGo(), []
    for reducer in (lets_go, lambda o: kept.append((o.x, o.x.clone()))):
        with torch.no_grad(), capture(model, "layers.*.attn.logits", reducers=reducer):
            out = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    fill = torch.finfo(torch.float32).min
    masked = ~(torch.tril(torch.ones(7, 7, dtype=torch.bool)) & mask.bool()[:, None, None, :])  # (B, 1, T, S)
    assert len(lets_go.kept) == len(kept) == 2  # once per layer (DiffLlama too)
    for x_in_place, copy, (x_own, own_copy) in zip(lets_go.kept, lets_go.copies, kept):
        torch.testing.assert_close(copy, own_copy, rtol=0, atol=0)  # the same logits observed either way
        assert (x_in_place.expand_as(x_own)[masked.expand_as(x_own)] == fill).all()  # masked in place
        assert torch.equal(x_own, own_copy)  # its own map: untouched after the call
        assert (x_own[masked.expand_as(x_own)] != fill).all()


def test_hidden_states_are_layer_outputs():
    model = make("llama")
    ids = torch.randint(0, 101, (2, 7))
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True).hidden_states
    seen = []
    with torch.no_grad(), capture(model, "layers.*.hidden", reducers=seen.append):
        model(input_ids=ids)
    assert len(seen) == 2
    torch.testing.assert_close(seen[0].x, ref[1])  # output of layer 0 = input of layer 1
    assert seen[0].valid.shape == (2, 7) and seen[0].valid.all()


def test_cleanup_after_exception():
    model = make("llama")
    before = {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    from transformers import AttentionInterface

    n_registered = len(AttentionInterface._global_mapping)

    def boom(obs):
        raise RuntimeError("reducer failed")

    with pytest.raises(RuntimeError, match="reducer failed"):
        with capture(model, reducers=boom):
            model(input_ids=torch.randint(0, 101, (1, 4)))
    after = {n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()}
    assert before == after
    assert model.config._attn_implementation == "eager"
    assert len(AttentionInterface._global_mapping) == n_registered


@pytest.mark.parametrize("bad,hint", [("layers.9.hidden", "expected layers.{0..1}"), ("layers.*.attn.logit", "did you mean layers.*.attn.logits"),
                                      ("layer.0.hidden", "did you mean layers.0.hidden")])
def test_unknown_points(bad, hint):
    model = make("llama")
    with pytest.raises(OutlierscopeError, match=re_escape(hint)):
        resolve_points(model, [bad])


def re_escape(s):
    import re

    return re.escape(s)


def test_unsupported_kwarg_is_an_error():
    from outlierscope.hooks.attention import _AttentionFunction

    model = make("llama")
    fn = _AttentionFunction(model, ())
    attn = decoder_layers(model)[0].self_attn
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(OutlierscopeError, match=r"LlamaForCausalLM.*s_aux"):
        fn(attn, q, q[:, :2], q[:, :2], None, scaling=1.0, s_aux=torch.zeros(4))


def test_model_without_interface():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.Linear(2, 2)

    class Plain(torch.nn.Module):  # decoder layers, but no set_attn_implementation
        config = type("C", (), {"num_hidden_layers": 1})()

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block()])

    with pytest.raises(OutlierscopeError, match=r"Plain: its attention \(Linear\) does not go through transformers' AttentionInterface"):
        with capture(Plain(), ["layers.0.attn.logits"]):
            pass
    with pytest.raises(OutlierscopeError, match="Sequential: cannot find its decoder layers"):
        with capture(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["layers.0.hidden"]):
            pass


def test_nan_is_reported():
    from outlierscope.analysis.outliers import OutlierStats

    model = make("llama")
    stats = OutlierStats.for_model(model, seq_len=8)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = math.nan
    with pytest.raises(OutlierscopeError, match="non-finite"):
        with torch.no_grad(), capture(model, "layers.0.hidden", reducers=stats):
            model(input_ids=torch.randint(0, 101, (1, 5)))


HYBRID = {  # layer types: "a" attention, "o" other (state-space, short convolution, gated delta net)
    "jamba": (lambda tf: tf.JambaConfig(**SMALL, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                                         expert_layer_period=2, expert_layer_offset=1, num_experts=2, num_experts_per_tok=1,
                                         mamba_d_state=4, mamba_d_conv=4, mamba_expand=2), "oa"),
    "lfm2": (lambda tf: tf.Lfm2Config(**SMALL, num_key_value_heads=2, layer_types=["conv", "full_attention"]), "oa"),
    "qwen3_next": (lambda tf: tf.Qwen3NextConfig(**SMALL, num_key_value_heads=2, head_dim=8,
                                                  layer_types=["full_attention", "linear_attention"],
                                                  linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                                                  linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1,
                                                  moe_intermediate_size=16, shared_expert_intermediate_size=16), "ao"),
}


@pytest.mark.parametrize("arch", HYBRID)
def test_hybrid_models(arch):
    """Hybrid models: attention layers observed (model's own indices) and quantized, the other layers pass through;
    outputs equal eager's; the captured logits' softmax equals eager's attention probabilities; quantizing a layer
    without attention is a one-line error; every layer still has its hidden state."""
    import transformers as tf

    from outlierscope.hooks.points import attention_layers
    from outlierscope.quant.apply import quantize_model
    from outlierscope.quant.specs.spec import QuantSpec

    make_cfg, kinds = HYBRID[arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_cfg(tf), attn_implementation="eager").eval()
    attn = [i for i, k in enumerate(kinds) if k == "a"]
    assert attention_layers(model) == attn
    names = {p.name for p in resolve_points(model, ["layers.*.attn.logits", "layers.*.hidden"])}
    assert names == {f"layers.{i}.attn.logits" for i in attn} | {f"layers.{i}.hidden" for i in range(len(kinds))}
    ids = torch.randint(0, 101, (2, 7))
    with torch.no_grad():
        ref = model(input_ids=ids, output_attentions=True)
    seen = []
    with torch.no_grad(), capture(model, ["layers.*.attn.logits"], reducers=lambda o: seen.append((o.point.layer, o.x, o.valid))):
        out = model(input_ids=ids).logits
    torch.testing.assert_close(out, ref.logits, atol=1e-5, rtol=1e-5)
    assert [layer for layer, _, _ in seen] == attn
    eager = [a for a in ref.attentions if a is not None]
    assert len(eager) == len(attn)  # eager returns the attention layers' maps only
    for (_, x, valid), e in zip(seen, eager):
        probs = torch.softmax(x.masked_fill(~valid, -math.inf).double(), -1)
        torch.testing.assert_close(probs, e.double(), atol=1e-5, rtol=1e-4)
    with torch.no_grad(), quantize_model(model, QuantSpec.logits(bits=2, layers=tuple(attn))):
        q = model(input_ids=ids).logits
    assert (q - ref.logits).abs().max() > 1e-3  # the attention layers were quantized
    other = next(i for i, k in enumerate(kinds) if k == "o")
    with pytest.raises(OutlierscopeError, match=rf"layers \[{other}\] hold no attention .*attention layers are {attn[0]}"):
        with quantize_model(model, QuantSpec.logits(bits=4, layers=(other,))):
            pass


# Bloom and MPT: attention written inline in transformers 5.24 and 5.25 (Falcon moved to the interface in 5.25,
# which is why it is no longer one of them; constraints.txt pins the version a clean clone tests)
@pytest.mark.parametrize("arch", ["bloom", "mpt"])
def test_models_outside_the_interface_say_why(arch):
    import transformers as tf

    cfg = {"bloom": lambda: tf.BloomConfig(vocab_size=101, hidden_size=32, n_layer=2, n_head=4),
           "mpt": lambda: tf.MptConfig(vocab_size=101, d_model=32, n_layers=2, n_heads=4)}[arch]()
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(OutlierscopeError, match=r"its attention \(\w+Attention\) does not go through transformers' "
                                                r"AttentionInterface"):
        with capture(model, ["layers.*.attn.logits"]):
            pass
