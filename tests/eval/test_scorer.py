import numpy as np
import pytest
import torch

from outlierscope.data.hellaswag import load_hellaswag
from outlierscope.eval.hellaswag import build_requests, lmeval_max_length
from outlierscope.eval.scorer import score_requests
from outlierscope.models.loading import load_model
from outlierscope.quant.apply import quantize_attention
from outlierscope.quant.spec import QuantSpec


@pytest.fixture(scope="module", params=["transformer", "diff"])
def setup(request, tiny_pair, hs_jsonl):
    lm = load_model(str(tiny_pair[request.param]))
    items = load_hellaswag(hs_jsonl)
    return lm, build_requests(items, lm.tokenizer, lmeval_max_length(lm.model, lm.tokenizer))


def naive_scores(model, reqs):
    """lm-eval's computation: one sequence per choice, full logits, log_softmax, sum over the continuation."""
    out = np.zeros((len(reqs), 4))
    with torch.no_grad():
        for i, r in enumerate(reqs):
            for j, cont in enumerate(r.conts):
                inp = torch.tensor([r.inputs(j)])
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
    with quantize_attention(lm.model, QuantSpec(bits=4, granularity="per_row")):
        shared = score_requests(lm.model, reqs, "shared", 8)
        sep = score_requests(lm.model, reqs, "separate", 8)
    np.testing.assert_allclose(shared, sep, atol=1e-4, rtol=0)
    assert np.abs(shared - score_requests(lm.model, reqs, "shared", 8)).max() > 1e-3  # quantization did something


def test_per_tensor_quantization_changes_scores_per_sequence(setup):
    lm, reqs = setup
    with quantize_attention(lm.model, QuantSpec(bits=4, granularity="per_tensor")):
        a = score_requests(lm.model, reqs, "separate", 1)
        b = score_requests(lm.model, reqs, "separate", 16)
    assert np.abs(a - b).max() < 1e-4  # one sequence's scale never depends on the batch
