"""Every named recipe against a naive float64 attention written here from the recipe's description (quantize the
tensors as described, granule by granule, then plain softmax attention), registered as the model's attention
function: the whole model's outputs must agree, on Llama, Gemma3 (sliding window, QK-norm), GPT-2 and DiffLlama with
padding. Element formats come from independent references: torch's float8 casts, torchao's MX, compressed-tensors' NVFP4."""

import math

import pytest
import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.apply import quantize_model
from outlierscope.quant.specs.recipes import RECIPES
from outlierscope.quant.specs.spec import LINEAR_RECIPES, QuantSpec
from tests.quant.test_formats import compressed_tensors_mx, compressed_tensors_nvfp4

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")

MX_ELEM = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8_e4m3": torch.float8_e4m3fn}
# the recipes as their papers describe them: (format, bits or None, granule, size) per tensor, plus transforms
DESCRIBED = {
    "sage1": {"q": ("int", 8, "block", 128), "k": ("int", 8, "block", 64), "smooth_k": True},
    "sage2-int4": {"q": ("int", 4, "block", 4), "k": ("int", 4, "block", 16), "smooth_k": True, "smooth_q": 128,
                   "probs": ("e4m3", None, "static", None), "v": ("e4m3", None, "channel", None)},
    "fa3-fp8": {t: ("e4m3", None, "block", 128) for t in "qkv"},
    "fa3-fp8-hadamard": {**{t: ("e4m3", None, "block", 128) for t in "qkv"}, "hadamard": 0},
    "kivi-2bit": {"k": ("asym", 2, "channel", 32), "v": ("asym", 2, "group", 32)},
    "kivi-4bit": {"k": ("asym", 4, "channel", 32), "v": ("asym", 4, "group", 32)},
    "mxfp4-attn": {t: ("mxfp4", None, "mx", None) for t in ("q", "k", "v", "probs")},
    "mxfp8-attn": {t: ("mxfp8_e4m3", None, "mx", None) for t in ("q", "k", "v", "probs")},
    "nvfp4-attn": {t: ("nvfp4", None, "mx", None) for t in ("q", "k", "v", "probs")},
    "logits-int4": {"logits": ("int", 4, "tensor", None)},
}
ARCHS = ["llama", "gemma3_text", "gpt2", "diffllama"]


def _model(arch: str, layers: int = 2):
    """A float64 model of ``layers`` decoder layers. With one, every quantizer input is the same float64 value here
    and in the naive reference (from the second layer on, float32 softmax rounding can tip a rounding tie)."""
    import transformers as tf
    from transformers import AutoModelForCausalLM

    base = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                max_position_embeddings=256)
    cfg = {
        "llama": lambda: tf.LlamaConfig(**base, num_key_value_heads=2, head_dim=32),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**base, num_key_value_heads=2, head_dim=32, sliding_window=6,
                                                   layer_types=["sliding_attention", "full_attention"][:layers]),
        "gpt2": lambda: tf.GPT2Config(vocab_size=101, n_embd=64, n_layer=layers, n_head=2, n_positions=256),
        "diffllama": lambda: tf.DiffLlamaConfig(**base, num_key_value_heads=2, head_dim=32),
    }[arch]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").double().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim == 2 and "norm" not in n:
                p.mul_(4.0)  # logits of a few units: quantization visibly changes the outputs
            if "lambda" in n:
                p.normal_(0, 0.3)
    return model


# -- the naive reference ------------------------------------------------------------------------------------------

def _elem(x: torch.Tensor, fmt: str, bits, amax) -> torch.Tensor:
    """Symmetric quantization of x with the scale amax / qmax (torch float8 casts for FP8)."""
    if amax == 0:
        return x
    if fmt == "int":
        m = 2 ** (bits - 1) - 1
        s = amax / m
        return torch.round(x / s).clamp(-m, m) * s
    s = amax / 448.0
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s


def _asym(x: torch.Tensor, bits: int) -> torch.Tensor:
    lo, hi = float(x.min()), float(x.max())
    if hi == lo:
        return x
    s = (hi - lo) / (2**bits - 1)
    return torch.round((x - lo) / s).clamp(0, 2**bits - 1) * s + lo


def _granule(x: torch.Tensor, how) -> torch.Tensor:
    fmt, bits, _, _ = how
    return _asym(x, bits) if fmt == "asym" else _elem(x, fmt, bits, float(x.abs().max()) if x.numel() else 0.0)


