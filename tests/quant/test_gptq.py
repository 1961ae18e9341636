"""GPTQ against a float64 re-implementation written here from the paper's sequential form (Frantar et al. 2022, the
OBS update of Algorithm 1 without the Cholesky reformulation or lazy blocks): the inverse Hessian is updated after
each column by removing that column, so the two agree only if the Cholesky factor and the block-wise propagation are
right. The scale of a dynamic group is taken, as GPT-QModel takes it, from the weights as they were when the block
holding the group's first column began."""


import numpy as np
import pytest
import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.weights.gptq import gptq_quantize, hessian_update


def _grid(x: np.ndarray, scale: np.ndarray, bits: int, fmt: str) -> np.ndarray:
    """Round x (O,) to the symmetric grid with scale (O,): fint onto [-2^(b-1), 2^(b-1) - 1], int onto +-(2^(b-1) - 1);
    zint: scale (O, 2) holds each row's scale and zero point, x onto s (clip(round(x / s) + z, 0, 2^b - 1) - z)."""
    if fmt == "zint":
        s, z = scale[..., 0], scale[..., 1]
        return s * (np.clip(np.round(x / s) + z, 0, 2**bits - 1) - z)
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if fmt == "fint" else (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1)
    safe = np.where(scale > 0, scale, 1.0)
    return np.where(scale > 0, np.clip(np.round(x / safe), lo, hi) * safe, x)


def _scale(block: np.ndarray, bits: int, fmt: str) -> np.ndarray:
    if fmt == "zint":  # GPT-QModel's find_params, sym=False: (O, 2) scale and zero point
        lo, hi = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
        both = (lo == 0) & (hi == 0)
        lo, hi = np.where(both, -1.0, lo), np.where(both, 1.0, hi)
        s = (hi - lo) / (2**bits - 1)
        return np.stack([s, np.round(-lo / s)], -1)
    qmax = (2**bits - 1) / 2 if fmt == "fint" else 2 ** (bits - 1) - 1
    return np.abs(block).max(axis=1) / qmax


