"""Several specs' item scores in one pass, each batch's unquantized trunk shared (outlierscope.eval.together):
every score the bytes of scoring the spec alone, the layers below a spec's first not run again."""

import numpy as np
import pytest
import torch

from outlierscope.data.hellaswag import load_hellaswag
from outlierscope.eval.requests import build_requests, lmeval_max_length
from outlierscope.eval.scorer import score_requests
from outlierscope.eval.together import score_requests_together
from outlierscope.hooks.points import decoder_layers
from outlierscope.models.loading import load_model
from outlierscope.quant.apply import quantize_model
from outlierscope.quant.specs.spec import QuantSpec


@pytest.fixture(scope="module", params=["transformer", "diff"])
def setup(request, hs_jsonl):
    """The bundled pair's model (4 layers) in float32 with bfloat16-valued weights (ties of float32 arithmetic show),
    and its requests."""
    lm = load_model(f"pair-tiny:{request.param}")
    model = lm.model.float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    items = load_hellaswag(hs_jsonl)
    return model, build_requests(items, lm.tokenizer, lmeval_max_length(model, lm.tokenizer))


def _alone(model, reqs, spec, layout, batch_size):
    with quantize_model(model, spec):
        return score_requests(model, reqs, layout, batch_size)


def _counting(model):
    runs = []
    handles = [b.register_forward_pre_hook(lambda m, a: runs.append(1)) for b in decoder_layers(model)]
    return runs, handles


@pytest.mark.parametrize("layout, texts", [
    ("shared", ("w8a8; layers:1-3", "w8a8", "w=int4/per_group:16; layers:2", "a=int8/per_token; layers:3",
                "logits=int8/per_row; layers:1")),
    ("separate", ("logits=int4/per_tensor; layers:2", "kivi-2bit; layers:3", "w=nvfp4; a=nvfp4; layers:0",
                  "w8a8; layers:1", "sage1; layers:1-2")),
])
def test_each_spec_scores_the_bytes_it_scores_alone(setup, layout, texts):
    """Per spec, bit for bit the scores of ``score_requests`` in its own context (float32, bf16-valued weights,
    padded batches of unequal lengths, batch size 3: several batches); the decoder layers run counted: the
    unquantized forward once per batch, then each spec from its first layer."""
    model, reqs = setup
    specs = [QuantSpec.parse(t) for t in texts]
    want = [_alone(model, reqs, spec, layout, 3) for spec in specs]
    runs, handles = _counting(model)
    try:
        got = score_requests_together(model, reqs, specs, layout, batch_size=3)
    finally:
        for h in handles:
            h.remove()
    for spec, w, g in zip(specs, want, got, strict=True):
        assert np.array_equal(np.isnan(w), np.isnan(g)) and np.array_equal(w[~np.isnan(w)], g[~np.isnan(g)]), spec
    n_layers = len(decoder_layers(model))
    first = [0 if s.layers is None else min(s.layers) for s in specs]
    per_batch = max(first) + sum(n_layers - f for f in first)  # the recording forward stops after max(first) - 1
    batches = len(runs) // per_batch
    assert batches >= 2 and len(runs) == batches * per_batch
    assert all(type(b).__name__ != "_Replay" for b in decoder_layers(model))  # the layers are back


def test_shards_score_their_batches_only(setup):
    """With ``shards`` the batches of those virtual shards, each score as the whole pass gives it (NaN elsewhere)."""
    model, reqs = setup
    specs = [QuantSpec.parse("w8a8; layers:2"), QuantSpec.parse("a=int8/per_token; layers:1")]
    whole = score_requests_together(model, reqs, specs, "shared", batch_size=4)
    part = score_requests_together(model, reqs, specs, "shared", batch_size=4, shards=[0])
    for w, p in zip(whole, part):
        got = ~np.isnan(p)
        assert got.any() and np.array_equal(p[got], w[got])


def test_calibrations_must_match_the_specs(setup):
    model, reqs = setup
    with pytest.raises(ValueError, match="one entry per spec"):
        score_requests_together(model, reqs, [QuantSpec.parse("w8a8")], "shared", calibrations=[None, None])


def test_evaluate_together_gives_what_evaluate_gives_each_spec(hs_jsonl):
    """Each result of ``evaluate_together`` is ``evaluate``'s for its spec alone: per-item scores bit for bit,
    predictions, metrics and settings; a run cut in two shards and merged gives the same."""
    from outlierscope.eval.evaluate import evaluate, merge_results
    from outlierscope.eval.together import evaluate_together
    from outlierscope.parallel import Shard

    lm = load_model("pair-tiny:diff")
    items = load_hellaswag(hs_jsonl)
    texts = ("w8a8; layers:2", "a=int8/per_token; layers:1-3", "w=int4/per_group:16; layers:3")
    alone = [evaluate(lm, quant=t, items=items, batch_size=6, progress=False) for t in texts]
    together = evaluate_together(lm, specs=texts, items=items, batch_size=6, progress=False)
    halves = [evaluate_together(lm, specs=texts, items=items, batch_size=6, progress=False, shard=Shard(i, 2))
              for i in range(2)]
    merged = [merge_results([halves[0][j], halves[1][j]]) for j in range(len(texts))]
    for want, got, got2 in zip(alone, together, merged, strict=True):
        for res in (got, got2):
            assert res.items.equals(want.items) and res.metrics == want.metrics and res.settings == want.settings


def test_evaluate_together_refuses_specs_of_two_layouts(hs_jsonl):
    from outlierscope.eval.together import evaluate_together

    lm = load_model("pair-tiny:diff")
    with pytest.raises(ValueError, match="one layout"):
        evaluate_together(lm, specs=["w8a8; layers:1", "logits=int4/per_tensor; layers:2"],
                          items=load_hellaswag(hs_jsonl), progress=False)
