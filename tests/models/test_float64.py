"""A float64 model is float64 in every operation (issue #63): no operation of a forward, through transformers'
eager attention or outlierscope's attention function, makes a float32 (or narrower) tensor, on every architecture the
toolkit is tested on; and SmolLM2's per-token NLL in float64 equals a forward written from scratch here in float64
(norms, rotary angles, softmax) to 1e-9 nats."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from outlierscope.models.fetch import is_fetched
from outlierscope.models.float64 import build_options, float64_build, float64_model
from tests.hooks.test_capture import make

NARROW = (torch.float32, torch.float16, torch.bfloat16)


class NarrowOps(TorchDispatchMode):
    """Records every aten operation whose output is a float32/16/bf16 tensor."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype in NARROW:
                self.found.append(f"{func}->{t.dtype}")
        return out


HYBRID = {
    "jamba": lambda tf: tf.JambaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                                       attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                       num_experts=2, mamba_d_state=4, mamba_expand=2, use_mamba_kernels=False,
                                       max_position_embeddings=64),
    "lfm2": lambda tf: tf.Lfm2Config(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     layer_types=["conv", "full_attention"]),
}
ARCHS = ["llama", "diffllama", "qwen2", "mistral", "gemma2", "olmo2", "gpt_neox", "phi3", "gpt2", "gptj", "stablelm",
         "qwen3", "gemma3_text", "opt", "starcoder2", "mixtral", *HYBRID]


def _float64(arch: str):
    """The architecture's tiny model built in float64 as load_model builds one (inside float64_build)."""
    import transformers as tf

    torch.manual_seed(0)
    with float64_build("float64"):
        if arch in HYBRID:
            cfg = HYBRID[arch](tf)
        else:
            cfg = make(arch).config
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float64,
                                                 **build_options("float64"))
    return model.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_no_narrow_operation_in_a_float64_forward(arch):
    from outlierscope.hooks.capture import capture

    model = _float64(arch)
    narrow_state = [n for n, t in model.state_dict().items() if t.dtype in NARROW]
    assert not narrow_state, f"{arch}: float32 buffers or weights {narrow_state[:3]}"
    ids = torch.randint(1, 100, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    for observed in (False, True):  # transformers' eager attention, then outlierscope's attention function
        spy = NarrowOps()
        with torch.no_grad(), (capture(model, ["layers.*.attn.logits"]) if observed else float64_model(model)), spy:
            model(input_ids=ids, attention_mask=mask)
        assert not spy.found, f"{arch} ({'captured' if observed else 'eager'}): {sorted(set(spy.found))[:5]}"


def test_the_mode_is_needed():
    """Without the mode the same forward makes float32 tensors (the test above can fail)."""
    model = _float64("llama")
    spy = NarrowOps()
    with torch.no_grad(), spy:
        model(input_ids=torch.randint(1, 100, (1, 8)))
    assert spy.found


def test_other_dtypes_are_left_alone():
    """A float32 model's forward is the same bytes inside float64_model (nothing is entered)."""
    model = make("llama").float()
    ids = torch.randint(1, 100, (2, 9))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with float64_model(model):
            got = model(input_ids=ids).logits
    assert torch.equal(want, got) and got.dtype == torch.float32


def _scratch_nll(sd: dict, cfg, ids: list[int]) -> torch.Tensor:
    """-log p(ids[t+1] | ids[:t+1]) of a Llama model from its state dict, every operation float64 (T-1,)."""
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    d, eps, T = cfg.hidden_size // H, cfg.rms_norm_eps, len(ids)
    w = {k: v.double() for k, v in sd.items()}

    def rms(x, g):
        return g * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    inv = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # (d/2,)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]  # (T, d/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # (T, d)

    def rope(x):  # (h, T, d)
        return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin

    causal = torch.full((T, T), -math.inf, dtype=torch.float64).triu(1)  # (T, T)
    h = w["model.embed_tokens.weight"][torch.tensor(ids)]  # (T, D)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(T, H, d).transpose(0, 1)  # (H, T, d)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(T, KV, d).transpose(0, 1)  # (KV, T, d)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(T, KV, d).transpose(0, 1)  # (KV, T, d)
        k, v = rope(k).repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)  # (H, T, d)
        a = torch.softmax(rope(q) @ k.transpose(1, 2) / math.sqrt(d) + causal, -1) @ v  # (H, T, d)
        h = h + a.transpose(0, 1).reshape(T, H * d) @ w[p + "self_attn.o_proj.weight"].T  # (T, D)
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + torch.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    logits = rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T  # (T, V)
    return -torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # (T-1,)


@pytest.mark.skipif(not is_fetched("smollm2-135m"), reason="SmolLM2-135M is not fetched (make test fetches it)")
def test_smollm2_float64_nll_equals_a_forward_from_scratch():
    """Per-token NLL of ``score_windows`` on SmolLM2 loaded in float64, three windows of two lengths in batches of
    two (one padded), against :func:`_scratch_nll` of each window alone: within 1e-9 nats (float32 norms and rotary
    angles were 1e-6 off)."""
    from outlierscope.eval.perplexity import score_windows
    from outlierscope.eval.windows import Window
    from outlierscope.models.loading import load_model
    from outlierscope.quant.specs.spec import QuantSpec

    lm = load_model("smollm2-135m", dtype="float64", device="cpu")
    text = ("The river that runs through the old city was once the border between two kingdoms, and the bridges "
            "that cross it still carry the names of the kings who built them. ") * 3
    ids = lm.tokenizer(text).input_ids
    windows = [Window(tuple(ids[:40]), tuple(ids[1:40]), 0), Window(tuple(ids[40:63]), tuple(ids[41:63]), 0),
               Window(tuple(ids[63:103]), tuple(ids[64:103]), 0)]
    got = score_windows(lm.model, windows, [QuantSpec()], batch_size=2)[0].nll
    sd = lm.model.state_dict()
    want = torch.cat([_scratch_nll(sd, lm.model.config, list(w.input_ids)) for w in windows]).numpy()
    assert got.shape == want.shape
    assert abs(got - want).max() < 1e-9, abs(got - want).max()