def _mx_rows(rows: torch.Tensor, fmt: str, amax=None) -> torch.Tensor:
    """torchao's MX / NVFP4 along the last dim of a 2-d tensor, zero-padded to whole blocks."""
    block = 16 if fmt == "nvfp4" else 32
    n = rows.shape[-1]
    padded = torch.nn.functional.pad(rows.float(), (0, -n % block))
    if fmt == "nvfp4":  # compressed-tensors: block scales as NVIDIA's conversion (torchao clamps them to 2^-6)
        out = compressed_tensors_nvfp4(padded, torch.tensor(amax, dtype=torch.float32))
    elif fmt.startswith("ct-"):  # compressed-tensors' own MX
        out = compressed_tensors_mx(padded, {"ct-mxfp4": "MXFP4", "ct-mxfp8_e4m3": "MXFP8"}[fmt])
    else:
        s, d = mx.to_mx(padded, MX_ELEM[fmt], 32)
        out = mx.to_dtype(d, s, MX_ELEM[fmt], 32, torch.float32)
    return out[:, :n].double()


def _tokens(x: torch.Tensor, real: torch.Tensor, how, along_tokens: bool) -> torch.Tensor:
    """x (B, Hx, T, d) quantized granule by granule among real tokens (B, T); padding tokens unchanged."""
    out = x.clone()
    fmt, _, gran, size = how
    for b in range(x.shape[0]):
        idx = torch.nonzero(real[b]).view(-1)
        for h in range(x.shape[1]):
            xs = x[b, h, idx]  # (t, d): the real tokens
            if gran == "mx":
                amax = float(xs.abs().max()) if fmt == "nvfp4" else None
                if fmt == "nvfp4":  # NVFP4's per-tensor scale: the whole sequence, all heads
                    amax = float(x[b][:, idx].abs().max())
                q = _mx_rows(xs.T, fmt, amax).T if along_tokens else _mx_rows(xs, fmt, amax)
            else:
                q = torch.empty_like(xs)
                T = x.shape[2]
                for sl in _slices(gran, size, idx, T, xs.shape[1]):
                    q[sl] = _granule(xs[sl], how)
            out[b, h, idx] = q
    return out


