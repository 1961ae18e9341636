import numpy as np
import pytest
import torch

from outlierscope.data.hellaswag import load_hellaswag
from outlierscope.eval.requests import build_requests, lmeval_max_length
from outlierscope.eval.scorer import score_requests
from outlierscope.models.loading import load_model
from outlierscope.quant.apply import quantize_model
from outlierscope.quant.specs.spec import QuantSpec


@pytest.fixture(scope="module", params=["transformer", "diff"])
def setup(request, tiny_pair, hs_jsonl):
    lm = load_model(str(tiny_pair[request.param]))
    items = load_hellaswag(hs_jsonl)
    return lm, build_requests(items, lm.tokenizer, lmeval_max_length(lm.model, lm.tokenizer))


def naive_scores(model, reqs, max_length=None):
    """lm-eval's computation: one sequence per choice, left-truncated as lm-eval's HFLM does
    (``(context_enc + continuation_enc)[-(max_length + 1):][:-1]``), full logits, log_softmax, sum over the
    continuation's last positions."""
    out = np.zeros((len(reqs), 4))
    with torch.no_grad():
        for i, r in enumerate(reqs):
            for j, cont in enumerate(r.conts):
                ml = max_length or r.max_length
                inp = torch.tensor([(list(r.ctx) + list(cont))[-(ml + 1) :][:-1]])
                lp = torch.log_softmax(model(input_ids=inp).logits[0], -1)
                n = inp.shape[1]
                out[i, j] = sum(lp[n - len(cont) + k, t].item() for k, t in enumerate(cont))
    return out


def test_layouts_equal_reference(setup):
    lm, reqs = setup
    ref = naive_scores(lm.model, reqs)
    for layout in ("shared", "separate"):
        np.testing.assert_allclose(score_requests(lm.model, reqs, layout, 4), ref, atol=1e-4, rtol=0)


def test_batch_size_independence(setup):
    lm, reqs = setup
    a = score_requests(lm.model, reqs, "shared", 1)
    b = score_requests(lm.model, reqs, "shared", 32)
    assert np.abs(a - b).max() < 1e-4 and (a.argmax(1) == b.argmax(1)).all()
    c = score_requests(lm.model, reqs, "separate", 3)
    d = score_requests(lm.model, reqs, "separate", 32)
    assert np.abs(c - d).max() < 1e-4


def test_per_row_quantization_exact_with_shared_prefix(setup):
    lm, reqs = setup
    with quantize_model(lm.model, QuantSpec.logits(bits=4, granularity="per_row")):
        shared = score_requests(lm.model, reqs, "shared", 8)
        sep = score_requests(lm.model, reqs, "separate", 8)
    np.testing.assert_allclose(shared, sep, atol=1e-4, rtol=0)
    assert np.abs(shared - score_requests(lm.model, reqs, "shared", 8)).max() > 1e-3  # quantization did something


@pytest.mark.parametrize("granularity", ["per_tensor", "per_head"])
def test_whole_sequence_scales_equal_naive_reference(setup, granularity):
    """per_tensor / per_head: the scale sees the whole sequence, so each (context, ending) runs alone in the naive
    reference; our batched scores equal it, do not depend on the batch, and differ from unquantized."""
    lm, reqs = setup
    plain = score_requests(lm.model, reqs, "separate", 16)
    with quantize_model(lm.model, QuantSpec.logits(bits=4, granularity=granularity)):
        a = score_requests(lm.model, reqs, "separate", 1)
        b = score_requests(lm.model, reqs, "separate", 16)
        ref = naive_scores(lm.model, reqs)
    np.testing.assert_allclose(b, ref, atol=1e-4, rtol=0)
    assert np.abs(a - b).max() < 1e-4  # one sequence's scale never depends on the batch
    assert np.abs(b - plain).max() > 1e-2  # and quantization changed the scores


