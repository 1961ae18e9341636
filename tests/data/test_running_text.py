"""Running text from a Hugging Face dataset by ORG/NAME:CONFIG:SPLIT, proven against the stand-in Hub on 127.0.0.1
(tests/models/hub_server.py, serving it under datasets/) as models by Hub id are: a fresh process with HF_ENDPOINT pointed at it downloads the
dataset through ``datasets`` (its README's configs, its parquet files), a second process offline (HF_HUB_OFFLINE=1)
reads the same documents from the cache without a request, and every failure is one line. The expected documents
are the rows written into the served parquet file here."""


import io
import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from outlierscope.data.running_text import load_text
from outlierscope.errors import OutlierscopeError
from tests.models.hub_server import HubServer, Repo

pytest.importorskip("datasets")

ROWS = ["", " = Valkyria Chronicles III = \n", "", " Senjō no Valkyria 3 : Unrecorded Chronicles . \n", "x"]
README = b"""---
configs:
- config_name: wikitext-2-raw-v1
  data_files:
  - split: test
    path: wikitext-2-raw-v1/test-*
  - split: validation
    path: wikitext-2-raw-v1/validation-*
---
"""
SHA = "c" * 40


def _parquet(rows) -> bytes:
    buf = io.BytesIO()
    pd.DataFrame({"text": rows}).to_parquet(buf)
    return buf.getvalue()


@pytest.fixture
def hub():
    files = {"README.md": README, "wikitext-2-raw-v1/test-00000-of-00001.parquet": _parquet(ROWS),
             "wikitext-2-raw-v1/validation-00000-of-00001.parquet": _parquet(["other"])}
    server = HubServer({"datasets/Salesforce/wikitext": Repo(files, {"main": SHA})})
    server.start()
    yield server
    server.stop()


def _load(source: str, env: dict, tmp_path) -> dict:
    """load_text in a fresh process (the environment is read at import, as a user's run reads it)."""
    code = ("import json, sys; from outlierscope.data.running_text import load_text\n"
            "from outlierscope.errors import OutlierscopeError\n"
            "try:\n t = load_text(sys.argv[1])\nexcept OutlierscopeError as e:\n print(json.dumps({'error': str(e)}))\n"
            "else:\n print(json.dumps({'docs': list(t.docs), 'record': t.record()}))")
    full = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_CACHE": str(tmp_path / "hub"),
            "HF_DATASETS_CACHE": str(tmp_path / "datasets"), **env}
    full.pop("HF_TOKEN", None)
    out = subprocess.run([sys.executable, "-c", code, source], env=full, capture_output=True, text=True, timeout=300,
                         cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_dataset_downloads_then_loads_offline_from_the_cache(hub, tmp_path):
    online = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"}
    got = _load("Salesforce/wikitext:wikitext-2-raw-v1:test", online, tmp_path)
    assert got.get("docs") == ROWS, got  # the split's rows in order, empty ones kept (GPTQ joins them as they come)
    rec = got["record"]
    assert rec["kind"] == "dataset" and rec["source"] == "Salesforce/wikitext:wikitext-2-raw-v1:test"
    assert rec["documents"] == len(ROWS) and rec["characters"] == sum(map(len, ROWS))
    assert any("/resolve/" in p and p.endswith(".parquet") for _, p in hub.requests)
    n = len(hub.requests)
    offline = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "1"}
    again = _load("Salesforce/wikitext:wikitext-2-raw-v1:test", offline, tmp_path)
    assert again == got and len(hub.requests) == n  # the cache alone, the same digest
    other = _load("Salesforce/wikitext:wikitext-2-raw-v1:validation", online, tmp_path)
    assert other["docs"] == ["other"] and other["record"]["sha256"] != rec["sha256"]


@pytest.mark.parametrize("source, env, msg", [
    ("Salesforce/wikitext:wikitext-2-raw-v1:train", {}, "dataset Salesforce/wikitext:wikitext-2-raw-v1:train: "),
    ("Salesforce/nothing:x:test", {}, "dataset Salesforce/nothing:x:test: "),
    ("Salesforce/wikitext:wikitext-2-raw-v1:test", {"HF_HUB_OFFLINE": "1"}, "only a dataset loaded before is found"),
])
def test_a_missing_split_dataset_or_cache_is_one_line(hub, tmp_path, source, env, msg):
    got = _load(source, {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", **env}, tmp_path)
    assert msg in got["error"] and "\n" not in got["error"]


@pytest.mark.parametrize("source, msg", [
    ("wikitext:wikitext-2-raw-v1:test", "ORG/NAME (huggingface_hub refuses"),
    ("a/b:c", "neither 'lambada', an existing file, nor a dataset ORG/NAME:CONFIG:SPLIT"),
    ("a/b::test", "a dataset is ORG/NAME:CONFIG:SPLIT"),
])
def test_a_malformed_dataset_name_fails_before_any_request(source, msg):
    with pytest.raises(OutlierscopeError, match=msg.replace("(", r"\(")):
        load_text(source)


@pytest.mark.parametrize("name, says", [("latin1.txt", "is not UTF-8 text"), ("dir.txt", "a directory, not a file"),
                                        ("broken.parquet", "cannot be read as parquet")])
def test_unreadable_running_text_is_one_line(bad_texts, name, says):
    from outlierscope.data.running_text import load_text

    with pytest.raises(OutlierscopeError, match=says) as e:
        load_text(str(bad_texts / name))
    assert "\n" not in str(e.value) and name in str(e.value)