def _order(diag: np.ndarray, order: str, group: int | None) -> np.ndarray:
    """Act order: decreasing diagonal; GAR: groups by decreasing largest diagonal, inside each by decreasing diagonal."""
    if order == "desc":
        return np.argsort(-diag, kind="stable")
    if order == "gar":
        groups = sorted(range(len(diag) // group), key=lambda g: -diag[g * group:(g + 1) * group].max())
        return np.concatenate([g * group + np.argsort(-diag[g * group:(g + 1) * group], kind="stable") for g in groups])
    return np.arange(len(diag))


def _reference(w, h, bits, fmt, group, block, damp, order_name, static):
    """Sequential OBS-form GPTQ in float64 (numpy): returns the rounded weight in the original column order."""
    W, H = w.astype(np.float64).copy(), h.astype(np.float64).copy()
    n_out, n_in = W.shape
    row_scale = _scale(W, bits, fmt)
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    G = group or n_in
    static_scales = np.stack([_scale(W[:, g:g + G], bits, fmt) for g in range(0, n_in, G)], 1) if static and group else None
    order = _order(np.diag(H), order_name, group)
    W, H = W[:, order], H[np.ix_(order, order)]
    H = H + damp * np.mean(np.diag(H)) * np.eye(n_in)
    Hinv = np.linalg.inv(H)
    Q = np.zeros_like(W)
    snapshot = W.copy()
    scale = row_scale
    for j in range(n_in):
        if j % block == 0:
            snapshot = W.copy()  # the weights as this block begins
        if group and static_scales is None and j % group == 0:
            scale = _scale(snapshot[:, j:j + group], bits, fmt)
        elif static_scales is not None:
            scale = static_scales[:, order[j] // group]
        Q[:, j] = _grid(W[:, j], scale, bits, fmt)
        err = (W[:, j] - Q[:, j]) / Hinv[j, j]
        W[:, j + 1:] -= np.outer(err, Hinv[j, j + 1:])
        Hinv = Hinv - np.outer(Hinv[:, j], Hinv[j, :]) / Hinv[j, j]  # column j removed (OBS)
    return Q[:, np.argsort(order)]


def _layer(n_out=24, n_in=96, n=6, T=40, seed=0):
    """A bf16-valued weight and the Hessian of inputs with a few large channels (as real activations have)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n_out, n_in, generator=g) * 0.05).bfloat16().double()
    x = torch.randn(n, T, n_in, generator=g, dtype=torch.float64) * (1 + 9 * (torch.rand(n_in, generator=g) < 0.1))
    x[..., 5] = 0  # a dead input column
    h = 2 / n * x.reshape(-1, n_in).t() @ x.reshape(-1, n_in)
    return w, h


@pytest.mark.parametrize("bits, fmt, group, block, order, static", [
    (4, "fint", 16, 32, "none", False),  # groups inside blocks: scales from the block's start
    (4, "fint", 32, 32, "desc", False),  # act order, dynamic groups in processing order
    (4, "fint", 16, 32, "desc", True),   # act order, static groups (llm-compressor's)
    (3, "fint", 16, 32, "gar", False),   # group-aware reordering (GPT-QModel's default)
    (3, "int", None, 40, "none", False),  # per channel, blocks that do not divide I
    (8, "fint", 48, 128, "desc", False),  # one block
    (4, "zint", 16, 32, "desc", False),  # integer zero points, act order, dynamic groups
    (3, "zint", 16, 32, "none", True),   # integer zero points, static groups
    (4, "zint", None, 40, "none", False),  # integer zero points per channel
])
def test_gptq_equals_the_sequential_form_in_float64(bits, fmt, group, block, order, static):
    w, h = _layer()
    ours = gptq_quantize(w, h, bits, fmt, group, block, damp=0.01, order=order, static_groups=static)
    ref = _reference(w.numpy(), h.numpy(), bits, fmt, group, block, 0.01, order, static)
    np.testing.assert_allclose(ours.weight.numpy(), ref, rtol=0, atol=1e-12)
    assert not torch.equal(ours.weight, _rtn(w, bits, fmt, group))  # GPTQ moved codes away from round-to-nearest
    assert (ours.weight[:, 5] == 0).all()  # the dead column
    G = group or w.shape[1]
    codes = ours.weight / ours.scale.gather(1, ours.g_idx.expand(w.shape[0], -1) if group else
                                            torch.zeros_like(ours.weight, dtype=torch.long))
    assert torch.allclose(codes, codes.round(), atol=1e-9)  # each weight an integer times its group's scale
    assert (ours.zero is not None) == (fmt == "zint")
    assert ours.scale.shape == (w.shape[0], w.shape[1] // G)


def _rtn(w, bits, fmt, group):
    G = group or w.shape[1]
    ws = w.reshape(w.shape[0], -1, G).numpy()  # (O, I/G, G)
    return torch.from_numpy(np.stack([_grid(ws[:, k], _scale(ws[:, k], bits, fmt)[:, None], bits, fmt)
                                      for k in range(ws.shape[1])], 1).reshape(w.shape))


def test_gptq_lowers_the_layer_output_error_against_rtn():
    """The objective GPTQ minimizes, tr((W - Q) H (W - Q)^T), is below round-to-nearest's on the same grid."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(24, 96, generator=g) * 0.05).bfloat16().double()
    x = torch.randn(400, 96, generator=g, dtype=torch.float64) @ torch.randn(96, 96, generator=g, dtype=torch.float64)
    h = 2 * x.T @ x / 400  # correlated input channels, as a layer's are
    q = gptq_quantize(w, h, 4, "fint", 16).weight
    err = lambda d: float(torch.trace(d @ h @ d.T))  # noqa: E731
    assert err(w - q) < 0.8 * err(w - _rtn(w, 4, "fint", 16))


def test_hessian_streams_as_the_batches_come():
    """hessian_update over batches of sequences equals 2/n X^T X over all of them (float64 inputs: float64; float32
    inputs: float32, the references' running rescale)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(b, 7, 12, generator=g, dtype=torch.float64) for b in (3, 1, 4)]
    h, n = None, 0
    for x in xs:
        h, n = hessian_update(h, n, x)
    X = torch.cat([x.reshape(-1, 12) for x in xs])
    torch.testing.assert_close(h, 2 / 8 * X.T @ X, rtol=1e-12, atol=1e-12)
    h32, _ = hessian_update(None, 0, xs[0].float())
    assert h32.dtype == torch.float32
    assert n == 8


def test_inputs_unchanged_and_bad_shapes_are_one_line():
    w, h = _layer()
    w0, h0 = w.clone(), h.clone()
    gptq_quantize(w, h, 4, "fint", 16, order="desc")
    assert torch.equal(w, w0) and torch.equal(h, h0)
    with pytest.raises(OutlierscopeError, match="not a multiple of the group size 7"):
        gptq_quantize(w, h, 4, "fint", 7)
    with pytest.raises(OutlierscopeError, match="Hessian must be"):
        gptq_quantize(w, h[:-1, :-1], 4)
    with pytest.raises(OutlierscopeError, match="gar: with groups"):
        gptq_quantize(w, h, 4, order="gar")
    with pytest.raises(OutlierscopeError, match="not positive definite"):
        gptq_quantize(w, -h, 4, damp=0.0)


PACKED = __import__("pathlib").Path(__file__).resolve().parents[1] / "models" / "packed"


@pytest.mark.parametrize("variant, bits, group, fmt, order", [("gptq-w3g32-sym", 3, 32, "fint", "gar"),
                                                              ("gptq-w8g64-sym", 8, 64, "fint", "gar"),
                                                              ("gptq-w4g32-asym-actorder", 4, 32, "zint", "desc")])
def test_first_layer_codes_and_scales_are_gpt_qmodels(variant, bits, group, fmt, order):
    """GPT-QModel 7.6's own checkpoints (tests/models/packed, made by references/gptq_fixtures.py: damp 0.05, block 128,
    group-aware reordering (symmetric) or act order with integer zero points (sym=False, desc_act), 16 seeded random
    sequences of 64 tokens; the float16 model loaded in bfloat16 on its CPU): layer 0's q/k/v see the calibration
    inputs unchanged by any quantization, so their Hessian is computed here from those sequences through the
    bfloat16 model; every integer code, zero point, float16 scale and g_idx of the file is ours."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from outlierscope.models.packed import unpack_codes

    model = AutoModelForCausalLM.from_pretrained(PACKED / "float").to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    h, n = None, 0
    for ids in [torch.randint(1, 6144, (1, 64), generator=g) for _ in range(16)]:
        with torch.no_grad():
            h, n = hessian_update(h, n, model.model.layers[0].input_layernorm(model.model.embed_tokens(ids)))
    ck = safe_open(PACKED / variant / "model.safetensors", "pt")
    for name in ("q_proj", "k_proj", "v_proj"):
        pre = f"model.layers.0.self_attn.{name}."
        codes = unpack_codes(ck.get_tensor(pre + "qweight"), bits, 0).t()  # (out, in), unsigned
        scales = ck.get_tensor(pre + "scales")  # (groups, out) float16
        w = getattr(model.model.layers[0].self_attn, name).weight.float()
        ours = gptq_quantize(w, h, bits, fmt, group, 128, damp=0.05, order=order)
        idx = ours.g_idx.expand(w.shape[0], -1)  # (out, in)
        shift = ours.zero.gather(1, idx) if fmt == "zint" else 2 ** (bits - 1)  # the packed codes are unsigned
        mine = torch.round(ours.weight / ours.scale.gather(1, idx)) + shift
        assert torch.equal(mine.to(torch.int32), codes), (name, int((mine != codes).sum()))
        assert torch.equal(ours.scale.t().half(), scales), name
        assert torch.equal(ours.g_idx.int(), ck.get_tensor(pre + "g_idx")), name
        if fmt == "zint":  # checkpoint_format gptq (v1): each field holds zero - 1
            zeros = (unpack_codes(ck.get_tensor(pre + "qzeros"), bits, 1)[:, : scales.shape[1]] + 1) & (2**bits - 1)
            assert torch.equal(ours.zero.t().to(torch.int32), zeros), name


FIXTURES = __import__("pathlib").Path(__file__).resolve().parent / "fixtures"


@pytest.mark.parametrize("order", ["none", "desc"])
def test_static_groups_equal_llm_compressors_gptq(order):
    """llm-compressor 0.14's own ``quantize_weight`` (references/gptq_llmc_reference.py in its venv: static min-max group
    scales from compressed-tensors, 4-bit symmetric groups of 16, block 32, damp 0.01, without and with
    actorder="weight"; its Hessian of layer 0's inputs): on the same Hessian and weights, static groups give every
    weight of q/k/v_proj equal, and the Hessian ours streams from the same sequences equals theirs."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ref = safe_open(FIXTURES / "gptq_llmc.safetensors", "pt")
    model = AutoModelForCausalLM.from_pretrained(PACKED / "float").to(torch.bfloat16).eval()
    h = ref.get_tensor("hessian")
    g = torch.Generator().manual_seed(1)
    mine, n = None, 0
    for ids in [torch.randint(1, 6144, (1, 64), generator=g) for _ in range(16)]:
        with torch.no_grad():
            mine, n = hessian_update(mine, n, model.model.layers[0].input_layernorm(model.model.embed_tokens(ids)))
    torch.testing.assert_close(mine, h, rtol=1e-5, atol=1e-6 * float(h.abs().max()))  # float32 sums, another order
    for name in ("q_proj", "k_proj", "v_proj"):
        w = getattr(model.model.layers[0].self_attn, name).weight.float()
        ours = gptq_quantize(w, h, 4, "fint", 16, 32, damp=0.01, order=order, static_groups=True)
        tag = f"{name}.{'weight' if order == 'desc' else 'none'}"
        assert torch.equal(ours.scale, ref.get_tensor(f"{tag}.scale")), name
        theirs = ref.get_tensor(f"{tag}.weight")
        assert torch.equal(ours.weight, theirs), (name, int((ours.weight != theirs).sum()))


def test_gptq_settings_read_back_and_bad_ones_are_one_line():
    """A spec's gptq part: settings other than the defaults in its canonical text, read back to the same settings;
    a wrong key or value is one line naming what is expected."""
    from outlierscope.errors import OutlierscopeError
    from outlierscope.quant.specs.calibrated import GPTQConfig

    cfg = GPTQConfig.parse("order=desc,static,sequential=layer,damp=0.05")
    assert (cfg.order, cfg.static, cfg.sequential, cfg.damp) == ("desc", True, "layer", 0.05)
    assert str(cfg) == "gptq:damp=0.05,order=desc,static,sequential=layer" and GPTQConfig.parse(str(cfg)[5:]) == cfg
    assert str(GPTQConfig.parse("")) == "gptq"
    for bad, msg in (("sequential=block", "sequential= must be one of subset, layer, got 'block'"),
                     ("order=asc", "order= must be one of none, desc, gar"), ("damp=1.5", "0 < X < 1"), ("damp=0", "0 < X < 1"), ("order=desc,order=none", "sets order twice"),
                         ("block=1.5", "expected a number"),
                     ("steps=3", "expected KEY=VALUE items among")):
        with pytest.raises(OutlierscopeError, match=msg):
            GPTQConfig.parse(bad)


SMOLLM2_FIXTURE = FIXTURES / "gptq_gptqmodel_smollm2.safetensors"
SMOLLM2_SETTINGS = {  # the fixture's QuantizeConfig settings -> (bits, grid, order, static groups) in outlierscope's terms
    "w4g64-sym-gar": (4, "fint", "gar", False), "w4g64-sym": (4, "fint", "none", False),
    "w4g64-zp": (4, "zint", "none", False), "w4g64-sym-desc": (4, "fint", "desc", False),
    "w4g64-sym-static": (4, "fint", "none", True), "w4g64-sym-desc-static": (4, "fint", "desc", True),
    "w3g64-sym-gar": (3, "fint", "gar", False), "w3g64-zp-desc": (3, "zint", "desc", False),
}


def _smollm2_digests(fixture) -> tuple[dict, int]:
    """GPT-QModel's digests of ``fixture`` made on this machine's kind of processor, and the torch thread count they
    were made with: the fixture's own (the processor its metadata names; the first fixture, without the field, was
    made on an Intel Xeon), or the JSON that references/gptq_smollm2_reference.py --hessians wrote beside it on the
    other kind (``.amd.json``, ``.intel.json``) from the fixture's Hessians (float32 Cholesky factors and matmuls round
    by processor and by thread count: all were made with torch's default on 2-core machines, 2 threads). A processor
    without digests: skipped, naming the command that makes them."""
    import hashlib
    import json

    from safetensors import safe_open

    from outlierscope.io import machine

    cpu = machine()["cpu"]  # /proc/cpuinfo's model name, as every record names the machine
    kind = next((k for k in ("Intel", "AMD") if k in cpu), None)
    meta = safe_open(fixture, "pt").metadata()
    if kind is not None and kind in meta.get("processor", "Intel(R) Xeon(R) Processor"):
        return json.loads(meta["digests"]), int(meta.get("torch_threads", 2))
    path = fixture.with_suffix(f".{(kind or 'other').lower()}.json")
    if path.exists():
        rec = json.loads(path.read_text())
        assert rec["fixture_sha256"] == hashlib.sha256(fixture.read_bytes()).hexdigest(), path  # its Hessians
        return rec["digests"], int(rec.get("torch_threads", 2))
    pytest.skip(f"no GPT-QModel digests of {fixture.name} made on {cpu}: run references/gptq_smollm2_reference.py "
                f"--hessians tests/quant/fixtures/{fixture.name} --out tests/quant/fixtures/{path.name} here")


@pytest.mark.skipif(not __import__("outlierscope.models.fetch", fromlist=["is_fetched"]).is_fetched("smollm2-135m"),
                    reason="SmolLM2-135M is not fetched (make test fetches it)")
@pytest.mark.parametrize("layer", [0, 15])
def test_smollm2_layers_equal_gpt_qmodels_gptq_bit_for_bit(layer):
    """GPT-QModel 7.6's own GPTQ (references/gptq_smollm2_reference.py in its venv: its GPTQ task, add_batch and quantize,
    damp 0.01, block 128) on SmolLM2-135M's real linears (their weights rounded to bfloat16 values): q/k/v_proj of
    layers 0 and 15, and o_proj and gate/up_proj of layer 0, with the Hessians it accumulated from outlierscope's
    128 x 512 calibration tokens: for 8 settings (symmetric with and without group-aware reordering, zero point,
    act order, static groups, act order with static groups, 3 bits with GAR, 3 bits zero point with act order)
    every quantized weight, scale, zero point and g_idx is bit for bit GPT-QModel's (sha256 of the bytes), made on
    the same kind of processor (:func:`_smollm2_digests`). A damping mean over a strided view of the diagonal (the code
    before) fails in both layers (39 and 24 differing fields on the Intel Xeon, 38 and 24 on the AMD EPYC)."""
    import hashlib

    from safetensors import safe_open

    from outlierscope.models.loading import load_model

    def sha(t):
        return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()

    ref = safe_open(SMOLLM2_FIXTURE, "pt")
    digests, threads = _smollm2_digests(SMOLLM2_FIXTURE)
    block = load_model("smollm2-135m").model.model.layers[layer]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the reference's thread count (a run under 1 thread differs in the last bits)
    try:
        wrong, checked = _compare_with_digests(block, ref, digests, layer, sha)
    finally:
        torch.set_num_threads(before)
    assert checked == (6 if layer == 0 else 3) * len(SMOLLM2_SETTINGS)
    assert not wrong, (len(wrong), wrong)


SMOLLM2_DOWN_FIXTURE = FIXTURES / "gptq_gptqmodel_smollm2_down.safetensors"


@pytest.mark.skipif(not __import__("outlierscope.models.fetch", fromlist=["is_fetched"]).is_fetched("smollm2-135m"),
                    reason="SmolLM2-135M is not fetched (make test fetches it)")
def test_smollm2_down_proj_equals_gpt_qmodels_gptq_bit_for_bit():
    """The same for layer 0's down_proj (1536 inputs: 24 groups of 64, 12 blocks of 128; its input, the gated product,
    the layer's most outlier-laden), from a fixture of its own (references/gptq_smollm2_reference.py --down, made on
    an AMD EPYC): GPT-QModel's Hessian accumulated from the 128 x 512 calibration tokens, stored as its upper triangle
    (the symmetric matrix it spans is what GPT-QModel quantized with), and GPT-QModel's digests for the 8 settings."""
    import hashlib

    from safetensors import safe_open

    from outlierscope.models.loading import load_model

    def sha(t):
        return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()

    ref = safe_open(SMOLLM2_DOWN_FIXTURE, "pt")
    digests, threads = _smollm2_digests(SMOLLM2_DOWN_FIXTURE)
    block = load_model("smollm2-135m").model.model.layers[0]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        wrong, checked = _compare_with_digests(block, ref, digests, 0, sha)
    finally:
        torch.set_num_threads(before)
    assert checked == len(SMOLLM2_SETTINGS)
    assert not wrong, (len(wrong), wrong)


