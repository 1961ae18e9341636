"""The lm-eval model adapter (outlierscope.lmeval): lm-eval's own `hf` model at 16 bits, our scorer below 16 bits,
generation through the quantized attention with a KV cache, lm-eval's command line. Needs the `lmeval` extra
(`make install` installs it)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-evaluation-harness not installed: pip install 'outlierscope[lmeval]'")

from outlierscope.data.hellaswag import hellaswag_path  # noqa: E402
from outlierscope.errors import OutlierscopeError  # noqa: E402
from outlierscope.lmeval.adapter import OutlierscopeLM, make_spec  # noqa: E402
from outlierscope.lmeval.tasks import write_task_yamls  # noqa: E402

PAIR_DIFF = "pair-tiny:diff"
needs_hellaswag = pytest.mark.skipif(not hellaswag_path().exists(), reason="HellaSwag not cached (make test fetches it)")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lmeval_tasks")
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(d / "hf"))
    return d


def _evaluate(model, tasks, task_dir, limit, **kw):
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, tasks=tasks, limit=limit, log_samples=True,
                                   task_manager=TaskManager(include_path=str(task_dir), include_defaults=False), **kw)


def _lls(res, task) -> np.ndarray:
    return np.array([[float(r[0]) for r in s["filtered_resps"]] for s in res["samples"][task]])  # (N, C)


@needs_hellaswag
def test_bits16_equals_lmeval_hf(task_dir, tiny_pair):
    """Unquantized, the adapter's per-sample log-likelihoods are lm-eval's `hf` model's on the same checkpoint."""
    tasks = write_task_yamls(task_dir, ["hellaswag"])
    ref = _evaluate("hf", tasks, task_dir, 12, model_args=f"pretrained={tiny_pair['diff']},dtype=float32", device="cpu",
                    batch_size=4)
    ours = _evaluate(OutlierscopeLM(str(tiny_pair["diff"]), bits=16, device="cpu", batch_size=4), tasks, task_dir, 12)
    assert np.abs(_lls(ref, tasks[0]) - _lls(ours, tasks[0])).max() < 1e-4
    for m in ("acc,none", "acc_norm,none"):
        assert ours["results"][tasks[0]][m] == ref["results"][tasks[0]][m]


@needs_hellaswag
@pytest.mark.parametrize("granularity", ["per_tensor", "per_head"])
def test_quantized_equals_our_scorer(task_dir, granularity):
    """4-bit logits: the adapter's log-likelihoods equal evaluate()'s item by item, whatever lm-eval's batch size
    (its zero padding must not enter a per_tensor/per_head scale). In float64: quantized float32 scores depend on
    the batch's shape and the processor's kernels (a last-bit difference can cross a rounding boundary)."""
    from outlierscope.eval.evaluate import evaluate
    from outlierscope.models.loading import load_model
    from outlierscope.quant.specs.spec import QuantSpec

    n = 12
    tasks = write_task_yamls(task_dir, ["hellaswag"])
    res = evaluate(load_model(PAIR_DIFF, device="cpu", dtype="float64"), quant=QuantSpec.logits(bits=4, granularity=granularity),
                   limit=n, batch_size=8, progress=False)
    mine = res.items[res.score_columns].to_numpy()
    for bs in (1, 5) if granularity == "per_tensor" else (5,):
        lm = OutlierscopeLM(PAIR_DIFF, bits=4, granularity=granularity, device="cpu", batch_size=bs, dtype="float64")
        theirs = _lls(_evaluate(lm, tasks, task_dir, n), tasks[0])
        assert np.abs(theirs - mine).max() < 1e-4, bs
        assert (theirs.argmax(1) == res.items["pred"].to_numpy()).all()
    unq = _lls(_evaluate(OutlierscopeLM(PAIR_DIFF, bits=16, device="cpu", batch_size=4), tasks, task_dir, n), tasks[0])
    assert np.abs(unq - mine).max() > 1e-3  # 4 bits really changed the scores


@needs_hellaswag
@pytest.mark.parametrize("recipe", ["kivi-2bit", "w8a8-sq", "llm-int8"])
def test_recipe_equals_our_scorer(task_dir, recipe):
    """quant=RECIPE in model_args: the adapter's log-likelihoods equal evaluate()'s with that recipe, item by item
    (a linear scheme too; w8a8-sq's calibration pass runs when the adapter loads the model). In float64: lm-eval
    batches other sequences together than evaluate() does, and quantized float32 scores depend on the batch's shape
    and the processor's kernels (an AMD EPYC moved one choice by 0.014 nats in float32)."""
    from outlierscope.eval.evaluate import evaluate
    from outlierscope.models.loading import load_model
    from outlierscope.quant.specs.spec import QuantSpec

    tasks = write_task_yamls(task_dir, ["hellaswag"])
    res = evaluate(load_model(PAIR_DIFF, device="cpu", dtype="float64"), quant=QuantSpec.parse(recipe), limit=8,
                   batch_size=8, progress=False)
    lm = OutlierscopeLM(PAIR_DIFF, quant=recipe, device="cpu", batch_size=3, dtype="float64")
    theirs = _lls(_evaluate(lm, tasks, task_dir, 8), tasks[0])
    assert np.abs(theirs - res.items[res.score_columns].to_numpy()).max() < 1e-4


