import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def hellaswag_cached():
    from outlierscope.eval.data import hellaswag_path

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
