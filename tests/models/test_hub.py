"""Models by Hub id, proven against a stand-in Hub on 127.0.0.1 (tests/models/hub_server.py) with HF_ENDPOINT pointed
at it and HF_HUB_CACHE in a temporary directory: download by id, by id@tag and by id@commit, what a second load asks,
offline mode, sharded and pickle-only checkpoints, custom code, and every failure as one line."""

import contextlib
import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch

from outlierscope.cli import main
from outlierscope.errors import OutlierscopeError
from outlierscope.models import hub as hubmod
from outlierscope.models.loading import load_model
from outlierscope.models.presets import PairConfig
from outlierscope.train.tokenizer import train_bpe
from tests.models.hub_server import HubServer, Repo

SHA_MAIN = "a" * 40
SHA_TAG = "b" * 40


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The same tiny llama saved whole, sharded and as pickle; a config that needs custom code; a BERT."""
    import transformers as tf

    root = tmp_path_factory.mktemp("hubsrc")
    tok = train_bpe(["hello world, the history of the world is long."] * 50, vocab_size=512)
    model = PairConfig(name="hub-test", vocab_size=512, n_layers=2, hidden_size=32, n_heads=4, seq_len=512).build(
        "transformer", seed=0).eval()
    out = {}
    for name, kw in (("whole", {}), ("sharded", {"max_shard_size": "40KB"}), ("pickle", {})):
        out[name] = root / name
        model.save_pretrained(out[name], **kw)
        tok.save_pretrained(out[name])
    (out["pickle"] / "model.safetensors").unlink()  # pickle weights only, as older repositories have them
    torch.save(model.state_dict(), out["pickle"] / "pytorch_model.bin")
    out["custom"] = root / "custom"
    shutil.copytree(out["whole"], out["custom"])
    cfg = json.loads((out["custom"] / "config.json").read_text())
    cfg.update(model_type="my_custom_lm", auto_map={"AutoConfig": "configuration_my.MyConfig"})
    (out["custom"] / "config.json").write_text(json.dumps(cfg))
    out["bert"] = root / "bert"
    tf.BertForMaskedLM(tf.BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=32)).save_pretrained(out["bert"])
    tok.save_pretrained(out["bert"])
    return out, model


@contextlib.contextmanager
def serving(repos: dict, tmp_path, monkeypatch):
    """The stand-in Hub serving ``repos`` (``ORG/NAME`` -> :class:`Repo`), online, with a fresh cache and no saved
    login, while the block runs; then stopped and the process's resolutions forgotten."""
    server = HubServer(repos).start()
    try:
        set_hub(monkeypatch, server.url, tmp_path / "hf-cache", offline=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved login
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield server
    finally:
        server.stop()
        hubmod._resolve.cache_clear()


@pytest.fixture
def hub(dirs, tmp_path, monkeypatch):
    d, _ = dirs
    with serving({
        "org/tiny": Repo.from_dir(d["whole"], {"main": SHA_MAIN, "v1.0": SHA_TAG}),
        "org/sharded": Repo.from_dir(d["sharded"], {"main": SHA_MAIN}),
        "org/pickle": Repo.from_dir(d["pickle"], {"main": SHA_MAIN}),
        "org/custom": Repo.from_dir(d["custom"], {"main": SHA_MAIN}),
        "org/bert": Repo.from_dir(d["bert"], {"main": SHA_MAIN}),
        "org/gated": Repo.from_dir(d["whole"], {"main": SHA_MAIN}, gated=True),
    }, tmp_path, monkeypatch) as server:
        yield server


def set_hub(monkeypatch, endpoint, cache, offline: bool):
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1") if offline else monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)  # read by huggingface_hub at import
    hubmod._resolve.cache_clear()  # a new process would resolve again


def logits(model):
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_download_by_id_tag_and_commit(hub, dirs):
    _, ref = dirs
    lm = load_model("org/tiny", device="cpu")
    torch.testing.assert_close(logits(lm.model), logits(ref))
    assert lm.name == "org/tiny" and lm.source.kind == "hub"
    prov = lm.provenance()
    assert prov["given"] == "org/tiny" and prov["commit"] == SHA_MAIN and prov["revision"] is None
    assert len(prov["weights_sha256"]) == 64
    assert load_model("org/tiny@v1.0", device="cpu").source.detail["commit"] == SHA_TAG  # a tag-only revision
    assert load_model(f"org/tiny@{SHA_MAIN}", device="cpu").source.detail["commit"] == SHA_MAIN


def test_second_load_asks_only_what_it_must(hub, monkeypatch, tmp_path):
    """Within a process a spec resolves once; a new process asks nothing for a cached commit and one metadata request
    (no file) for a branch; offline it asks nothing at all."""
    load_model("org/tiny", device="cpu")
    n = len(hub.requests)
    assert any(m == "GET" and "/resolve/" in p for m, p in hub.requests)
    load_model("org/tiny", device="cpu")  # same process: the run's check, then its load
    assert len(hub.requests) == n
    hubmod._resolve.cache_clear()
    load_model(f"org/tiny@{SHA_MAIN}", device="cpu")
    assert len(hub.requests) == n  # a commit in the cache: no request
    hubmod._resolve.cache_clear()
    load_model("org/tiny", device="cpu")
    new = hub.requests[n:]
    assert new and all("/api/models/org/tiny/revision/" in p for _, p in new)  # which commit is main now: nothing else
    set_hub(monkeypatch, hub.url, tmp_path / "hf-cache", offline=True)
    before = len(hub.requests)
    assert load_model("org/tiny", device="cpu").source.detail["commit"] == SHA_MAIN
    assert len(hub.requests) == before  # offline: the cache only


def test_offline_without_the_model_is_one_line(hub, monkeypatch, tmp_path):
    set_hub(monkeypatch, hub.url, tmp_path / "empty-cache", offline=True)
    with pytest.raises(OutlierscopeError, match=r"org/tiny is not in the Hugging Face cache .* HF_HUB_OFFLINE is set"):
        load_model("org/tiny", device="cpu")
    assert hub.requests == []


@pytest.mark.parametrize("spec, msg", [
    ("org/nothing", r"model org/nothing not found on http://127.0.0.1:\d+ \(or it is private: log in"),
    ("org/tiny@v9", r"revision 'v9' of org/tiny not found on http://127.0.0.1:\d+; pass a branch, tag or commit"),
    ("org/gated", r"org/gated is gated: accept its licence on its page .* then log in here \(`hf auth login`"),
    ("org/custom", r"model_type 'my_custom_lm' needs the Python code shipped with the model .* --trust-remote-code"),
    ("org/bert", r"model_type 'bert' is not a causal language model"),
])
def test_hub_errors_are_one_line(hub, spec, msg, capsys, tmp_path):
    with pytest.raises(OutlierscopeError, match=msg) as e:
        load_model(spec, device="cpu")
    assert "\n" not in str(e.value)
    rc = main(["generate", spec, "Hello", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    # the download's progress bar may come first; then exactly one error line, no traceback
    assert rc == 2 and err.count("outlierscope: error: ") == 1 and "Traceback" not in err
    assert err.rstrip("\n").split("\n")[-1].split("\r")[-1].startswith("outlierscope: error: ")


def test_no_network_is_one_line(monkeypatch, tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    set_hub(monkeypatch, f"http://127.0.0.1:{port}", tmp_path / "c", offline=False)
    with pytest.raises(OutlierscopeError, match=rf"cannot reach http://127.0.0.1:{port} to download org/tiny .* set "
                                                r"HF_HUB_OFFLINE=1 to use the models already in the cache"):
        load_model("org/tiny", device="cpu")


def test_interrupted_download_resumes_and_is_never_loaded(hub, dirs):
    """A connection that drops mid-file: the client retries it and the weights are whole; one that keeps dropping
    fails in one line, leaves no weights in the snapshot (only an .incomplete blob), and the next call loads."""
    _, ref = dirs
    hub.cuts["model.safetensors"] = 1
    torch.testing.assert_close(logits(load_model("org/tiny", device="cpu").model), logits(ref))
    assert sum(m == "GET" and p.endswith("/model.safetensors") for m, p, _ in hub.ranged) == 2  # cut, then retried
    hubmod._resolve.cache_clear()
    shard = sorted(f for f in hub.repos["org/sharded"].files if f.startswith("model-"))[0]
    hub.cuts[shard] = 100  # half once, then nothing: the client gives up
    with pytest.raises(OutlierscopeError, match=r"downloading org/sharded from .* failed .* run the command again"):
        load_model("org/sharded", device="cpu")
    snap = hub_cache() / "models--org--sharded" / "snapshots"
    assert not list(snap.glob(f"*/{shard}"))  # never a half file in the snapshot
    hub.cuts.clear()
    lm = load_model("org/sharded", device="cpu")  # the next call finishes it
    torch.testing.assert_close(logits(lm.model), logits(ref))


def hub_cache():
    import os
    from pathlib import Path

    return Path(os.environ["HF_HUB_CACHE"])


def test_sharded_checkpoints_local_and_from_the_hub(hub, dirs):
    d, ref = dirs
    assert len(list(d["sharded"].glob("model-*.safetensors"))) > 1 and (d["sharded"] / "model.safetensors.index.json").exists()
    for spec in (str(d["sharded"]), "org/sharded"):
        lm = load_model(spec, device="cpu")
        torch.testing.assert_close(logits(lm.model), logits(ref))


def test_pickle_only_repository_loads_with_a_warning(hub, dirs):
    _, ref = dirs
    with pytest.warns(UserWarning, match="no safetensors weights: loading its \\*.bin files, which are pickle files"):
        lm = load_model("org/pickle", device="cpu")
    torch.testing.assert_close(logits(lm.model), logits(ref))
    with pytest.warns(UserWarning, match="only \\*.bin weights: pickle files"):
        load_model(str(dirs[0]["pickle"]), device="cpu")


def test_profile_record_names_the_model_and_its_commit(hub, tmp_path, tiny_corpus):
    out = tmp_path / "prof"
    assert main(["profile", "--model", "org/tiny@v1.0", "--text", str(tiny_corpus / "train.jsonl"), "--tokens", "512",
                 "--seq-len", "32", "--out", str(out)]) == 0
    facts = json.loads((out / "profile.json").read_text())["models"]["org/tiny"]
    assert facts["source"] == {"given": "org/tiny@v1.0", "kind": "hub", "repo_id": "org/tiny", "revision": "v1.0",
                               "commit": SHA_TAG}
    assert len(facts["weights_sha256"]) == 64


def test_lmeval_adapter_takes_a_hub_id(hub, dirs):
    pytest.importorskip("lm_eval")
    from outlierscope.lmeval.adapter import OutlierscopeLM

    lm = OutlierscopeLM("org/tiny@v1.0", bits=4, device="cpu", batch_size=1)
    torch.testing.assert_close(logits(lm.model), logits(dirs[1]))


def _readme_commands():
    """The command lines of the guide's "Your model" block: (env, argv)."""
    import re
    import shlex

    from tests.manual import manual

    block = manual().split("# Your model: Hub ids", 1)[1].split("```", 2)[1]
    out = []
    for line in block.strip().splitlines():
        words = shlex.split(line.split("#", 1)[0])
        env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
        argv = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
        assert argv[0] == "outlierscope", line
        out.append((env, argv[1:]))
    return out


def test_readme_your_model_commands_run(dirs, tmp_path, monkeypatch, hellaswag_cached, source_gguf):
    """Every line of README's "Your model" block, as written, on tiny models served under those Hub names (sizes made
    small: tokens, items, bits, context); each exits 0 and its record names the model as given."""
    d, _ = dirs
    names = {"Qwen/Qwen2.5-7B", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B"}
    server = HubServer({n: Repo.from_dir(d["whole"], {"main": SHA_MAIN}) for n in names}).start()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    try:
        for env, argv in _readme_commands():
            set_hub(monkeypatch, server.url, tmp_path / "hf-cache", offline=env.get("HF_HUB_OFFLINE") == "1")
            argv = [{"/path/to/model.Q4_K_M.gguf": str(source_gguf), "/path/to/hf-model": str(d["whole"])}.get(a, a)
                    for a in argv]
            argv = [str(tmp_path / a) if a.startswith("runs/") else a for a in argv]
            if "--seq-len" in argv:
                argv[argv.index("--seq-len") + 1] = "32"  # the tiny models' context
            if argv[0] == "profile":
                argv += ["--tokens", "256", "--seq-len", "32"] if "--seq-len" not in argv else ["--tokens", "256"]
            else:
                argv += ["--limit", "3"]
                if "--bits" in argv:
                    i = argv.index("--bits")
                    argv[i + 1 : i + 5] = ["16", "4"]
            before = len(server.requests)
            assert main(argv) == 0, argv
            if env.get("HF_HUB_OFFLINE") == "1":
                assert len(server.requests) == before  # offline: no request at all
            out = Path(argv[argv.index("--out") + 1])
            rec = json.loads((out / ("profile.json" if argv[0] == "profile" else "sweep.json")).read_text())
            given = argv[argv.index("--model") + 1]
            sources = [f["source"] for f in rec["models"].values()] if argv[0] == "profile" else list(rec["model_sources"].values())
            assert sources[0]["given"] == given
    finally:
        server.stop()


@pytest.fixture
def source_gguf(tmp_path, monkeypatch):
    """A small GGUF file (Q8_0 value weights) written with the gguf package; the conversion cache in tmp_path."""
    import gguf

    from outlierscope.data.hellaswag import hellaswag_path
    from tests.models.test_fetch import write_gguf

    data = hellaswag_path()
    cache = tmp_path / "os-cache"
    cache.mkdir()
    if data.exists():  # the conversion goes to a cache of this test's own; the data stay where they are
        (cache / data.name).symlink_to(data)
    monkeypatch.setenv("OUTLIERSCOPE_CACHE", str(cache))
    tok = train_bpe(["hello world, the history of the world is long."] * 50, vocab_size=512)
    cfg = PairConfig(name="gguf-readme", vocab_size=len(tok), n_layers=2, hidden_size=32, n_heads=4, seq_len=512)
    model = cfg.build("transformer", seed=0).eval()
    return write_gguf(tmp_path / "model.Q4_K_M.gguf", model, tok, {"attn_v": gguf.GGMLQuantizationType.Q8_0})


def _quick_start():
    """The home page's quick start: its command lines (argv) and its notebook snippet."""
    import shlex

    from tests.manual import commands_joined

    text = commands_joined((Path(__file__).resolve().parents[2] / "docs" / "index.md").read_text())
    section = text.split("## Quick start on your own model", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```")[1::2]
    commands = [shlex.split(line.split("#", 1)[0]) for b in blocks for line in b.splitlines()
                if line.startswith("outlierscope ")]
    snippet = next(b.removeprefix("python\n") for b in blocks if b.startswith("python"))
    return [c[1:] for c in commands], snippet


def test_the_quick_start_runs(dirs, tmp_path, monkeypatch, hellaswag_cached):
    """The home page's three steps as written, on a tiny model served under its Hub name (sizes made small: tokens,
    items, bits): the profile and the sweep exit 0, and the notebook snippet draws Figure 8 from the sweep's directory."""
    import matplotlib

    matplotlib.use("Agg")
    d, _ = dirs
    commands, snippet = _quick_start()
    assert [c[0] for c in commands] == ["profile", "sweep"]
    model = commands[0][commands[0].index("--model") + 1]
    server = HubServer({model: Repo.from_dir(d["whole"], {"main": SHA_MAIN})}).start()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.chdir(tmp_path)  # runs/... as written, under the test's directory
    try:
        set_hub(monkeypatch, server.url, tmp_path / "hf-cache", offline=False)
        for argv in commands:
            small = ["--tokens", "256", "--seq-len", "32"] if argv[0] == "profile" else ["--sample", "3"]
            if "--bits" in argv:
                i = argv.index("--bits")
                argv[i + 1: i + 5] = ["16", "4"]
            if "--sample" in argv:
                i = argv.index("--sample")
                del argv[i: i + 2]
            assert main([*argv, *small]) == 0, argv
        ns: dict = {}
        exec(snippet, ns)  # noqa: S102 - the page's own snippet, as a reader runs it
        fig = ns["plots"].figure8(ns["run"]["sweep"])
        assert isinstance(fig, matplotlib.figure.Figure) and fig.axes
    finally:
        server.stop()
