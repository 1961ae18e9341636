import numpy as np
import pytest

from outlierscope.analysis.paired import mean_stderr
from outlierscope.data.hellaswag import HellaSwagItem, build_doc, preprocess
from outlierscope.eval.requests import Encoder, build_requests, predictions


@pytest.mark.parametrize("raw,expected", [
    ("  Hello world  ", "Hello world"),
    ("How to cook [title] Boil water.", "How to cook. Boil water."),
    ("[header] How to x [title] Do y [step] now", " How to x. Do y now"),  # strip runs first: a space stays
    ("a  b   c", "a b  c"),  # only the first pass of double spaces, once
    ("keep [unclosed bracket", "keep [unclosed bracket"),
    ("tag[a] and [b]c", "tag and c"),
])
def test_preprocess(raw, expected):
    assert preprocess(raw) == expected


def test_doc_rules_with_empty_ctx_b():
    item = HellaSwagItem(7, "Home and Garden", "[header] How to clean [title] Fill it.", "", ("[step] a.", "b", "c", "d"), 2)
    doc = build_doc(item)
    # ctx = ctx_a + " " + "" -> trailing space; the query is preprocessed (stripped)
    assert doc.query == "Home and Garden: How to clean. Fill it."
    assert doc.choices == (" a.", "b", "c", "d") and doc.label == 2 and doc.index == 7  # lm-eval keeps the space


def test_ctx_b_capitalised():
    item = HellaSwagItem(0, "Running", "A woman runs.", "then she", ("x", "y", "z", "w"), 0)
    assert build_doc(item).query == "Running: A woman runs. Then she"


class FakeTok:
    """Whitespace-and-punctuation tokenizer with BOS, so that special tokens and splits are visible."""

    bos_token_id, eos_token_id = 1, 2

    def __init__(self):
        self.vocab = {}

    def _id(self, piece):
        return self.vocab.setdefault(piece, 10 + len(self.vocab))

    def encode(self, text, add_special_tokens=True):
        import re

        ids = [self._id(p) for p in re.findall(r" ?[A-Za-z']+| ?[^A-Za-z' ]| +", text)]
        return ([self.bos_token_id] if add_special_tokens else []) + ids

    def __call__(self, texts, add_special_tokens=True):  # the batched API of Hugging Face tokenizers
        return {"input_ids": [self.encode(t, add_special_tokens) for t in texts]}

    def decode(self, i):
        return "<s>" if i == 1 else "</s>"


def lmeval_encode_pair(tok, context, continuation):
    """lm-eval 0.4.13 `_encode_pair` + `tok_encode` (add_bos_token=None), written out literally."""
    def tok_encode(s):
        kw = {}
        if s.startswith(tok.decode(tok.bos_token_id)):
            kw["add_special_tokens"] = False
        return tok.encode(s, **kw)

    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tok_encode(context + continuation)
    ctx = tok_encode(context)
    return ctx, whole[len(ctx):]


PAIRS = [("Roofing: A man is on a roof. He", " starts pulling."), ("trailing space ", " x."), ("<s>starts with bos", " y"),
         ("a", " b c d")]


@pytest.mark.parametrize("ctx,cont", PAIRS)
def test_encode_pair_matches_reference(ctx, cont):
    tok = FakeTok()
    assert Encoder(tok).pair(ctx, cont) == lmeval_encode_pair(tok, ctx, cont)


def test_batched_pairs_equal_one_by_one(tiny_pair):
    """``Encoder.pairs`` (batched, each distinct text once) gives lm-eval's ids, on a fake and a real BPE tokenizer."""
    from transformers import AutoTokenizer

    many = PAIRS + [("", " hello"), ("Roofing: A man is on a roof. He", " falls."), ("trailing space ", " x.")]
    for tok in (FakeTok(), AutoTokenizer.from_pretrained(tiny_pair["diff"])):
        enc = Encoder(tok)
        assert enc.pairs(many) == [enc.pair(c, x) for c, x in many]


def test_empty_context_uses_prefix_token():
    tok = FakeTok()
    ctx, cont = Encoder(tok).pair("", " hello")
    assert ctx == [1] and cont == tok.encode(" hello", add_special_tokens=False)


def test_requests_share_context_and_truncate_like_lmeval():
    tok = FakeTok()
    item = HellaSwagItem(0, "A", "one two three four", "five", ("six seven", "eight", "nine ten eleven", "x"), 1)
    (r,) = build_requests([item], tok, max_length=5)
    assert r.ctx[0] == 1  # BOS from the tokenizer's default special tokens
    for j, cont in enumerate(r.conts):
        assert r.inputs(j) == list(r.ctx + cont)[-6:][:-1]
    assert r.truncated and r.choice_chars == (9, 5, 15, 1)


