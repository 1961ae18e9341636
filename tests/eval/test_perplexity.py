"""Running-text protocols, per-token NLL / KL divergence and their statistics, against references written here from
their definitions: GPTQ's eval_ppl loop, llama-perplexity's chunking, lm-eval's own rolling-window functions, a
float64 computation from the full logits of the model's own forward, and hand-worked values."""

import math

import numpy as np
import pytest
import torch

from outlierscope.analysis import kld as K
from outlierscope.errors import OutlierscopeError
from outlierscope.eval.perplexity import TokenScores, score_noise, score_windows, token_values
from outlierscope.eval.windows import gptq_windows, llamacpp_windows, lmeval_windows
from outlierscope.models.float64 import float64_model
from outlierscope.quant.specs.spec import QuantSpec

DOCS = [" ".join(f"w{(i * 7 + j * 3) % 50}" for j in range(n)) for i, n in enumerate([3, 40, 0, 120, 17, 260, 9, 75])]


@pytest.fixture(scope="module")
def pair():
    """The pair's Diff model in float64 with its tokenizer, weights rounded to bfloat16 values (as checkpoints)."""
    from outlierscope.models.loading import load_model

    lm = load_model("pair-tiny:diff")
    model = lm.model.double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).double())
    return model, lm.tokenizer