def _slices(gran, size, idx, T, d):
    """The granules of one head's (t, d) real-token matrix, as index tuples."""
    pos = idx.tolist()  # the real tokens' positions: contiguous (left or right padding); groups count from the first
    if gran == "block":  # N consecutive real tokens, the first real token starting the first block
        groups = {}
        for i, _ in enumerate(pos):
            groups.setdefault(i // size, []).append(i)
        return [(g, slice(None)) for g in groups.values()]
    if gran == "channel":  # each channel over all real tokens, or over groups of `size` real tokens
        groups = {}
        for i, _ in enumerate(pos):
            groups.setdefault(0 if size is None else i // size, []).append(i)
        return [(g, c) for g in groups.values() for c in range(d)]
    if gran == "group":  # `size` consecutive channels of each token
        return [(i, slice(c, c + size)) for i in range(len(pos)) for c in range(0, d, size)]
    if gran == "token":
        return [(i, slice(None)) for i in range(len(pos))]
    if gran == "head":
        return [(slice(None), slice(None))]
    raise AssertionError(gran)


def _hadamard(d: int, seed: int) -> torch.Tensor:
    h = torch.tensor([[1.0]], dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 - 1
    return signs[:, None] * h / math.sqrt(d)  # diag(signs) . H: QuaRot's randomized Hadamard (signs on the input)


def _mean_rows(x: torch.Tensor, real: torch.Tensor, rows: int | None) -> torch.Tensor:
    """Per-channel mean over real tokens (rows None: the whole sequence; else blocks of `rows` real tokens from the
    first), written to the block's real tokens (padding rows get 0: they are never scored)."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        idx = torch.nonzero(real[b]).view(-1).tolist()
        for h in range(x.shape[1]):
            for start in range(0, len(idx), rows or max(len(idx), 1)):
                sel = idx[start : start + (rows or len(idx))]
                out[b, h, sel] = x[b, h, sel].mean(0)
    return out


def naive_attention(desc: dict, real: torch.Tensor, record: list | None = None):
    """The attention function of a recipe; with ``record``, every call appends its raw and quantized pieces (the
    reference logits of the raw q and k, the quantized logits, both after the soft cap, P, the values, valid)."""
    def fn(module, query, key, value, attention_mask, scaling=None, softcap=None, dropout=0.0, **kw):
        B, H, T, d = query.shape
        q, k, v = query.double(), key.double(), value.double()
        raw = (q, k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1))
        if "hadamard" in desc:
            rot = _hadamard(d, desc["hadamard"])
            q, k = q @ rot, k @ rot
        if desc.get("smooth_k"):
            k = k - _mean_rows(k, real, None)
        qm = None
        if "smooth_q" in desc:
            qm = _mean_rows(q, real, desc["smooth_q"])
            q = q - qm
        k_exact = k
        q = _tokens(q, real, desc["q"], False) if "q" in desc else q
        k = _tokens(k, real, desc["k"], False) if "k" in desc else k
        v = _tokens(v, real, desc["v"], True) if "v" in desc else v
        rep = H // k.shape[1]
        kr, vr, ke = (t.repeat_interleave(rep, 1) for t in (k, v, k_exact))
        logits = q @ kr.transpose(-1, -2) * scaling
        if qm is not None:
            logits = logits + qm @ ke.transpose(-1, -2) * scaling
        allowed = attention_mask[:, :, :, :T] == 0  # eager's float mask: 0 where allowed
        valid = allowed & real[:, None, :, None]
        if "logits" in desc:
            logits = logits.clone()
            for b in range(B):
                logits[b][valid[b].expand(H, -1, -1)] = _granule(logits[b][valid[b].expand(H, -1, -1)], desc["logits"])
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        p = torch.softmax(logits.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
        if "probs" in desc:
            p = _probs(p, valid.expand_as(p), desc["probs"], real)
        if record is not None:
            ref = raw[0] @ raw[1].transpose(-1, -2) * scaling
            ref = ref if softcap is None else torch.tanh(ref / softcap) * softcap
            record.append({"ref": ref, "quant": logits, "probs": p, "value": raw[2], "quant_value": vr, "valid": valid})
        return (p @ vr).transpose(1, 2).contiguous().to(query.dtype), None

    return fn


def _probs(p: torch.Tensor, valid: torch.Tensor, how, real: torch.Tensor) -> torch.Tensor:
    fmt, bits, gran, _ = how
    out = p.clone()
    B, H, T, S = p.shape
    for b in range(B):
        amax = float(p[b][valid[b]].abs().max()) if fmt == "nvfp4" else None
        for h in range(H):
            for t in range(T):
                row = valid[b, h, t]
                if not row.any():
                    continue
                if gran == "mx":  # blocks along the keys from the sequence's first real key k0
                    k0 = int(real[b].int().argmax())
                    w = p[b, h, t].masked_fill(~row, 0)[k0:]
                    out[b, h, t, k0:][row[k0:]] = _mx_rows(w[None], fmt, amax)[0][row[k0:]]
                else:  # static: P <= 1, the scale 1 / 448
                    out[b, h, t, row] = _elem(p[b, h, t, row], fmt, bits, 1.0)
    return out


def _run_naive(model, desc, ids, mask, record: list | None = None, positions=None):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("test-naive", naive_attention(desc, mask.bool(), record))
    AttentionMaskInterface.register("test-naive", eager_mask)
    prev = model.config._attn_implementation
    model.set_attn_implementation("test-naive")
    try:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    finally:
        model.set_attn_implementation(prev)
        AttentionInterface._global_mapping.pop("test-naive", None)
        AttentionMaskInterface._global_mapping.pop("test-naive", None)


def _batch(T=20, left: int = 0):
    """Two sequences of T tokens: the second right-padded by 5; with ``left``, the first left-padded by that many."""
    ids = torch.randint(1, 101, (2, T), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, -5:] = 0
    mask[0, :left] = 0
    return ids, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 at each sequence's first real token (as for left padding)."""
    return (mask.cumsum(-1) - 1).clamp_min(0)


# Variants of the recipes with small blocks and groups, so that a short batch spans several of each (a test shorter
# than a block cannot tell one block size from another): spec text -> the naive description
SMALL = {
    "q=int8/per_block:8; k=int8/per_block:4; smooth_k": {"q": ("int", 8, "block", 8), "k": ("int", 8, "block", 4),
                                                         "smooth_k": True},
    "q=int4/per_block:4; k=int4/per_block:8; smooth_k; smooth_q:16; probs=e4m3/static; v=e4m3/per_channel":
        {"q": ("int", 4, "block", 4), "k": ("int", 4, "block", 8), "smooth_k": True, "smooth_q": 16,
         "probs": ("e4m3", None, "static", None), "v": ("e4m3", None, "channel", None)},
    "q=e4m3/per_block:8; k=e4m3/per_block:8; v=e4m3/per_block:8": {t: ("e4m3", None, "block", 8) for t in "qkv"},
    "k=asym2/per_channel:8; v=asym2/per_group:8": {"k": ("asym", 2, "channel", 8), "v": ("asym", 2, "group", 8)},
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("recipe", list(DESCRIBED))
def test_recipe_equals_naive_attention(recipe, arch):
    if arch == "diffllama" and recipe == "logits-int4":
        pytest.skip("covered by the logits tests of tests/quant/test_apply.py")
    model = _model(arch)
    ids, mask = _batch()
    want = _run_naive(model, DESCRIBED[recipe], ids, mask)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        with quantize_model(model, recipe):
            got = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-6, atol=1e-6)
    assert (got[real] - plain[real]).abs().max() > 1e-4  # the recipe does change the model


def _assert_naive(model, desc, text, T, left):
    ids, mask = _batch(T, left)
    pos = _positions(mask)
    want = _run_naive(model, desc, ids, mask, positions=pos)
    with torch.no_grad(), quantize_model(model, text):
        got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("text", list(SMALL))
def test_small_block_variants_span_several_blocks(text, arch):
    """40 tokens, one sequence left-padded by 3 and one right-padded by 5: 5-10 blocks or groups of each size, counted
    from each sequence's first real token."""
    _assert_naive(_model(arch, layers=1), SMALL[text], text, 40, left=3)


@pytest.mark.parametrize("recipe", [r for r in DESCRIBED if r != "logits-int4"])
def test_recipes_at_their_block_sizes(recipe):
    """Every recipe at 150 tokens (left padding 9, right padding 5): 2 blocks of 128 rows, 3 of 64, 5 groups of 32,
    9 NVFP4 blocks of 16 along the tokens and keys."""
    _assert_naive(_model("llama", layers=1), DESCRIBED[recipe], recipe, 150, left=9)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r not in LINEAR_RECIPES])  # linear ones: test_linear
def test_a_sequence_alone_or_padded_in_a_batch(recipe):
    """A sequence alone, left-padded and right-padded in a batch with longer ones: identical outputs (float64; the
    matmuls' summation order is the only difference, ~1e-15), so blocks and groups start at its first real token."""
    model = _model("llama")
    g = torch.Generator().manual_seed(11)
    seq, n, L = torch.randint(1, 101, (141,), generator=g), 141, 170
    with torch.no_grad(), quantize_model(model, recipe):
        alone = model(input_ids=seq[None]).logits[0]
        for side in ("left", "right"):
            ids = torch.randint(1, 101, (3, L), generator=g)
            mask = torch.ones(3, L, dtype=torch.long)
            sl = slice(L - n, L) if side == "left" else slice(0, n)
            ids[1, sl], mask[1] = seq, 0
            mask[1, sl] = 1
            mask[2, :7] = 0  # a third sequence with its own left padding
            got = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits[1, sl]
            torch.testing.assert_close(got, alone, rtol=1e-9, atol=1e-9, msg=f"{recipe}, {side}-padded")


def test_every_recipe_is_described():
    assert set(DESCRIBED) | {"logits-int8", "logits-int6"} == set(RECIPES) - set(LINEAR_RECIPES)  # those: test_linear


@pytest.mark.parametrize("text", ["smooth_k", "hadamard:3", "smooth_k; smooth_q:4; hadamard:1"])
def test_exact_transforms_change_nothing_unquantized(text):
    """K/Q smoothing and the Hadamard rotation without quantization: the outputs move by float rounding only (the
    softmax runs in float32, as eager attention's: ~1e-7 relative), never by a quantization step."""
    model = _model("llama")
    ids, mask = _batch()
    real = mask.bool()
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        with quantize_model(model, text):
            got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[real], plain[real], rtol=2e-6, atol=2e-6)