def _hessian(ref, layer: int, group: str) -> torch.Tensor | None:
    """A fixture's Hessian of one input: stored whole (``.hessian``) or as its upper triangle row by row
    (``.hessian_upper``: n (n + 1) / 2 values, mirrored here), None where the fixture has none."""
    if f"layer{layer}.{group}.hessian" in ref.keys():
        return ref.get_tensor(f"layer{layer}.{group}.hessian")
    if f"layer{layer}.{group}.hessian_upper" not in ref.keys():
        return None
    v = ref.get_tensor(f"layer{layer}.{group}.hessian_upper")
    n = int(round(((8 * v.numel() + 1) ** 0.5 - 1) / 2))  # v.numel() == n (n + 1) / 2
    h = torch.zeros(n, n, dtype=v.dtype)
    for i in range(n):  # row i holds columns i..n-1, after i * n - i (i - 1) / 2 values of the rows above
        off = i * n - i * (i - 1) // 2
        h[i, i:] = v[off:off + n - i]
        h[i:, i] = v[off:off + n - i]
    return h


def _compare_with_digests(block, ref, digests: dict, layer: int, sha) -> tuple[list[str], int]:
    """(fields that differ from GPT-QModel's digests, results checked) for one SmolLM2 layer's linears."""
    groups = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
              "mlp": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
    wrong, checked = [], 0
    for group, names in groups.items():
        h = _hessian(ref, layer, group)
        if h is None:
            continue
        for key, (bits, fmt, order, static) in SMOLLM2_SETTINGS.items():
            for name in names:
                w = block.get_submodule(name).weight.detach().to(torch.bfloat16).float()  # a bfloat16 checkpoint's
                ours = gptq_quantize(w, h, bits, fmt, 64, 128, damp=0.01, order=order, static_groups=static)
                want = digests[f"layer{layer}.{name.split('.')[-1]}.{key}"]
                got = {"weight": sha(ours.weight), "scale": sha(ours.scale.float()), "g_idx": sha(ours.g_idx.int())}
                if fmt == "zint":
                    got["zero"] = sha(ours.zero.float())
                wrong += [f"{name} {key} {k}" for k, v in got.items() if v != want[k]]
                checked += 1
    return wrong, checked


def test_gptq_damping_averages_a_contiguous_copy_of_the_diagonal():
    """GPT-QModel (and IST-DASLab's GPTQ, llm-compressor) damp with ``damp * torch.mean(torch.diag(H))``: the mean of
    a contiguous copy. The Hessian (SmolLM2's hidden size) is the first of 64 seeded ones whose strided mean differs from
    the contiguous one in its last bit on this processor (which ones do depends on the processor's summation: about
    half of them on an Intel Xeon and on an AMD EPYC)."""
    import torch

    from outlierscope.quant.weights.gptq import inverse_hessian_factor

    def hessian(seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(256, 576, generator=g) * torch.rand(576, generator=g) * 10
        return x.T @ x  # (576, 576)

    h = next((h for h in map(hessian, range(64)) if torch.mean(h.diagonal()) != torch.mean(torch.diag(h))), None)
    assert h is not None  # the case exists
    ref = h.clone()  # GPT-QModel 7.6's lines, written out
    diag = torch.arange(576)
    ref[diag, diag] += 0.01 * torch.mean(torch.diag(ref))
    ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(ref)), upper=True)
    assert torch.equal(inverse_hessian_factor(h, 0.01), ref)
