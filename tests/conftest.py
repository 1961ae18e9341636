import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def hellaswag_cached():
    from outlierscope.data.hellaswag import hellaswag_path

    if not hellaswag_path().exists():
        pytest.skip("HellaSwag data not cached (make test fetches it)")
    return hellaswag_path()


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A small deterministic English-like corpus written by the test itself."""
    import random

    rng = random.Random(0)
    words = ("the a man woman dog cat runs walks house city river music plays large small old new "
             "history of war king queen science water light in on with and then because").split()
    d = tmp_path_factory.mktemp("corpus")
    import json

    with open(d / "train.jsonl", "w") as f:
        for _ in range(120):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(40, 120))) + "."
            f.write(json.dumps({"id": 1, "text": text.capitalize()}) + "\n")
    with open(d / "val.jsonl", "w") as f:
        for _ in range(20):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(80))}) + "\n")
    return d


HS_ITEMS = [
    {"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.", "is holding a rubik's cube.",
                 "starts pulling up roofing on a roof."], "label": "3"},
    {"activity_label": "Home and Garden", "ctx_a": "[header] How to clean a pan [title] Fill the pan with water.",
     "ctx_b": "", "endings": ["[step] Boil it  for ten minutes.", "Leave it.", "[title] Scrub it hard.", "Paint the pan."],
     "label": "0"},
    {"activity_label": "Running", "ctx_a": "A woman runs down a track.", "ctx_b": "then she",
     "endings": ["jumps over a hurdle.", "sits down.", "eats a sandwich slowly.", "flies away."], "label": 0},
] * 4


@pytest.fixture(scope="session")
def hs_jsonl(tmp_path_factory):
    import json

    p = tmp_path_factory.mktemp("hs") / "hellaswag_val.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in HS_ITEMS) + "\n")
    return p


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A matched Transformer / Diff pair with a 512-token context and a BPE tokenizer, saved as HF dirs."""
    import torch

    from outlierscope.models.presets import PairConfig
    from outlierscope.train.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("pair")
    cfg = PairConfig(name="evaltest", vocab_size=400, n_layers=2, hidden_size=32, n_heads=4, seq_len=512)
    texts = [" ".join([r["activity_label"], r["ctx_a"], r["ctx_b"], *r["endings"]]) for r in HS_ITEMS] * 5
    tok = train_bpe(texts, vocab_size=cfg.vocab_size)
    dirs = {}
    for role in ("transformer", "diff"):
        m = cfg.build(role, seed=0)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "proj" in n:
                    p.mul_(5)  # sharper attention than at init, so quantization has an effect
        d = root / role
        m.save_pretrained(d)
        tok.save_pretrained(d)
        dirs[role] = d
    return dirs


@pytest.fixture()
def bad_texts(tmp_path):
    """Three texts a run must refuse in one line: Latin-1 bytes, a directory named .txt, a file that is no parquet."""
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (tmp_path / "dir.txt").mkdir()
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really parquet")
    return tmp_path