def test_predictions_ties_and_norm():
    scores = np.array([[-1.0, -1.0, -3.0, -4.0], [-10.0, -9.0, -8.0, -8.0]])
    chars = [(1, 1, 1, 1), (10, 3, 4, 2)]
    pred, pred_norm = predictions(scores, chars)
    assert pred.tolist() == [0, 2]  # first maximum wins
    assert pred_norm.tolist() == [0, 0]  # -1.0 vs -3.0 vs -2.0 vs -4.0


def test_accuracy_stderr():
    c = np.array([1, 0, 1, 1, 0, 1, 1, 1])
    acc, se = mean_stderr(c)
    assert acc == 0.75 and se == pytest.approx(np.std(c, ddof=1) / np.sqrt(8))


def test_items_digest_is_the_committed_runs(hellaswag_cached):
    """HellaSwag items and task rows are one item type now (item.doc()); the digest that names their cells is still
    the one the committed runs recorded (docs/suite/pair-tiny: 500 seeded items per task, seed 0)."""
    import json
    from pathlib import Path

    from outlierscope.data.tasks import get_task
    from outlierscope.eval.evaluate import items_digest, select_items

    rec = json.loads((Path(__file__).resolve().parents[2] / "docs/suite/pair-tiny/sweep.json").read_text())
    s = rec["settings"]
    for task, info in rec["tasks"].items():
        if task != "hellaswag" and not get_task(task).cached:
            continue
        items = select_items(None, None, 0, None, task)
        if s["sample"] and s["sample"] < len(items):
            items = select_items(None, s["sample"], s["seed"], None, task)
        assert items_digest(items) == info["items_sha256"], task


def test_evaluate_takes_requests_of_its_items_only(hellaswag_cached):
    """evaluate(requests=...) scores what it would build itself (the same per-item scores, bytes), and refuses the
    requests of other items or of another max length with a one-line ParamError."""
    from outlierscope.errors import ParamError
    from outlierscope.eval.evaluate import evaluate, select_items
    from outlierscope.eval.requests import lmeval_max_length
    from outlierscope.models.loading import load_model

    lm = load_model("pair-tiny:diff")
    items = select_items(limit=6)
    n = lmeval_max_length(lm.model, lm.tokenizer)
    reqs = build_requests(items, lm.tokenizer, n)
    given = evaluate(lm, quant="logits=int4/per_tensor", items=items, requests=reqs, batch_size=4, progress=False)
    built = evaluate(lm, quant="logits=int4/per_tensor", items=items, batch_size=4, progress=False)
    assert given.items.to_csv() == built.items.to_csv()
    with pytest.raises(ParamError, match="requests must be build_requests of these 6 items"):
        evaluate(lm, items=items, requests=reqs[:5], progress=False)
    with pytest.raises(ParamError, match="requests must be build_requests of these 5 items"):
        evaluate(lm, items=items[1:], requests=reqs[:5], progress=False)
    with pytest.raises(ParamError, match=f"lm-eval max length {n}"):
        evaluate(lm, items=items, requests=build_requests(items, lm.tokenizer, 16), progress=False)


def test_requests_of_other_items_or_another_tokenizer_are_refused(hellaswag_cached):
    """Requests carry the digests of the items and the tokenizer they were built from: ARC-Easy items' requests
    (the same indexes 0..5) for HellaSwag items, an edited item's, another tokenizer's (same vocabulary size) or a
    plain list are refused in one line before any forward; the requests built from the items themselves pass."""
    import dataclasses

    from outlierscope.errors import ParamError
    from outlierscope.eval.evaluate import evaluate, select_items
    from outlierscope.eval.requests import lmeval_max_length
    from outlierscope.models.loading import load_model
    from outlierscope.train.tokenizer import train_bpe

    lm = load_model("pair-tiny:diff")
    items, arc = select_items(limit=6), select_items(limit=6, task="arc_easy")
    n = lmeval_max_length(lm.model, lm.tokenizer)
    assert [it.doc().index for it in arc] == [it.doc().index for it in items]  # indexes alone cannot tell them apart
    edited = [dataclasses.replace(items[0], endings=("a",) * 4), *items[1:]]
    other = train_bpe(["the history of the world is long and the river runs"] * 50, vocab_size=len(lm.tokenizer))
    cases = [(build_requests(arc, lm.tokenizer, n), "requests of other items"),
             (build_requests(edited, lm.tokenizer, n), "requests of other items"),
             (build_requests(items, other, n), "requests of another tokenizer"),
             (list(build_requests(items, lm.tokenizer, n)), "got 'a list of 6 requests'")]
    for reqs, says in cases:
        with pytest.raises(ParamError, match="requests must be build_requests of these 6 items") as e:
            evaluate(lm, items=items, requests=reqs, progress=False)
        assert says in str(e.value) and "\n" not in str(e.value)
    evaluate(lm, items=items, requests=build_requests(items, lm.tokenizer, n), progress=False)