class _BosTokenizer:
    """A tokenizer that puts a BOS first with its special tokens (as Llama's), around the pair's."""

    bos_token_id = 1

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, text, add_special_tokens=True):
        ids = self.inner(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


def test_gptq_windows_are_gptq_eval_ppl_slices(pair):
    """GPTQ's datautils and eval loop, written out: testenc = tokenizer("\\n\\n".join(texts)); nsamples =
    numel // seqlen; window i = testenc[i*seqlen:(i+1)*seqlen], scored on tokens 1..seqlen-1."""
    _, tok = pair
    testenc = tok("\n\n".join(DOCS), return_tensors="pt").input_ids[0]
    for seqlen in (16, 64, 100):
        windows = gptq_windows(tok, DOCS, seqlen)
        assert len(windows) == testenc.numel() // seqlen
        for i, w in enumerate(windows):
            batch = testenc[i * seqlen:(i + 1) * seqlen].tolist()
            assert list(w.input_ids) == batch and list(w.targets) == batch[1:] and w.first == 0


def test_llamacpp_windows_are_llama_perplexity_chunks(pair):
    """llama-perplexity: tokens = tokenize(text, add_bos); n_chunk = n / n_ctx; chunk i's first token becomes BOS;
    logits at positions n_ctx/2 .. n_ctx-2 score tokens n_ctx/2+1 .. n_ctx-1 (the original ones)."""
    tok = _BosTokenizer(pair[1])
    tokens = tok("\n\n".join(DOCS))["input_ids"]
    for n_ctx in (16, 32, 50):
        windows = llamacpp_windows(tok, DOCS, n_ctx)
        assert len(windows) == len(tokens) // n_ctx
        first = n_ctx // 2
        for i, w in enumerate(windows):
            chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
            assert list(w.input_ids) == [1] + chunk[1:] and w.first == first
            assert list(w.targets) == chunk[first + 1:] and len(w.targets) == n_ctx - 1 - first
    plain = llamacpp_windows(pair[1], DOCS, 16)  # a tokenizer without a BOS: the chunk as it is
    ids = pair[1]("\n\n".join(DOCS))["input_ids"]
    assert list(plain[1].input_ids) == ids[16:32]


def test_lmeval_windows_are_lm_evals_rolling_windows(pair):
    """lm-eval 0.4.13's own get_rolling_token_windows and make_disjoint_window, then _loglikelihood_tokens' input
    (context + continuation)[-(max_length + 1):][:-1]."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    _, tok = pair
    for max_len in (8, 33, 200):
        ours = lmeval_windows(tok, DOCS, max_len)
        ref = []
        for d, doc in enumerate(DOCS):
            toks = tok(doc, add_special_tokens=False)["input_ids"]
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(toks, tok.eos_token_id, max_len, 1)):
                ref.append(((ctx + cont)[-(max_len + 1):][:-1], cont, d))
        assert [(list(w.input_ids), list(w.targets), w.doc) for w in ours] == ref
        for d, doc in enumerate(DOCS):  # every token of every document scored once
            assert sum((list(w.targets) for w in ours if w.doc == d), []) == tok(doc, add_special_tokens=False)["input_ids"]


def test_every_target_is_the_token_after_its_position(pair):
    """Next-token prediction in every protocol: logits at position first + j score the token that follows it (the
    window's own next token; lmeval's last target is the one token its input leaves out)."""
    tok = _BosTokenizer(pair[1])
    for windows in (gptq_windows(tok, DOCS, 24), llamacpp_windows(tok, DOCS, 24), lmeval_windows(pair[1], DOCS, 24)):
        for w in windows:
            following = list(w.input_ids) + [w.targets[-1]]
            assert [following[w.first + j + 1] for j in range(len(w.targets))] == list(w.targets)


def test_gptq_nll_is_the_models_own_loss(pair):
    """GPTQ's eval_ppl, written out: per window the model's logits, shift_logits = logits[:, :-1], shift_labels =
    window[:, 1:], the mean cross entropy (here in float64; transformers' own loss would upcast to float32 only), and
    PPL = exp of its mean over windows; ours from the per-token values."""
    from outlierscope.quant.apply import quantize_model

    model, tok = pair
    windows = gptq_windows(tok, DOCS, 50)
    (ours,) = score_windows(model, windows, [QuantSpec()], batch_size=2)
    losses = []
    with torch.no_grad(), quantize_model(model, "none"), float64_model(model):
        for w in windows:
            batch = torch.tensor([w.input_ids])
            logits = model(input_ids=batch).logits
            losses.append(float(torch.nn.functional.cross_entropy(logits[0, :-1], batch[0, 1:])))
    assert math.isclose(math.exp(np.mean(losses)), math.exp(ours.nll.mean()), rel_tol=1e-12)
    per_window = [ours.nll[ours.window == i].mean() for i in range(len(windows))]
    np.testing.assert_allclose(per_window, losses, rtol=1e-12)


def test_kld_of_planted_distributions():
    """KL(p || q) of p = (1/2, 1/4, 1/4), q = (1/4, 1/2, 1/4): 1/2 ln 2 - 1/4 ln 2 = ln(2) / 4, by hand."""
    lb = torch.log(torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64)) + 3.0  # logits: any shift
    lq = torch.log(torch.tensor([[0.25, 0.5, 0.25]], dtype=torch.float64)) - 1.0
    v = token_values(lq, lb, torch.tensor([0]))
    assert math.isclose(float(v["kld"][0]), math.log(2) / 4, rel_tol=1e-14)
    assert math.isclose(float(v["nll"][0]), math.log(4), rel_tol=1e-14) and math.isclose(float(v["nll_base"][0]), math.log(2))
    assert not bool(v["same_top"][0]) and math.isclose(float(v["p_diff"][0]), 0.25 - 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_top_is_the_first_largest_float64_log_probability_with_ties(dtype):
    """The top token read from the narrow logits is the first largest float64 log-probability's (numpy's argmax,
    which takes the first maximum), on bfloat16-valued logits full of ties, and rows whose top is tied on purpose."""
    g = torch.Generator().manual_seed(0)
    lq = (torch.randn(300, 512, generator=g) * 2).to(dtype)  # (n, V)
    lb = (torch.randn(300, 512, generator=g) * 2).to(dtype)
    for r in range(0, 300, 7):  # planted ties at the quantized top: the later index must lose to the base's top
        i, j = sorted(torch.randperm(512, generator=g)[:2].tolist())
        lq[r, j] = lq[r, i] = lq[r].max() + 1
        lb[r, i] = lb[r].max() + 1
    v = token_values(lq, lb, torch.zeros(300, dtype=torch.long))

    def top(x):
        x = x.double().numpy()
        m = x.max(-1, keepdims=True)
        return np.argmax(x - m - np.log(np.exp(x - m).sum(-1, keepdims=True)), -1)

    want = top(lq) == top(lb)
    assert np.array_equal(v["same_top"].numpy(), want) and want[::7].all() and not want.all()


def _naive(model, windows, spec):
    """Per-token values from the model's own full forward (its logits), unquantized and quantized, in float64."""
    from outlierscope.quant.apply import quantize_model

    out = {k: [] for k in ("nll", "nll_base", "kld", "same_top", "p_diff")}
    for w in windows:
        ids = torch.tensor([w.input_ids])
        with torch.no_grad(), float64_model(model):  # float64 in every operation, as the scorer runs it
            with quantize_model(model, QuantSpec()):  # the same attention function, quantizing nothing
                base = model(input_ids=ids).logits[0].double()
            with quantize_model(model, spec):
                quant = model(input_ids=ids).logits[0].double()
        for j, t in enumerate(w.targets):
            p = torch.softmax(base[w.first + j], -1).numpy()
            q = torch.softmax(quant[w.first + j], -1).numpy()
            out["nll"].append(-math.log(q[t]))
            out["nll_base"].append(-math.log(p[t]))
            out["kld"].append(float(np.sum(p * (np.log(p) - np.log(q)))))
            out["same_top"].append(int(np.argmax(p)) == int(np.argmax(q)))
            out["p_diff"].append(q[t] - p[t])
    return {k: np.array(v) for k, v in out.items()}


@pytest.mark.parametrize("spec", [QuantSpec.logits(bits=4), QuantSpec.parse("w8a8; kivi-2bit"), QuantSpec()])
def test_values_equal_the_full_forward_in_float64(pair, spec):
    model, tok = pair
    windows = lmeval_windows(tok, DOCS, 48)[:9]  # several windows per document, of different lengths
    (ours,) = score_windows(model, windows, [spec], batch_size=4)
    ref = _naive(model, windows, spec)
    for k in ("nll", "nll_base", "kld", "p_diff"):
        np.testing.assert_allclose(getattr(ours, k), ref[k], rtol=1e-9, atol=1e-12, err_msg=k)
    assert np.array_equal(ours.same_top, ref["same_top"])
    assert np.array_equal(ours.window, np.repeat(np.arange(9), [len(w.targets) for w in windows]))
    if spec.is_identity:  # against itself: every value exactly 0 / the same top token
        assert not ours.kld.any() and ours.same_top.all() and np.array_equal(ours.nll, ours.nll_base)
    else:
        assert ours.kld.mean() > 1e-6


def _logits(model, spec, ids):
    from outlierscope.quant.apply import quantize_model

    with torch.no_grad(), quantize_model(model, spec), float64_model(model):
        return model(input_ids=ids).logits[0].double()


@pytest.mark.parametrize("spec", [QuantSpec.parse("w8a8"), QuantSpec.logits(bits=4)])
def test_noise_floor_is_the_kld_between_two_arithmetics_of_one_spec(pair, spec):
    """score_noise: the spec in float32 against the same spec in float64 as the base, equal to KL divergences
    computed here from both models' own full forwards; the same arithmetic against itself: 0 at every token."""
    import copy

    model64, tok = pair
    model32 = copy.deepcopy(model64).float()
    windows = lmeval_windows(tok, DOCS, 48)[:6]
    (noise,) = score_noise(model32, model64, windows, [spec], batch_size=1)
    kld, same = [], []
    for w in windows:
        ids = torch.tensor([w.input_ids])
        p = torch.softmax(_logits(model64, spec, ids), -1).numpy()
        q = torch.softmax(_logits(model32, spec, ids), -1).numpy()
        for j in range(len(w.targets)):
            pj, qj = p[w.first + j], q[w.first + j]
            kld.append(float(np.sum(pj * (np.log(pj) - np.log(qj)))))
            same.append(int(np.argmax(pj)) == int(np.argmax(qj)))
    # float32 logits reach the comparison through two routes (the trunk + head here, the full forward there)
    np.testing.assert_allclose(noise.kld, kld, rtol=1e-3, atol=1e-9)
    assert noise.kld.max() > 0 and noise.kld.mean() < 1e-3
    (self_noise,) = score_noise(model64, copy.deepcopy(model64), windows, [spec])
    assert not self_noise.kld.any() and self_noise.same_top.all()
    with pytest.raises(Exception, match="lm_head"):
        score_noise(model32, model64, windows, [QuantSpec.parse("w=fint8/per_channel; a=fint8/per_token; linears:*,lm_head")])


def test_pairs_of_sides_run_each_forward_once_and_equal_full_forwards(pair):
    """score_sides with a checkpoint's three kinds of pairs (float vs real, float vs emulation, real vs emulation),
    and an emulation that quantizes the LM head too against the real and the float model, on two float64 models: each pair's
    KL(a || b), NLLs and top tokens equal those computed here from the models' own full forwards, window by window;
    per batch the float model runs three times (unquantized, emulated, emulated with its head) and the "real" one
    once, counted by hooks (removed after). A base that quantizes the LM head is refused."""
    import copy

    from outlierscope.eval.perplexity import Side, score_sides

    flt, tok = pair
    real = copy.deepcopy(flt)
    with torch.no_grad():
        for p in real.parameters():  # another model of the same shape and tokenizer
            p.mul_(1 + 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    windows = lmeval_windows(tok, DOCS, 48)[:7]
    # symmetric int8 grids: on w8a8's full-range grids each token's largest value sits exactly on a rounding tie,
    # which the last bit of a float64 sum decides, and that bit depends on the batch's shape (windows padded together
    # here, alone in the full forwards)
    emu = QuantSpec.parse("a=int8/per_token; w=int8/per_channel")
    head = QuantSpec.parse("a=int8/per_token; w=int8/per_channel; linears:*,lm_head")
    kinds = {"f": ("float", "none"), "r": ("real", "none"), "e": ("float", str(emu)), "h": ("float", str(head))}
    order = (("f", "r"), ("f", "e"), ("r", "e"), ("r", "h"), ("f", "h"))
    pairs = [tuple(Side(m, QuantSpec.parse(q)) for m, q in (kinds[a], kinds[b])) for a, b in order]
    # a new object every time: equal sides are found by their key
    calls = {"float": 0, "real": 0}
    handles = [m.register_forward_pre_hook(lambda *_, k=k: calls.__setitem__(k, calls[k] + 1))
               for k, m in (("float", flt.model), ("real", real.model))]
    try:
        got = score_sides({"float": flt, "real": real}, windows, pairs, batch_size=3)
    finally:
        for h in handles:
            h.remove()
    assert calls == {"float": 3 * 3, "real": 3}  # 3 batches
    logits = [{"f": _logits(flt, QuantSpec(), ids), "r": _logits(real, QuantSpec(), ids), "e": _logits(flt, emu, ids),
               "h": _logits(flt, head, ids)} for ids in (torch.tensor([w.input_ids]) for w in windows)]
    assert not torch.equal(logits[0]["h"], logits[0]["e"])  # the head's quantization is seen
    for tokens, (a, b) in zip(got, order):
        kld, nll, nll_a, same = [], [], [], []
        for w, lg in zip(windows, logits):
            rows, t = slice(w.first, w.first + len(w.targets)), np.array(w.targets)
            la, lb = (torch.log_softmax(lg[x][rows], -1).numpy() for x in (a, b))
            kld += list((np.exp(la) * (la - lb)).sum(-1))
            nll += list(-lb[np.arange(len(t)), t])
            nll_a += list(-la[np.arange(len(t)), t])
            same += list(la.argmax(-1) == lb.argmax(-1))
        np.testing.assert_allclose(tokens.kld, kld, rtol=1e-9, atol=1e-13)
        np.testing.assert_allclose(tokens.nll, nll, rtol=1e-12)
        np.testing.assert_allclose(tokens.nll_base, nll_a, rtol=1e-12)
        assert list(tokens.same_top) == same and tokens.kld.min() > 0
    with pytest.raises(OutlierscopeError, match="cannot be the base"):
        score_sides({"float": flt}, windows, [(Side("float", head), Side("float", QuantSpec()))])


def test_batch_size_padding_and_shards_change_nothing_in_float64(pair):
    """Windows of different lengths alone (batch 1) and right-padded together (batch 5): the same values in
    float64; the virtual shards' parts concatenated: the whole, exactly."""
    model, tok = pair
    windows = lmeval_windows(tok, DOCS, 40)
    spec = QuantSpec.parse("k=int4/per_token; logits=int8/per_tensor")
    alone, = score_windows(model, windows, [spec], batch_size=1)
    batched, = score_windows(model, windows, [spec], batch_size=5)
    for k in ("nll", "nll_base", "kld", "p_diff"):
        np.testing.assert_allclose(getattr(batched, k), getattr(alone, k), rtol=1e-12, atol=1e-14, err_msg=k)
    parts = [score_windows(model, windows, [spec], batch_size=1, shards=[s])[0] for s in range(16)]
    whole = TokenScores.concat([p for p in parts if len(p)])
    for k in ("window", "same_top", "nll", "nll_base", "kld", "p_diff"):
        assert np.array_equal(getattr(whole, k), getattr(alone, k)), k
    assert sum(1 for p in parts if len(p)) > 1


@pytest.mark.parametrize("rows", [1, 7, 1000])
def test_float64_blocks_change_no_value(pair, monkeypatch, rows):
    """The float64 values are made F64_ROWS rows at a time: one row, 7 (blocks that end inside a head block) and more
    than a head block give every value bit for bit as the default."""
    import outlierscope.eval.perplexity as perplexity

    model, tok = pair
    windows = lmeval_windows(tok, DOCS, 48)[:6]
    specs = [QuantSpec.parse("w8a8"), QuantSpec.logits(bits=4)]
    default = score_windows(model, windows, specs, batch_size=3)
    monkeypatch.setattr(perplexity, "F64_ROWS", rows)
    for want, got in zip(default, score_windows(model, windows, specs, batch_size=3)):
        for k in ("window", "same_top", "nll", "nll_base", "kld", "p_diff"):
            assert np.array_equal(getattr(got, k), getattr(want, k)), k


def test_base_is_shared_by_every_spec(pair):
    """Two specs scored together: each equals the spec scored alone (the unquantized pass is shared, not mixed)."""
    model, tok = pair
    windows = gptq_windows(tok, DOCS, 32)[:4]
    a, b = QuantSpec.logits(bits=4), QuantSpec.parse("kivi-2bit")
    together = score_windows(model, windows, [a, b], batch_size=2)
    for spec, got in zip((a, b), together):
        (alone,) = score_windows(model, windows, [spec], batch_size=2)
        assert np.array_equal(got.kld, alone.kld) and np.array_equal(got.nll_base, alone.nll_base)


def _llamacpp_reference(nll, nll_base, kld, p_diff, same):
    """llama.cpp's kl_divergence() statistics, written out from perplexity.cpp (sums, then the formulas)."""
    n = len(nll)

    def mu(s, s2):
        f = s / n
        df = s2 / n - f * f
        return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)

    lp, lb = mu(nll.sum(), (nll ** 2).sum()), mu(nll_base.sum(), (nll_base ** 2).sum())
    cov = ((nll * nll_base).sum() / n - nll.sum() / n * nll_base.sum() / n) / (n - 1)
    mse = mu((p_diff ** 2).sum(), (p_diff ** 4).sum())
    v = sorted(kld)

    def pct(f):
        p = f * (n - 1)
        i = int(p)
        return (1 - (p - i)) * v[i] + (p - i) * v[min(i + 1, n - 1)]

    return {"ppl": math.exp(lp[0]), "ppl_unc": math.exp(lp[0]) * lp[1], "ln_ppl_ratio": lp[0] - lb[0],
            "ln_ppl_ratio_unc": math.sqrt(lp[1] ** 2 + lb[1] ** 2 - 2 * cov), "cor_ln_ppl": cov / (lp[1] * lb[1]),
            "kld_mean": kld.sum() / n, "kld_unc": mu(kld.sum(), (kld ** 2).sum())[1], "kld_max": v[-1],
            "kld_p99.9": pct(0.999), "kld_p90": pct(0.9), "kld_p1": pct(0.01), "kld_min": v[0],
            "kld_median": (v[n // 2] + v[n // 2 - 1]) / 2 if n % 2 == 0 else v[n // 2],
            "p_diff_rms": math.sqrt(mse[0]), "p_diff_rms_unc": 0.5 / math.sqrt(mse[0]) * mse[1],
            "same_top": same.mean(), "same_top_unc": math.sqrt(same.mean() * (1 - same.mean()) / (n - 1))}


@pytest.mark.parametrize("n", [11, 500, 1001])
def test_statistics_are_llama_cpps(n):
    rng = np.random.default_rng(n)
    nll_base = rng.gamma(2.0, 1.5, n)
    nll = nll_base + rng.normal(0.05, 0.2, n)
    kld = rng.exponential(0.02, n)
    p_diff = rng.normal(0, 0.03, n)
    same = rng.random(n) < 0.9
    tokens = TokenScores(np.repeat(np.arange(n // 10 + 1), 10)[:n], nll, nll_base, kld, same, p_diff)
    got = K.summary(tokens)
    for key, want in _llamacpp_reference(nll, nll_base, kld, p_diff, same).items():
        assert math.isclose(got[key], want, rel_tol=1e-12, abs_tol=1e-15), key


def test_block_intervals_resample_whole_windows():
    """Windows of one constant change each: every resample's mean lies within the windows' extremes, and the point
    value is the token-weighted mean (by hand: (3*1 + 1*5) / 4 = 2)."""
    tokens = TokenScores(np.array([0, 0, 0, 1]), np.array([2.0, 2.0, 2.0, 6.0]), np.array([1.0, 1.0, 1.0, 1.0]),
                         np.zeros(4), np.ones(4, bool), np.zeros(4))
    b = K.block_intervals(tokens, seed=3)
    assert b["delta_nll"] == 2.0 and 1.0 <= b["delta_nll_ci_low"] <= 2.0 <= b["delta_nll_ci_high"] <= 5.0
    assert b["windows"] == 2


def test_lmeval_protocol_equals_lm_eval_itself(pair):
    """lm-eval 0.4.13's own HFLM.loglikelihood_rolling on the same documents (its windows, its forward, its
    log-softmax) gives every document's log-likelihood ours gives, and its wikitext metrics (its count_words /
    count_bytes, weighted_perplexity, bits_per_byte aggregations) equal ours. Float64 model; lm-eval runs transformers'
    eager attention (a float32 softmax), hence the relative tolerance."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.metrics import bits_per_byte, weighted_perplexity
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.models.huggingface import HFLM

    from outlierscope.eval.perplexity import document_loglikelihoods, document_metrics

    model, tok = pair
    docs = DOCS + ["", "one  two\nthree"]
    hflm = HFLM(pretrained=model, tokenizer=tok, backend="causal", max_length=40, batch_size=4)
    reqs = [Instance("loglikelihood_rolling", {"page": d}, (d,), i) for i, d in enumerate(docs)]
    theirs = np.array(hflm.loglikelihood_rolling(reqs, disable_tqdm=True))
    windows = lmeval_windows(tok, docs, 40)
    (ours,) = score_windows(model, windows, [QuantSpec()], batch_size=3)
    np.testing.assert_allclose(document_loglikelihoods(ours, windows, len(docs)), theirs, rtol=1e-6, atol=1e-9)
    words = [(ll, ConfigurableTask.count_words(d)) for ll, d in zip(theirs, docs)]
    nbytes = [(ll, ConfigurableTask.count_bytes(d)) for ll, d in zip(theirs, docs)]
    got = document_metrics(ours, windows, docs)
    assert math.isclose(got["word_perplexity"], weighted_perplexity(words), rel_tol=1e-6)
    assert math.isclose(got["byte_perplexity"], weighted_perplexity(nbytes), rel_tol=1e-6)
    assert math.isclose(got["bits_per_byte"], bits_per_byte(nbytes), rel_tol=1e-6)


@pytest.mark.skipif(not __import__("outlierscope.models.fetch", fromlist=["is_fetched"]).is_fetched("smollm2-135m"),
                    reason="SmolLM2-135M is not fetched (make test fetches it)")
def test_lmeval_protocol_on_a_realistic_document_differs_by_lm_evals_float32_log_softmax():
    """SmolLM2 (float32, bfloat16-valued weights) on one 1,800-token LAMBADA document in two rolling windows of 1,024:
    lm-eval 0.4.13's ``loglikelihood_rolling`` is, bit for bit, a float32 log-softmax of the model's own logits summed
    in float32 per window (written out here); ours is the float64 log-softmax of the same logits (written out here,
    to 1e-12), which lm-eval's float32 arithmetic overstates: the README's "the more exact one". With
    ``logprobs="lmeval"`` ours is lm-eval's number to the last digit."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from outlierscope.data.running_text import load_text
    from outlierscope.eval.perplexity import document_loglikelihoods
    from outlierscope.models.loading import load_model

    lm = load_model("smollm2-135m")
    doc = ""
    for d in load_text("lambada").docs:
        doc += d + "\n\n"
        if len(lm.tokenizer(doc)["input_ids"]) > 1800:
            break
    hflm = HFLM(pretrained=lm.model, tokenizer=lm.tokenizer, backend="causal", max_length=1024, batch_size=1)
    (theirs,) = hflm.loglikelihood_rolling([Instance("loglikelihood_rolling", {"page": doc}, (doc,), 0)],
                                           disable_tqdm=True)
    windows = lmeval_windows(lm.tokenizer, [doc], 1024)
    assert len(windows) == 2
    (ours,) = score_windows(lm.model, windows, [QuantSpec()], batch_size=1)
    (mine,) = document_loglikelihoods(ours, windows, 1)
    f32, f64 = 0.0, 0.0
    for w in windows:
        with torch.no_grad():
            logits = lm.model(input_ids=torch.tensor([w.input_ids])).logits[0]  # (T, V) float32
        rows, t = torch.arange(w.first, w.first + len(w.targets)), torch.tensor(w.targets)
        f32 += float(torch.log_softmax(logits, -1)[rows, t].sum())  # lm-eval: float32 values, a float32 sum
        f64 += torch.log_softmax(logits.double(), -1)[rows, t].sum().item()
    assert theirs == f32  # lm-eval's number is exactly its float32 arithmetic
    assert mine == pytest.approx(f64, rel=1e-12, abs=0)
    n = len(ours)
    assert 0 < (theirs - mine) / n < 5e-5  # float32's log-softmax overstates each token's log-likelihood
    (as_lmeval,) = score_windows(lm.model, windows, [QuantSpec()], batch_size=1, logprobs="lmeval")
    assert document_loglikelihoods(as_lmeval, windows, 1, logprobs="lmeval")[0] == theirs  # lm-eval's digits
    assert np.array_equal(as_lmeval.kld, ours.kld)  # only the NLL is taken otherwise


def test_base_stays_on_the_logits_device():
    """The base's float64 buffer is made where the logits are (a GPU run's would otherwise be on the CPU, and every
    spec's values would fail to mix with it): checked on the meta device, which runs no arithmetic."""
    from outlierscope.eval.perplexity import _base

    logits = torch.empty(40, 11, device="meta")
    base = _base(logits, torch.zeros(40, dtype=torch.long, device="meta"))
    assert {k: v.device.type for k, v in base.items()} == dict.fromkeys(base, "meta")


def test_base_workspace_reused_across_blocks_of_any_size():
    """A run's workspace, reused block after block (a full block, a short one, then one longer than HEAD_ROWS that
    makes it grow, then a short one again over stale rows): each block's log-probabilities, probabilities, NLL and
    top token equal a float64 computation from the definitions, and the bytes of a fresh computation."""
    from outlierscope.eval.perplexity import _base
    from outlierscope.eval.scorer import HEAD_ROWS

    g = torch.Generator().manual_seed(3)
    workspaces: dict = {}
    for n in (HEAD_ROWS, 37, HEAD_ROWS + 45, 5):
        logits = (torch.randn(n, 77, generator=g) * 4).to(torch.bfloat16).float()  # ties among bf16 values
        targets = torch.randint(0, 77, (n,), generator=g)
        got, fresh = _base(logits, targets, workspaces), _base(logits, targets)
        x = logits.double()
        lb = x - (x - x.max(-1, keepdim=True).values).exp().sum(-1, keepdim=True).log() - x.max(-1, keepdim=True).values
        torch.testing.assert_close(got["lb"], lb, rtol=0, atol=1e-12)
        torch.testing.assert_close(got["pb"], lb.exp(), rtol=1e-12, atol=0)
        assert torch.equal(got["nll"], -got["lb"][torch.arange(n), targets])
        assert got["top"].tolist() == [row.index(max(row)) for row in logits.tolist()]  # the first largest
        assert all(torch.equal(got[k], fresh[k]) for k in fresh)
    assert len(workspaces) == 1


def _float32(pair):
    """The pair's bf16-valued model as a float32 copy (where ties of float32 arithmetic show), with its tokenizer."""
    model, tok = pair
    model32 = type(model)(model.config).float().eval()
    model32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return model32, tok


@pytest.mark.parametrize("budget", ["all", "one spec", 0])
def test_weights_held_from_batch_to_batch_change_no_value(pair, monkeypatch, budget):
    """A run keeps its specs' quantized weights from batch to batch within ``hold_bytes`` (first come, first held):
    every value bit for bit as quantizing them again at each batch (float32, bf16-valued weights), each held weight
    quantized once per run."""
    from outlierscope.quant.linears import schemes as L
    from outlierscope.quant.linears.sites import linear_sites

    model32, tok = _float32(pair)
    windows = gptq_windows(tok, DOCS, 32)[:6]
    specs = [QuantSpec.parse("w8a8"), QuantSpec.parse("w=nvfp4; a=nvfp4")]
    n = len(linear_sites(model32, specs[0]))
    per_spec = sum(s.module.weight.numel() * 4 for s in linear_sites(model32, specs[0]))
    calls = []
    compute = L._WeightTransform.compute
    monkeypatch.setattr(L._WeightTransform, "compute", lambda self, w: calls.append(1) or compute(self, w))
    fresh = score_windows(model32, windows, specs, batch_size=2, hold_bytes=0)
    assert len(calls) == 2 * n * 3  # 3 batches, each linear of each spec quantized at each
    calls.clear()
    hold = {"all": 10 * per_spec, "one spec": per_spec, 0: 0}[budget]
    got = score_windows(model32, windows, specs, batch_size=2, hold_bytes=hold)
    assert len(calls) == {"all": 2 * n, "one spec": n + n * 3, 0: 2 * n * 3}[budget]
    for want, have in zip(fresh, got, strict=True):
        for k in ("window", "same_top", "nll", "nll_base", "kld", "p_diff"):
            assert np.array_equal(getattr(have, k), getattr(want, k)), k


def test_cells_of_upper_layers_start_from_the_unquantized_prefix(pair, monkeypatch):
    """Specs that quantize only layers >= s start from the unquantized forward's output of layer s - 1 (layers below
    not run again): every value bit for bit as the whole forward (float32, bf16-valued weights, padded batches), and
    the layers run counted."""
    import outlierscope.eval.perplexity as perplexity
    from outlierscope.hooks.points import decoder_layers

    model32, tok = _float32(pair)
    windows = gptq_windows(tok, DOCS, 32)[:5]
    specs = [QuantSpec.parse(t) for t in ("w8a8; layers:1-3", "logits=int4/per_tensor; layers:2", "kivi-2bit; layers:3",
                                          "w8a8", "w=nvfp4; a=nvfp4; layers:0")]
    runs = []
    handles = [b.register_forward_pre_hook(lambda m, a, k=None: runs.append(1)) for b in decoder_layers(model32)]
    try:
        fast = score_windows(model32, windows, specs, batch_size=2)
        n_fast = len(runs)
        runs.clear()
        monkeypatch.setattr(perplexity, "prefix_start", lambda spec: 0)
        whole = score_windows(model32, windows, specs, batch_size=2)
    finally:
        for h in handles:
            h.remove()
    batches = 3
    assert len(runs) == batches * 4 * (1 + len(specs))  # every side runs every layer
    assert n_fast == batches * (4 + 3 + 2 + 1 + 4 + 4)  # base, then from layer 1, 2, 3, 0, 0
    for want, got in zip(whole, fast, strict=True):
        for k in ("window", "same_top", "nll", "nll_base", "kld", "p_diff"):
            assert np.array_equal(getattr(got, k), getattr(want, k)), k
    assert all(type(b).__name__ != "_Replay" for b in decoder_layers(model32))  # the layers are back