def test_hadamard_seed_changes_what_is_quantized():
    """Two seeds of the attention's rotation: the same unquantized outputs, different quantized ones."""
    model = _model("llama")
    ids, mask = _batch()
    real = mask.bool()
    out = {}
    with torch.no_grad():
        for text in ("k=int4/per_token; hadamard:0", "k=int4/per_token; hadamard:5", "hadamard:0", "hadamard:5"):
            with quantize_model(model, text):
                out[text] = model(input_ids=ids, attention_mask=mask).logits[real]
    torch.testing.assert_close(out["hadamard:0"], out["hadamard:5"], rtol=2e-6, atol=2e-6)
    assert (out["k=int4/per_token; hadamard:0"] - out["k=int4/per_token; hadamard:5"]).abs().max() > 1e-3


@pytest.mark.parametrize("text", ["q,k=int8/per_block:128; smooth_k", "kv=asym2/per_channel:32",
                                  "q=mxfp4; k=mxfp4; v=mxfp4; probs=mxfp4; layers:0,2", "sage2-int4", "logits=e4m3/per_head",
                                  "fa3-fp8-hadamard", "smooth_k; hadamard:3"])
def test_text_form_round_trips(text):
    spec = QuantSpec.parse(text)
    assert QuantSpec.parse(str(spec)) == spec