def test_truncated_requests_equal_naive_reference(tiny_pair, hs_jsonl):
    """A 16-token context: lm-eval truncates from the left; every item goes through the separate layout."""
    lm = load_model(str(tiny_pair["diff"]))
    reqs = build_requests(load_hellaswag(hs_jsonl), lm.tokenizer, 16)
    assert all(r.truncated for r in reqs)
    ref = naive_scores(lm.model, reqs, max_length=16)
    for layout in ("shared", "separate"):
        np.testing.assert_allclose(score_requests(lm.model, reqs, layout, 8), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("granularity", ["per_tensor", "per_head", "per_row"])
def test_blocked_attention_same_scores(setup, granularity):
    """--attn-block: query rows in blocks of 5 (two passes for per_tensor / per_head) give the unblocked scores,
    with the shared (tree-masked) layout too."""
    lm, reqs = setup
    layout = "shared" if granularity == "per_row" else "separate"
    spec = QuantSpec.logits(bits=4, granularity=granularity)
    with quantize_model(lm.model, spec):
        ref = score_requests(lm.model, reqs, layout, 8)
    with quantize_model(lm.model, spec, block_rows=5):
        got = score_requests(lm.model, reqs, layout, 8)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    assert (got.argmax(1) == ref.argmax(1)).all()


def _task_docs():
    """Hand-written rows of the zero-shot tasks: 2 to 5 choices, shared and per-choice (WinoGrande) contexts."""
    from outlierscope.data.tasks import get_task

    rows = [
        ("arc_easy", {"question": "Which one melts ice fastest?", "answerKey": "C",
                      "choices": {"text": ["a cold stone", "a wooden spoon", "a warm hand", "snow", "the moon at night"],
                                  "label": ["A", "B", "C", "D", "E"]}}),
        ("arc_easy", {"question": "What do plants need?", "answerKey": "2",
                      "choices": {"text": ["salt", "light", "plastic"], "label": ["1", "2", "3"]}}),
        ("winogrande", {"sentence": "The trophy did not fit in the suitcase because the _ was too big.",
                        "option1": "trophy", "option2": "suitcase", "answer": "1"}),
        ("copa", {"premise": "The girl was tired.", "choice1": "She went to bed.", "choice2": "She ran a race.",
                  "question": "effect", "label": "0"}),
        ("boolq", {"passage": "Water boils at one hundred degrees at sea level.", "question": "does water boil",
                   "answer": True}),
    ]
    return [get_task(name).build(i, row) for i, (name, row) in enumerate(rows)]


@pytest.mark.parametrize("layout", ["shared", "separate"])
def test_ragged_choices_and_per_choice_contexts_equal_reference(setup, layout):
    """Zero-shot task requests (2-5 choices, WinoGrande's per-choice contexts) against the naive full-logit
    computation, with and without quantization; NaN where an item has fewer choices."""
    from outlierscope.eval.requests import build_requests, predictions

    lm, _ = setup
    reqs = build_requests(_task_docs(), lm.tokenizer, lmeval_max_length(lm.model, lm.tokenizer))
    assert [len(r.conts) for r in reqs] == [5, 3, 2, 2, 2] and reqs[2].ctxs is not None and reqs[0].ctxs is None

    def naive(model):
        out = np.full((len(reqs), 5), np.nan)
        with torch.no_grad():
            for i, r in enumerate(reqs):
                for j, cont in enumerate(r.conts):
                    inp = torch.tensor([r.inputs(j)])
                    lp = torch.log_softmax(model(input_ids=inp).logits[0], -1)
                    n = inp.shape[1]
                    out[i, j] = sum(lp[n - len(cont) + k, t].item() for k, t in enumerate(cont))
        return out

    got = score_requests(lm.model, reqs, layout, 4)
    ref = naive(lm.model)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0, equal_nan=True)
    pred, pred_norm = predictions(got, [r.choice_chars for r in reqs])
    assert all(p < len(r.conts) for p, r in zip(pred, reqs)) and all(p < len(r.conts) for p, r in zip(pred_norm, reqs))
    if layout == "separate":  # per_tensor scales see each (context, ending) sequence alone
        with quantize_model(lm.model, QuantSpec.logits(bits=4, granularity="per_tensor")):
            np.testing.assert_allclose(score_requests(lm.model, reqs, layout, 4), naive(lm.model), atol=1e-4, rtol=0,
                                       equal_nan=True)


