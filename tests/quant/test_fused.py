"""Fused kernels (``fused_kernels``, ``--fused``): the quantizers compiled by torch.compile give the eager quantizers'
bytes (compared as int32 / int64 bit patterns, so a flipped sign of zero counts) on every linear scheme's activation
and weight part, on bfloat16-valued data spanning many blocks and groups with outliers, padding, all-zero blocks,
every MX shared exponent and E2M1 ties; and MX / NVFP4 compiled equal torchao and compressed-tensors themselves. The
compiled path is proven taken (dynamo's compiled-frame counter), refused where the model runs on a GPU, and a run
with ``fused`` writes the cells (bytes and identities) of a run without it."""

import dataclasses
import warnings

import pytest
import torch

from outlierscope.errors import ParamError
from outlierscope.quant.attention.ops import first_real, quantize_probs, quantize_tokens
from outlierscope.quant.linears.ops import outlier_columns, quantize_activation, quantize_weight
from outlierscope.quant.numerics.fused import fallbacks, fusable, fused_kernels, fusing
from outlierscope.quant.specs.recipes import RECIPES
from outlierscope.quant.specs.spec import QuantSpec

LINEAR = [n for n, r in RECIPES.items() if QuantSpec.parse(n).part("a") is not None or QuantSpec.parse(n).part("w")]
MORE = ["w=mxfp8_e4m3; a=mxfp8_e4m3", "w=mxint8; a=mxint8", "w=mxfp6_e2m3; a=mxfp6_e3m2", "w=zint4/per_group:32"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def _frames() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


def _activations(dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, 70, 640) bfloat16-valued inputs (640 = 20 blocks of 32, 40 of 16, 10 groups of 64, 5 of 128; 70 tokens), two outlier
    channels, an all-zero block, a token of powers of two; and a validity mask with left and right padding."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 70, 640, generator=g) * torch.logspace(-3, 1, 640)[torch.randperm(640, generator=g)])
    x[:, :, 7] *= 400
    x[1, :, 300] *= -90
    x[2, 5, 32:64] = 0
    x[0, 9] = torch.exp2(torch.randint(-20, 20, (640,), generator=g).float())
    valid = torch.ones(3, 70, dtype=torch.bool)
    valid[0, :6], valid[2, 61:] = False, False
    return x.bfloat16().to(dtype), valid


CASES = [(n, torch.float32) for n in LINEAR + MORE] + [(n, torch.float64) for n in ("nvfp4", "w8a8", MORE[0])]


@pytest.mark.parametrize("name, dtype", CASES)
def test_fused_quantizers_give_the_eager_bytes(name, dtype):
    """Each quantizer one graph (no break: the whole chain fused), its bytes the eager ones."""
    spec = QuantSpec.parse(name)
    x, valid = _activations(dtype)
    a, w = spec.part("a"), spec.part("w")
    weight = (torch.randn(96, 640, generator=torch.Generator().manual_seed(1)) * 0.04).bfloat16().to(dtype)
    cols = outlier_columns(x, valid, spec.outlier_threshold) if spec.outlier_threshold is not None else None
    cases = [] if a is None else [(quantize_activation, (x, v, a, cols)) for v in (None, valid)]
    cases += [] if w is None else [(quantize_weight, (weight, w))]
    for fn, args in cases:
        eager = fn(*args)
        if dtype == torch.float32:
            assert torch._dynamo.explain(fn.eager)(*args).graph_break_count == 0, f"{name}: {fn.__name__}"
        failed = fallbacks()
        with fused_kernels(), warnings.catch_warnings():
            warnings.simplefilter("ignore" if dtype == torch.float64 else "error", RuntimeWarning)
            fused = fn(*args)
        # the MX FP6 / FP8 element rounding of float64 runs (frexp) is the one graph inductor cannot build: eager
        assert fallbacks() == failed or dtype == torch.float64 and fallbacks()[-1].endswith("float64")
        assert torch.equal(_bits(fused), _bits(eager)), f"{name}: {fn.__name__}"


@pytest.mark.parametrize("name", ["nvfp4", "llm-int8"])
def test_fused_over_changing_shapes(name):
    """A forward feeds each quantizer several shapes (576 and 1536 channels, batches of other lengths): after the
    first recompile dynamo compiles shape-generic kernels; each shape's bytes are still the eager ones."""
    spec = QuantSpec.parse(name)
    a, w = spec.part("a"), spec.part("w")
    g = torch.Generator().manual_seed(5)
    for shape in ((2, 64, 576), (2, 64, 1536), (3, 41, 576), (1, 97, 1536)):
        x = (torch.randn(*shape, generator=g) * 3).bfloat16().float()
        x[..., 11] *= 200
        valid = torch.ones(shape[:2], dtype=torch.bool)
        valid[0, : shape[1] // 3] = False  # left padding
        cols = outlier_columns(x, valid, spec.outlier_threshold) if spec.outlier_threshold is not None else None
        weight = (torch.randn(shape[1] + 7, shape[2], generator=g) * 0.05).bfloat16().float()
        for fn, args in ((quantize_activation, (x, valid, a, cols)), (quantize_weight, (weight, w))):
            eager = fn(*args)
            with fused_kernels():
                fused = fn(*args)
            assert torch.equal(_bits(fused), _bits(eager)), f"{name} {shape}: {fn.__name__}"


ATTENTION = [n for n, r in RECIPES.items() if any(QuantSpec.parse(n).part(t) for t in ("q", "k", "v", "probs"))]
# the attention recipes' parts in one list, and spec parts of the other granularities
ATTENTION_PARTS = sorted({str(p): p for n in ATTENTION + ["k=asym2/per_channel:32; probs=int8/static",
                                                                "q=int8/per_token; k=int4/per_group:32; v=int8/per_head; probs=int8/per_row"]
                          for p in (QuantSpec.parse(n).part(t) for t in ("q", "k", "v", "probs")) if p}.items())


def _qkv(shape: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16-valued q/k/v-like (B, H, T, d) data with outlier channels and an all-zero token, its (B, T) validity with
    left padding (row 0) and right padding (row 1), causal probabilities (B, H, T, T) of it and each row's first key."""
    B, H, T, d = shape
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, H, T, d, generator=g) * torch.logspace(-2, 1, d)[torch.randperm(d, generator=g)])
    x[..., 3] *= 60
    x[:, :, T // 2] = 0
    x = x.bfloat16().float()
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, : T // 3], valid[1, T - T // 4:] = False, False
    logits = torch.randn(B, H, T, T, generator=g) * 4
    keys = valid[:, None, None, :] & torch.ones(T, T, dtype=torch.bool).tril()  # (B, 1, T, T)
    probs = logits.masked_fill(~keys, float("-inf")).softmax(-1).nan_to_num(0.0)
    return x, valid, probs, first_real(valid)


@pytest.mark.parametrize("part", [p for _, p in ATTENTION_PARTS], ids=[n for n, _ in ATTENTION_PARTS])
def test_fused_attention_quantizers_give_the_eager_bytes(part):
    """Attention's q/k/v and P quantizers of every recipe, compiled, over changing shapes (dynamo's shape-generic
    kernels from the first call) with left and right padding and groups of tokens counted from the first real
    token: the eager bytes, from one graph each (no break), the compiled path taken."""
    shapes = ((2, 3, 70, 64), (3, 3, 45, 64), (2, 2, 130, 128), (3, 4, 33, 64))
    for n, shape in enumerate(shapes):
        x, valid, probs, start = _qkv(shape, n)
        fn, args = (quantize_probs, (probs, valid[:, None, None, :], part, start)) if part.target == "probs" else \
            (quantize_tokens, (x, valid, part))
        eager = fn(*args)
        if n == 0:
            assert torch._dynamo.explain(fn.eager)(*args).graph_break_count == 0, str(part)
        frames, failed = _frames(), fallbacks()
        with fused_kernels(), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            fused = fn(*args)
        assert fallbacks() == failed and torch.equal(_bits(fused), _bits(eager)), f"{part} {shape}"
        assert _frames() > frames or n > 0, str(part)  # compiled (a later shape may reuse the generic kernel)


@pytest.mark.parametrize("text", ["logits=int8/per_tensor", "logits=int4/per_tensor", "logits=int6/per_head",
                                  "logits=int4/per_row", "logits=e4m3/per_row"])
def test_fused_logits_give_the_eager_bytes(text):
    """The paper's logits quantizer compiled, its own scale and a scale given from blocks of rows (``amax``), over
    changing shapes with padding and the causal mask: the eager bytes."""
    from outlierscope.quant.attention.logits import logits_quant

    lq = logits_quant(QuantSpec.parse(text))
    for n, shape in enumerate(((2, 3, 70, 64), (3, 3, 45, 64), (2, 2, 130, 128))):
        _, valid, _, _ = _qkv(shape, n)
        B, H, T, _ = shape
        logits = (torch.randn(B, H, T, T, generator=torch.Generator().manual_seed(n)) * 9).bfloat16().float()
        keys = valid[:, None, None, :] & torch.ones(T, T, dtype=torch.bool).tril()  # (B, 1, T, T)
        for amax in (None, lq.absmax(logits, keys) * 1.25):
            eager = lq(logits, keys, amax)
            with fused_kernels(), warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                fused = lq(logits, keys, amax)
            assert torch.equal(_bits(fused), _bits(eager)), f"{text} {shape} amax={amax is not None}"


def test_every_mx_shared_exponent_and_e2m1_tie():
    """Blocks whose max is 2^k (k from -140 to 127: every E8M0 scale, the clamped ones too) times mantissas that put
    elements on E2M1's and E4M3's midpoints; NVFP4 blocks whose elements sit on E2M1 ties under their block scale."""
    ks = torch.arange(-140, 128, dtype=torch.float32)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1.0625, 0.1, -0.75, -5.0, 0, 0, 0, 0] * 2)
    x = (torch.exp2(ks)[:, None] / 6 * mids[None, :])  # (268, 32): one block per exponent
    x[:, 7] = torch.exp2(ks)  # the block max
    tq = {f: dataclasses.replace(QuantSpec.parse("w=mxint8").part("w"), format=f) for f in
          ("mxfp4", "ct-mxfp4", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxint8", "nvfp4")}
    for fmt, part in tq.items():
        rows = x if fmt != "nvfp4" else x[120:150]  # NVFP4's per-tensor scale: a range its E4M3 scales can hold
        eager = quantize_weight(rows, part)
        failed = fallbacks()
        with fused_kernels():
            fused = quantize_weight(rows, part)
        assert fallbacks() == failed and torch.equal(_bits(fused), _bits(eager)), fmt


def test_fused_mx_and_nvfp4_equal_torchao_and_compressed_tensors():
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from tests.quant.test_formats import _bf16_weights, compressed_tensors_nvfp4

    w = _bf16_weights(0)
    for fmt, elem in (("mxfp4", torch.float4_e2m1fn_x2), ("mxfp8_e4m3", torch.float8_e4m3fn)):
        scale, data = mx.to_mx(w, elem, 32)
        with fused_kernels():
            fused = quantize_weight(w, QuantSpec.parse(f"w={fmt}").part("w"))
        assert torch.equal(fused, mx.to_dtype(data, scale, elem, 32, torch.float32)), fmt
    with fused_kernels():
        fused = quantize_weight(w, QuantSpec.parse("w=nvfp4").part("w"))
    assert torch.equal(fused, compressed_tensors_nvfp4(w, w.abs().amax()))


def test_the_context_turns_it_on_and_restores_it():
    x, _ = _activations(torch.float32, seed=3)
    part = QuantSpec.parse("a=int8/per_token").part("a")
    assert not fusing()
    with pytest.raises(RuntimeError):
        with fused_kernels():
            assert fusing()
            with fused_kernels(False):
                assert not fusing()
                before = _frames()
                quantize_activation(x, None, part)  # eager: nothing compiled
                assert _frames() == before
            assert fusing()
            raise RuntimeError("inside")
    assert not fusing()
    assert quantize_activation.eager is not quantize_activation


def test_a_graph_that_fails_to_compile_runs_eagerly_with_a_warning(monkeypatch):
    failure = torch._dynamo.exc.BackendCompilerFailed.__new__(torch._dynamo.exc.BackendCompilerFailed)
    Exception.__init__(failure, "CppCompileError: C++ compile error")  # what inductor raises, without a compiler

    def broken(fn, **options):  # torch.compile(fn, dynamic=...)
        def call(*a, **k):
            raise failure
        return call

    monkeypatch.setattr(torch, "compile", broken)

    @fusable
    def double(x):
        return x * 2

    with fused_kernels(), pytest.warns(RuntimeWarning, match="double on torch.float32: compiling failed .* eagerly"):
        assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    assert fallbacks()[-1].endswith("double on torch.float32")
    with fused_kernels(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no second attempt, no second warning
        assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0))


def test_an_input_off_the_cpu_runs_eagerly_with_a_warning(monkeypatch):
    """A GPU model under ``fused_kernels()`` directly (the runs refuse it): eager, a warning; the meta device stands
    in for a GPU here (nothing is compiled: torch.compile would fail the test)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **options: pytest.fail("compiled an input off the CPU"))

    @fusable
    def triple(x):
        return x * 3

    with fused_kernels(), pytest.warns(RuntimeWarning, match="triple on torch.float32: its input is on meta"):
        assert triple(torch.ones(3, device="meta")).device.type == "meta"


def test_fused_refused_on_a_gpu_placement():
    from outlierscope.runs.sweep_settings import SweepSettings

    with pytest.raises(ParamError, match="fused must be False where the model runs on a GPU"):
        SweepSettings(fused=True, device_map="auto")
    with pytest.raises(ParamError, match="fused must be True or False"):
        SweepSettings(fused="yes")
    assert SweepSettings(fused=True).fused


def test_a_fused_perplexity_run_writes_the_same_cells(tmp_path):
    from outlierscope.runs.perplexity import PerplexitySettings, perplexity

    base = dict(model="pair-tiny:transformer", quant=("nvfp4", "mxfp4", "llm-int8", "sage2-int4", "mxfp8-attn",
                                                      "nvfp4-attn", "logits-int4"), max_windows=2, length=128,
                dtype="float32")
    cells = {}
    for fused in (False, True):
        perplexity(PerplexitySettings(**base, fused=fused), tmp_path / str(fused), log=lambda *a, **k: None)
        cells[fused] = {p.name: p.read_bytes() for p in sorted((tmp_path / str(fused) / "cells").glob("*.npz"))}
    assert len(cells[True]) == 8 and cells[True] == cells[False]


def test_fused_hellaswag_scores_are_the_eager_ones(hs_jsonl):
    """HellaSwag items in batches of varying length (every (context, ending) its own padded sequence): attention's
    compiled quantizers, one shape-generic kernel over all of them, score every item as the eager ones do."""
    from outlierscope.eval.evaluate import evaluate
    from outlierscope.models.loading import load_model

    lm = load_model("pair-tiny:diff")
    for spec in ("nvfp4-attn", "sage2-int4", "logits-int6"):
        eager = evaluate(lm, quant=spec, data=hs_jsonl, limit=8, batch_size=5, progress=False)
        with fused_kernels():
            fused = evaluate(lm, quant=spec, data=hs_jsonl, limit=8, batch_size=5, progress=False)
        cols = eager.score_columns
        assert fused.items[cols].equals(eager.items[cols]), spec


def test_a_run_resumed_with_fused_is_the_same_run(tmp_path):
    """``fused`` and ``attn_block`` change speed only: an output directory made without them is resumed with them (and
    back) without ``force``; another setting is still refused."""
    import json

    from outlierscope.runs.cells import Refused, refuse_other_settings

    prev = tmp_path / "record.json"
    prev.write_text(json.dumps({"settings": {"model": "m", "fused": False, "attn_block": None, "seed": 0}}))
    defaults = {"model": None, "fused": False, "attn_block": None, "seed": 0}
    refuse_other_settings(prev, {"model": "m", "fused": True, "attn_block": 64, "seed": 0}, defaults, "a run", force=False)
    with pytest.raises(Refused, match="seed differ"):
        refuse_other_settings(prev, {"model": "m", "fused": True, "attn_block": None, "seed": 1}, defaults, "a run",
                              force=False)