def test_plus_separates_lists_like_a_comma():
    """lm-eval's model_args split at commas, so every list in a spec also takes '+': the same spec as the comma form,
    written out by hand, whose canonical text keeps the commas."""
    plus = QuantSpec.parse("q+kv=int8/per_token; layers:0+2; linears:self_attn.*+mlp.down_proj; a=int8/per_token")
    assert [(p.target, p.bits) for p in plus.parts if p.target in "qkv"] == [("q", 8), ("k", 8), ("v", 8)]
    assert plus.layers == (0, 2) and plus.linears == ("self_attn.*", "mlp.down_proj")
    assert "linears:self_attn.*,mlp.down_proj" in str(plus) and "+" not in str(plus)


@pytest.mark.parametrize("text,msg", [("sage3", "did you mean sage1"), ("q=int9/per_token", "bits in 2..8"),
                                      ("q=mxfp4/per_token", "brings its own blocks"),
                                      ("probs=int8/per_head", "granularity must be one of per_row, static"),
                                      ("k=int4/per_group:5", "not a multiple of the group size 5"),
                                      ("smooth_k; smooth_k", "smooth_k is given twice"),
                                      ("hadamard:1; q=int8/per_token; hadamard:2", "hadamard is given twice"),
                                      ("hadamard:99999999999999999999999", r"seed in 0..2\^63-1"),
                                      ("", "empty quantization spec")])
def test_bad_specs_are_one_line(text, msg):
    with pytest.raises(OutlierscopeError, match=msg):
        model = _model("llama")
        with quantize_model(model, text), torch.no_grad():
            model(input_ids=torch.ones(1, 4, dtype=torch.long))


def test_blocked_attention_gives_the_same_result():
    model = _model("llama")
    ids, mask = _batch(24)
    with torch.no_grad():
        with quantize_model(model, "sage2-int4"):
            one = model(input_ids=ids, attention_mask=mask).logits
        with quantize_model(model, "sage2-int4", block_rows=5):
            blocked = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(blocked[mask.bool()], one[mask.bool()], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("fmt,bits", [("int", 4), ("asym", 3), ("e4m3", None)])
@pytest.mark.parametrize("gran,size", [("per_block", 3), ("per_channel", 4), ("per_channel", None), ("per_group", 4),
                                       ("per_token", None), ("per_head", None)])
def test_granularities_against_naive(gran, size, fmt, bits):
    """quantize_tokens granule by granule against the loops above, with padding tokens in the middle of groups."""
    from outlierscope.quant.attention.ops import quantize_tokens
    from outlierscope.quant.specs.parts import TensorQuant

    if fmt == "asym" and gran == "per_head":
        pytest.skip("same code path as per_token")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 11, 8, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, 8, dtype=torch.float64)
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, -3:] = False
    tq = TensorQuant("k", fmt, bits, gran, size)
    naive_gran = {"per_block": "block", "per_channel": "channel", "per_group": "group", "per_token": "token",
                  "per_head": "head"}[gran]
    want = _tokens(x, valid, (fmt, bits, naive_gran, size), False)
    got = quantize_tokens(x, valid, tq)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[1, :, -3:], x[1, :, -3:])  # padding comes back unchanged


def test_recipes_command_lists_every_recipe(capsys):
    from outlierscope.cli import main

    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for r in RECIPES.values():
        assert f"{r.name}\n  spec:         {QuantSpec.parse(r.name)}\n" in out and r.source in out
    assert main(["recipes", "q,k=int8/per_block:128;smooth_k"]) == 0
    assert capsys.readouterr().out == "q=int8/per_block:128; k=int8/per_block:128; smooth_k\n"  # canonical text
    assert main(["recipes", "sage3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean sage1" in err