@pytest.mark.parametrize("task", ["arc_easy", "winogrande", "copa"])
def test_evaluate_a_zero_shot_task(setup, task, tmp_path):
    """evaluate(task=...): the cached task's rows, NaN-padded scores for missing choices, predictions within each
    item's choices, equal to scoring the same requests directly; the result saves and loads back."""
    from outlierscope.data.tasks import get_task, load_docs
    from outlierscope.eval.evaluate import EvalResult, evaluate
    from outlierscope.eval.requests import build_requests

    if not get_task(task).cached:
        pytest.skip("task data not cached (make test fetches it)")
    lm, _ = setup
    res = evaluate(lm, task=task, limit=12, batch_size=8, progress=False)
    reqs = build_requests(load_docs(task, 12), lm.tokenizer, lmeval_max_length(lm.model, lm.tokenizer))
    direct = score_requests(lm.model, reqs, "shared", 8)
    np.testing.assert_allclose(res.items[res.score_columns].to_numpy(), direct, atol=1e-6, equal_nan=True)
    n = np.array([len(r.conts) for r in reqs])
    assert (res.items["pred"].to_numpy() < n).all() and (res.items["pred_norm"].to_numpy() < n).all()
    assert res.settings["task"] == task and 0 <= res.metrics["acc"] <= 1
    res.save(tmp_path, "cell")
    back = EvalResult.load(tmp_path, "cell")
    assert back is not None and back.score_columns == res.score_columns
    assert res.compare(back)["mean_abs_score_change"] == 0


@pytest.mark.parametrize("quant, layout, ok", [(None, "separate", True), (None, "shared", True),
                                               (QuantSpec.logits(bits=4, granularity="per_row"), "shared", True),
                                               (QuantSpec.logits(bits=4), "separate", True), (QuantSpec.logits(bits=4), "shared", False),
                                               (None, "packed", False)])
def test_evaluate_layout(setup, hs_jsonl, quant, layout, ok):
    """evaluate(layout=...): any exact layout scores as the default one does (the record says which ran); a
    layout that is not exact for the quantization is a one-line error."""
    from outlierscope.errors import ParamError
    from outlierscope.eval.evaluate import evaluate

    lm, _ = setup
    if not ok:
        with pytest.raises(ParamError, match="layout must be 'separate'"):
            evaluate(lm, quant=quant, data=hs_jsonl, limit=3, progress=False, layout=layout)
        return
    got = evaluate(lm, quant=quant, data=hs_jsonl, limit=6, batch_size=4, progress=False, layout=layout)
    ref = evaluate(lm, quant=quant, data=hs_jsonl, limit=6, batch_size=4, progress=False)
    assert got.settings["layout"] == layout
    np.testing.assert_allclose(got.items[got.score_columns].to_numpy(), ref.items[ref.score_columns].to_numpy(),
                               atol=1e-4, rtol=0)


def test_llama4_text_trunk_found_structurally(setup):
    """Llama4ForCausalLM's base_model is the model itself (its trunk is ``model``, its prefix another name): the
    scorer must still run trunk and head apart, and equal the naive full-logit scores."""
    import transformers as tf

    from outlierscope.hooks.points import trunk

    lm, reqs = setup
    torch.manual_seed(0)
    cfg = tf.Llama4TextConfig(vocab_size=lm.model.config.vocab_size, hidden_size=32, intermediate_size=48,
                              intermediate_size_mlp=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, num_local_experts=2, max_position_embeddings=512)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    assert model.base_model is model and trunk(model) is model.model
    for layout in ("shared", "separate"):
        np.testing.assert_allclose(score_requests(model, reqs, layout, 4), naive_scores(model, reqs, 512), atol=1e-4,
                                   rtol=0)