def _generation_task(task_dir, name: str, prompts, until: str, max_tokens: int) -> None:
    """A local generate_until task ``{name}_local`` over ``prompts`` (greedy, stop at ``until``)."""
    (task_dir / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in prompts))
    (task_dir / f"{name}_local.yaml").write_text(
        f"task: {name}_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    validation: {task_dir / (name + '.jsonl')}\n"
        "validation_split: validation\noutput_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        f"generation_kwargs:\n  until: ['{until}']\n  max_gen_toks: {max_tokens}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def test_generation_runs_through_quantized_attention(task_dir, tmp_path):
    """A generation task under 4-bit attention: decoding steps (one query row against the key cache) pass the
    attention function, and the quantized continuation differs from the unquantized one."""
    from outlierscope.hooks.capture import capture

    _generation_task(task_dir, "gen", ("The history of", "In 1990 the", "A river is", "The city of"), "\\n", 8)
    shapes = []
    outs = {}
    for bits in (16, 2):
        lm = OutlierscopeLM(PAIR_DIFF, bits=bits, device="cpu", batch_size=2)
        rec = (lambda o: shapes.append(tuple(o.x.shape[-2:]))) if bits == 2 else (lambda o: None)
        with capture(lm.model, ["layers.0.attn.logits"], reducers=[rec]):
            res = _evaluate(lm, ["gen_local"], task_dir, None)
        outs[bits] = [s["filtered_resps"][0] for s in res["samples"]["gen_local"]]
        assert "exact_match,none" in res["results"]["gen_local"]
    assert any(t == 1 and s > 1 for t, s in shapes)  # decoding: one query row, a growing cache of keys
    assert outs[2] != outs[16]


def test_each_decode_step_is_quantized_with_its_own_scale(task_dir):
    """Every decoding step's single query row passes the quantizer: the adapter's inner observation (after the 4-bit
    per_tensor quantization) of each step equals a naive float64 absmax quantization, written here, of the same step's
    unquantized logits (seen by a capture entered outside the adapter), one stage call per step and layer."""
    from outlierscope.hooks.capture import capture

    _generation_task(task_dir, "gen2", ("The history of", "In 1990 the"), "NEVER", 6)
    before, after = [], []
    keep = lambda into: (lambda o: into.append((o.x.detach().double().clone(), o.valid.clone())))  # noqa: E731
    lm = OutlierscopeLM(PAIR_DIFF, bits=4, device="cpu", batch_size=1, points=["layers.2.attn.logits"],
                        reducers=[keep(after)])
    with capture(lm.model, ["layers.2.attn.logits"], reducers=[keep(before)]):
        _evaluate(lm, ["gen2_local"], task_dir, None)
    assert len(before) == len(after) and len(before) >= 2 * 6  # every forward: one observation on each side
    steps = [(x, q, v) for (x, v), (q, _) in zip(before, after) if x.shape[-2] == 1]
    assert len(steps) >= 2 * 5  # max_gen_toks=6: the prompt's forward, then one-row decoding steps
    for x, q, v in steps:
        v = v.expand_as(x)
        for b in range(x.shape[0]):
            amax = x[b][v[b]].abs().max()
            scale = amax / 7  # 2^(4-1) - 1
            want = torch.where(v[b], torch.round(x[b] / scale) * scale, x[b])  # round half to even, as torch.round
            torch.testing.assert_close(q[b][v[b]], want[v[b]], atol=1e-5 * float(amax), rtol=0)
            assert len(q[b][v[b]].abs().unique()) <= 8 < len(x[b][v[b]].abs().unique()) or x.shape[-1] < 8


def test_reducers_see_the_quantized_logits():
    """points/reducers: capture inside the quantization, so each sequence's valid logits of a layer take at most the
    2^(b-1)-1 magnitudes of a b-bit per_tensor grid (and zero)."""
    from lm_eval.api.instance import Instance

    seen = []

    def reducer(obs):
        for b in range(obs.x.shape[0]):
            v = obs.x[b][obs.valid[b].expand_as(obs.x[b])]
            seen.append((int(obs.valid[b].any(-1).sum()), len(v.abs().unique())))

    lm = OutlierscopeLM(PAIR_DIFF, bits=3, device="cpu", batch_size=3, points=["layers.1.attn.logits"], reducers=[reducer])
    reqs = [Instance("loglikelihood", {}, (c, e), 0) for c, e in
            (("The cat sat on", " the mat"), ("Hello", " world, how are you today"), ("A", " b"))]
    lm.loglikelihood(reqs)
    assert seen and all(n <= 2 ** 2 - 1 + 1 for _, n in seen)  # 3 magnitudes and zero
    with pytest.raises(OutlierscopeError, match="points and reducers go together"):
        OutlierscopeLM(PAIR_DIFF, device="cpu", reducers=[reducer])


@pytest.mark.parametrize("kw, msg", [
    ({"bits": 1}, "bits must be in 2..16"),
    ({"bits": 4, "granularity": "per_blob"}, "granularity"),
    ({"bits": 4, "layers": "0+9"}, "out of range"),
    ({"bits": 4, "layers": "x"}, "layers must look like"),
    ({"bits": "5x"}, r"bits must be an integer number of bits \(16 = unquantized\), got '5x'"),
    ({"attn_block": "many"}, "attn_block must be a positive number of query rows, got 'many'"),
    ({"attn_block": "0"}, "attn_block must be a positive number of query rows"),
    ({"dtype": "half"}, "dtype must be one of auto, float32, bfloat16, float16"),
    ({"layers": "7"}, "layers 7 out of range"),  # at 16 bits too: a typo is not ignored
    ({"granularity": "per_blob"}, "granularity must be one of"),
    ({"quant": "sage3"}, "did you mean sage1"),
    ({"quant": "sage1", "bits": 4}, "pass bits .* or quant"),
    ({"quant": "sage1", "granularity": "per_head"}, "granularity=per_head describe the logits' axis"),  # not ignored
    ({"quant": "w8a8", "format": "e4m3"}, "format=e4m3 describe the logits' axis"),
    ({"quant": ""}, "quant must be a recipe name"),  # quant= given empty is not "unquantized"
])
def test_bad_model_args(kw, msg):
    with pytest.raises(OutlierscopeError, match=msg):
        OutlierscopeLM(PAIR_DIFF, device="cpu", **kw)


def test_lmeval_default_device_runs_on_the_cpu():
    """lm-eval hands every model device cuda:0 unless told otherwise; without a GPU its hf model runs on the CPU,
    and so does ours (with a warning), instead of refusing."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: cuda:0 is then a real device")
    with pytest.warns(UserWarning, match="cuda:0 .* running on the CPU"):
        lm = OutlierscopeLM(PAIR_DIFF, device="cuda:0", bits=4)
    assert str(next(lm.model.parameters()).device) == "cpu"


@pytest.mark.parametrize("model_args, tasks, msg", [
    ("pretrained=/no/such/model,bits=4", "hellaswag", "model directory not found: /no/such/model"),  # not "cuda:0"
    ("pretrained=pair-tiny:diff,bits=5x", "hellaswag", "bits must be an integer number of bits"),
    ("pretrained=pair-tiny:diff,quant=", "hellaswag", "quant must be a recipe name"),  # not silently unquantized
    ("pretrained=pair-tiny:diff,quant=sage3", "hellaswag", "did you mean sage1"),
    ("pretrained=pair-tiny:diff,bits=4", "nosuchtask", "lm-eval: Tasks not found: nosuchtask"),
])
def test_command_line_errors_are_one_line(model_args, tasks, msg, tmp_path):
    """lm-eval's command line with no --device (it then says cuda:0) on this CPU machine: a bad model_args value or
    task name is one line and exit 1, no traceback; model_args are checked before lm-eval indexes its tasks."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "outlierscope.lmeval", "--model", "outlierscope", "--model_args", model_args,
                        "--tasks", tasks, "--limit", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("outlierscope: error: ") and msg in r.stderr


def test_a_spec_with_two_linears_survives_lmeval_model_args():
    """lm-eval splits model_args at commas: two linears patterns joined by '+' reach the adapter whole, parsed by
    lm-eval's own parser."""
    from lm_eval.utils import simple_parse_args_string

    from outlierscope.lmeval.adapter import model_args_spec

    args = simple_parse_args_string("pretrained=pair-tiny:diff,quant=w8a8; linears:self_attn.q_proj+mlp.down_proj,dtype=float32")
    spec, _ = model_args_spec(**{k: v for k, v in args.items() if k != "pretrained"})
    assert spec.linears == ("self_attn.q_proj", "mlp.down_proj")


def test_make_spec_from_strings():
    s = make_spec("6", "int", "per_head", "0+2-3")
    part = s.part("logits")
    assert (part.bits, part.granularity, s.layers) == (6, "per_head", (0, 2, 3))
    assert str(s) == "logits=int6/per_head; layers:0,2,3"
    assert make_spec(16).is_identity


@needs_hellaswag
def test_command_line(task_dir, tmp_path):
    """`python -m outlierscope.lmeval` is lm-eval's command line with the `outlierscope` model type."""
    tasks = write_task_yamls(task_dir, ["hellaswag"])
    out = tmp_path / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    r = subprocess.run([sys.executable, "-m", "outlierscope.lmeval", "--model", "outlierscope", "--model_args",
                        f"pretrained={PAIR_DIFF},bits=4,granularity=per_tensor", "--tasks", tasks[0], "--include_path",
                        str(task_dir), "--limit", "4", "--device", "cpu", "--batch_size", "4", "--output_path", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    assert "acc_norm,none" in results["results"][tasks[0]]
    assert results["config"]["model_args"]["bits"] == 4


NINE = ["arc_easy", "arc_challenge", "boolq", "openbookqa", "piqa", "winogrande", "sciq", "copa", "social_iqa"]


@pytest.mark.parametrize("name", NINE)
def test_task_yamls_build_our_requests(task_dir, name):
    """lm-eval 0.4.13 reading the YAML we write (its own task file, our cached rows) builds, row by row, the requests
    and gold index that `outlierscope tasks requests` gives (first 30 rows of each task)."""
    from lm_eval.tasks import TaskManager, get_task_dict

    from outlierscope.data.tasks import get_task, load_docs

    if not get_task(name).cached:
        pytest.skip(f"{name} not cached (make test fetches it)")
    (local,) = write_task_yamls(task_dir / name, [name])
    task = get_task_dict([local], TaskManager(include_path=str(task_dir / name), include_defaults=False))[local]
    task.build_all_requests(limit=30, rank=0, world_size=1)
    docs = list(task.eval_docs)[:30]
    reqs = {}
    for inst in task.instances:
        reqs.setdefault(inst.doc_id, []).append((inst.idx, list(inst.arguments)))
    theirs = []
    for i, doc in enumerate(docs):
        gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
        if isinstance(gold, str):
            gold = task.doc_to_choice(doc).index(gold)
        theirs.append({"doc_id": i, "requests": [a for _, a in sorted(reqs[i])], "gold": int(gold)})
    ours = [d.json() for d in load_docs(name, 30)]
    assert ours == theirs


def test_attn_block_and_device_map_give_the_same_scores():
    """attn_block (several blocks of query rows, two passes for the per_tensor scale) and device_map='auto' (all on the
    CPU here) give the log-likelihoods of the plain adapter."""
    from lm_eval.api.instance import Instance

    reqs = [Instance("loglikelihood", {}, (c, e), 0) for c, e in
            (("The cat sat on the mat and then it", " ran away very fast"), ("Hello", " world, how are you today"))]
    ref = [ll for ll, _ in OutlierscopeLM(PAIR_DIFF, bits=4, device="cpu", batch_size=2).loglikelihood(reqs)]
    blocked = OutlierscopeLM(PAIR_DIFF, bits=4, device="cpu", batch_size=2, attn_block=3)
    assert blocked.attn_block == 3
    np.testing.assert_allclose([ll for ll, _ in blocked.loglikelihood(reqs)], ref, atol=1e-4, rtol=0)
    mapped = OutlierscopeLM(PAIR_DIFF, bits=4, device_map="auto", batch_size=2)
    assert {str(p.device) for p in mapped.model.parameters()} == {"cpu"}
    np.testing.assert_allclose([ll for ll, _ in mapped.loglikelihood(reqs)], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bits", [16, 4])
def test_loglikelihood_rolling_equals_a_naive_forward(bits):
    """Rolling log-likelihood of a text within the context: lm-eval's windows start with the end-of-text token; the
    reference here is one plain forward of [eot] + tokens, summed log-probabilities (quantized for 4 bits)."""
    from lm_eval.api.instance import Instance

    from outlierscope.quant.apply import quantize_model
    from outlierscope.quant.specs.spec import QuantSpec

    text = "The history of the river is long, and the city grew along its banks over many centuries."
    lm = OutlierscopeLM(PAIR_DIFF, bits=bits, device="cpu", batch_size=1)
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    toks = lm.tokenizer(text).input_ids
    ids = torch.tensor([[lm.tokenizer.eos_token_id, *toks]])  # (1, T + 1)
    with torch.no_grad(), quantize_model(lm.model, QuantSpec.logits(bits=bits)):
        lp = torch.log_softmax(lm.model(input_ids=ids).logits[0, :-1].double(), -1)  # (T, V)
    want = float(lp[torch.arange(len(toks)), torch.tensor(toks)].sum())
    assert got == pytest.approx(want, abs=1e-3)