def test_bfloat16_agrees_with_float32_on_a_real_model(hellaswag_cached):
    """bf16 weights and activations on the bundled trained model, 200 seeded HellaSwag items: predictions agree with
    float32 on >= 97% of items, and every per-choice log-likelihood within 2^-7 of its size. The bound's reason: bf16
    keeps 8 significant bits (unit roundoff u = 2^-9); a log-likelihood is a sum of log-probabilities each carrying a
    few roundings, so its relative error stays within a few u: 4u = 2^-7 (measured: at most 0.34% on both models of
    the pair at 300 items, 99.3-100% identical predictions)."""
    from outlierscope.eval.evaluate import evaluate

    res = {dt: evaluate(load_model("pair-tiny:diff", dtype=dt), sample=200, progress=False) for dt in ("float32", "bfloat16")}
    a, b = res["float32"], res["bfloat16"]
    for col in ("pred", "pred_norm"):
        assert (a.items[col] == b.items[col]).mean() >= 0.97, col
    x, y = a.items[a.score_columns].to_numpy(), b.items[b.score_columns].to_numpy()
    assert (np.abs(x - y) <= 2**-7 * np.abs(x)).all(), np.max(np.abs(x - y) / np.abs(x))
    assert np.abs(x - y).max() > 0  # really bf16 arithmetic


@pytest.mark.parametrize("quant", ["sage1", "sage2-int4", "fa3-fp8", "k=asym2/per_channel:32; v=asym2/per_token",
                                   "mxfp4-attn", "nvfp4-attn",
                                   "logits-int8", "logits-int4", QuantSpec.logits(bits=4, granularity="per_row")])
def test_quantized_scores_depend_on_the_batch_only_through_float32_rounding(setup, quant):
    """In float64 (kernel-shape rounding ~1e-16, which no quantizer boundary can separate in practice) every recipe
    and the paper's logits at 8/4 bits give the same per-item scores at batch 1, 7 and 32, padded or not: nothing of
    one sequence enters another's scales or blocks. In float32 a last-bit difference of a GEMM whose kernel the BLAS
    picks by the number of rows can cross a rounding boundary, so a quantized cell's identity holds its batch size
    (tests/runs/test_sweep.py) and batch size 1 is the exactly batch-invariant setting."""
    import copy

    lm, reqs = setup
    reqs = reqs[:4]
    model = copy.deepcopy(lm.model).double()
    layout = "shared" if isinstance(quant, QuantSpec) else "separate"
    with quantize_model(model, quant):
        got = {b: score_requests(model, reqs, layout, b) for b in (1, 7, 32)}
    plain = score_requests(model, reqs, layout, 32)
    np.testing.assert_allclose(got[7], got[1], rtol=0, atol=1e-9)
    np.testing.assert_allclose(got[32], got[1], rtol=0, atol=1e-9)
    assert np.abs(got[1] - plain).max() > 1e-3  # the quantization does change the scores


def test_evaluate_takes_a_spec_as_text(setup, hs_jsonl):
    """evaluate(quant="w8a8; k=int4/per_token") is the parsed spec's evaluation (same scores and record); a misspelt recipe
    fails with did-you-mean before any forward."""
    from outlierscope.errors import OutlierscopeError
    from outlierscope.eval.evaluate import evaluate
    from outlierscope.quant.specs.spec import QuantSpec

    lm, _ = setup
    kw = dict(data=hs_jsonl, limit=4, batch_size=4, progress=False)
    got = evaluate(lm, quant="w8a8; k=int4/per_token", **kw)
    ref = evaluate(lm, quant=QuantSpec.parse("w8a8; k=int4/per_token"), **kw)
    assert got.settings == ref.settings and got.items.equals(ref.items)
    assert not got.items.equals(evaluate(lm, **kw).items)
    with pytest.raises(OutlierscopeError, match="did you mean w8a8"):
        evaluate(lm, quant="w8a9", **kw)
    with pytest.raises(OutlierscopeError, match="the model.s head_dim 8 is not a multiple of the group size 32"):
        evaluate(lm, quant="kivi-2bit", **kw)  # checked against the model's shape before the first forward
