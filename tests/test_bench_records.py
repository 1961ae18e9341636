"""Every benchmark table in bench/README.md (and every proof's table in references/README.md) is generated from a
committed record with its full context."""

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
ROOT = BENCH.parent
RECORD_DIRS = (BENCH / "results", ROOT / "references" / "results")  # benchmarks; proofs against other libraries


def _tables():
    spec = importlib.util.spec_from_file_location("bench_tables", BENCH / "tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_tables_equal_the_records():
    tables = _tables()
    names = []
    pages = (BENCH / "README.md", ROOT / "references" / "README.md", ROOT / "docs" / "guide" / "cost.md",
             ROOT / "README.md")
    assert set(tables.PAGES) == set(pages)
    for readme in pages:
        text = readme.read_text()
        names += re.findall(r"<!-- bench:(\w+) -->", text)
        assert tables.rewrite(text) == text, f"{readme} differs from the records: run `python bench/tables.py`"
    # every table generated once, every generator used
    assert sorted(names) == sorted([*tables.TABLES, *tables.FUSED, *tables.COLUMNS, *tables.SUMMARY])


@pytest.mark.parametrize("stem", ["profile", "quant"])
def test_records_carry_their_context(stem):
    rec = json.loads((BENCH / "results" / f"{stem}.json").read_text())
    assert {"command", "date", "git", "machine", "versions", "raw", "derived"} <= set(rec)
    assert len(rec["git"]["commit"]) == 40 and rec["machine"]["cores"] and rec["versions"]["torch"]
    timings = [v for _, v in _timing_lists(rec["raw"])]  # nested per model in the profile record
    assert timings and all(len(v) >= 3 for v in timings)  # repeated: a median of >= 3


# -- every derived figure recomputed here from the raw repetitions (not by the bench scripts' own code) ---------

def _rec(stem):
    (path,) = [d / f"{stem}.json" for d in RECORD_DIRS if (d / f"{stem}.json").exists()]  # one record of that name
    return json.loads(path.read_text())


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _timing_lists(raw):
    """Every list of seconds in a record's raw part, however nested."""
    out = []
    for k, v in raw.items():
        if k == "seconds" and isinstance(v, dict):  # per setting: {name: [seconds, ...]}
            out += [(f"seconds/{name}", t) for name, t in v.items()]
        elif isinstance(v, dict):
            out += _timing_lists(v)
        elif isinstance(v, list) and (k.endswith("_s") or k == "seconds"):
            out.append((k, v))
    return out


RECORDS = sorted(p.stem for d in RECORD_DIRS for p in d.glob("*.json"))


@pytest.mark.parametrize("stem", RECORDS)
def test_every_timing_is_repeated_three_times(stem):
    for key, times in _timing_lists(_rec(stem).get("raw") or {}):
        assert len(times) >= 3, f"{stem}: {key} has {len(times)} repetition(s); the median of >= 3 is quoted"


def test_profile_record_recomputed():
    r = _rec("profile")
    for model, raw in r["raw"].items():
        d = {k.removeprefix(f"{model}_"): v for k, v in r["derived"].items() if k.startswith(f"{model}_")}
        tok = {k: raw["tokens"] / _median(raw[f"{k}_s"])
               for k in ("eager_forward", "sdpa_forward", "profile", "profile_uncompiled")}
        tok["every_point"] = raw["every_point_tokens"] / _median(raw["every_point_s"])
        for k, v in tok.items():
            assert abs(d[f"{k}_tok_s"] - v) <= 0.5, (model, k)
        for k, name in (("profile", "profile"), ("profile_uncompiled", "uncompiled"), ("every_point", "every_point")):
            assert abs(d[f"{name}_vs_eager"] - tok[k] / tok["eager_forward"]) <= 0.006, (model, k)
        if "peak_rss_mb_1m" in raw:
            assert abs(d["rss_growth_mb"] - (raw["peak_rss_mb_1m"] - raw["peak_rss_mb_100k"])) <= 1


def test_quant_record_recomputed():
    r = _rec("quant")
    raw, d = r["raw"], r["derived"]
    gb = 4 * np.prod(raw["logits_shape"]) / 1e9  # fp32 logits read once
    for k in ("copy", "fake_quant_per_tensor", "fake_quant_per_head", "fake_quant_per_row", "bitsandbytes_per_row"):
        assert abs(d[f"{k}_GBps"] - gb / _median(raw[f"{k}_s"])) <= 0.0051, k
    for k in ("forward_eager", "forward_sdpa", "forward_ours_unquantized", "forward_quant8_per_tensor"):
        assert abs(d[f"{k}_ms"] - 1000 * _median(raw[f"{k}_s"])) <= 0.051, k
    ratio = _median(raw["forward_quant8_per_tensor_s"]) / _median(raw["forward_eager_s"])
    assert abs(d["quant_vs_eager"] - ratio) <= 0.0051


def test_attention_memory_record_recomputed():
    r = _rec("attention_memory")
    runs, d = r["raw"]["runs"], r["derived"]
    shapes = sorted({k.split("/")[0] for k in runs})
    for shape in shapes:
        mb = {m.split("/")[1]: _median(v["peak_bytes"]) / 2**20 for m, v in runs.items() if m.startswith(shape + "/")}
        amb = {m.split("/")[1]: _median(v["attention_peak_bytes"]) / 2**20 for m, v in runs.items() if m.startswith(shape + "/")}
        sec = {m.split("/")[1]: _median(v["seconds"]) for m, v in runs.items() if m.startswith(shape + "/")}
        for m in mb:
            assert abs(d[f"{shape}_{m}_peak_mb"] - mb[m]) <= 0.051 and abs(d[f"{shape}_{m}_attention_mb"] - amb[m]) <= 0.051
            assert abs(d[f"{shape}_{m}_s"] - sec[m]) <= 0.00051, (shape, m)
        for q in ("ours", "quant8"):
            assert abs(d[f"{shape}_{q}_memory_ratio"] - amb[f"{q}_unblocked"] / amb[f"{q}_blocked"]) <= 0.06, (shape, q)
            assert abs(d[f"{shape}_{q}_forward_memory_ratio"] - mb[f"{q}_unblocked"] / mb[f"{q}_blocked"]) <= 0.06
            assert abs(d[f"{shape}_{q}_time_ratio"] - sec[f"{q}_blocked"] / sec[f"{q}_unblocked"]) <= 0.006


@pytest.mark.parametrize("stem", [s for s in RECORDS if s.startswith("eval_vs_lmeval_")])
def test_eval_vs_lmeval_record_recomputed(stem):
    r = _rec(stem)
    raw, d = r["raw"], r["derived"]
    t_lm, t_us = _median(raw["lmeval_process_s"]), _median(raw["ours_process_s"])
    assert abs(d["lmeval_items_per_s"] - raw["items"] / t_lm) <= 0.0051
    assert abs(d["ours_items_per_s"] - raw["items"] / t_us) <= 0.0051
    assert abs(d["speedup"] - t_lm / t_us) <= 0.0051
    if "flops" in raw:
        fl = {side: sum(raw["flops"][side][k] for k in ("trunk", "attention", "head")) for side in ("lmeval", "ours")}
        ratio = fl["lmeval"] / fl["ours"]
        assert abs(d["flop_ratio"] - ratio) <= 0.0051
        assert abs(d["speedup_over_flop_ratio"] - (t_lm / t_us) / ratio) <= 0.011


def test_parallel_record_recomputed():
    r = _rec("parallel_sweep_2")
    raw, d = r["raw"], r["derived"]
    one, many = _median(raw["one_process_s"]), _median(raw["processes_s"])
    assert abs(d["one_process_s"] - one) <= 0.051 and abs(d["processes_s"] - many) <= 0.051
    assert abs(d["speedup"] - one / many) <= 0.0051 and d["identical_files"] is True


@pytest.mark.parametrize("stem", [r for r in RECORDS if r.startswith("profile_points")])
def test_profile_points_record_recomputed(stem):
    """Every configuration a record holds; the 4,096-token record repeats each 3 times, the 0.4M-token one (runs of
    30-70 minutes each, bench/collect_rss.py) once."""
    r = _rec(stem)
    raw, d = r["raw"], r["derived"]
    keys = [k for k in ("two", "linear_qkv", "every", "every_4x") if f"{k}_peak_rss_mb" in raw]
    assert "two" in keys and ({"linear_qkv", "every"} & set(keys))
    for key in keys:
        rss = raw[f"{key}_peak_rss_mb"]
        assert len(rss) >= (3 if raw["tokens"] < 100_000 else 1) and d[f"{key}_peak_rss_mb"] == round(_median(rss)), key
    if "linear_qkv" in keys:
        assert d["rss_linear_qkv_vs_two"] == round(d["linear_qkv_peak_rss_mb"] / d["two_peak_rss_mb"], 2)
    if "every" in keys:
        assert d["rss_every_vs_two"] == round(d["every_peak_rss_mb"] / d["two_peak_rss_mb"], 2)
    if "every_4x" in keys:
        assert d["rss_growth_every_4x_tokens_mb"] == d["every_4x_peak_rss_mb"] - d["every_peak_rss_mb"]


def test_recipe_cost_record_recomputed():
    r = _rec("recipe_cost")
    sec, d = r["raw"]["seconds"], r["derived"]
    base = _median(sec["logits int4 per_tensor"])
    for name, t in sec.items():
        assert len(t) >= 3 and abs(d["median_s"][name] - _median(t)) <= 0.0051, name
        assert abs(d["ratio_vs_logits"][name] - _median(t) / base) <= 0.00051, name
    assert d["max_ratio"] == max(v for k, v in d["ratio_vs_logits"].items() if k != "logits int4 per_tensor")


def test_perplexity_cost_record_recomputed():
    r = _rec("perplexity_cost")
    raw, d = r["raw"], r["derived"]
    for k in (1, 4, 8):
        plain, kld = raw[f"k{k}_plain_s"], raw[f"k{k}_kld_s"]
        assert len(plain) >= 3 and len(kld) >= 3
        assert abs(d[f"k{k}_ratio"] - _median(kld) / _median(plain)) <= 0.00051, k
    assert d["peak_rss_mb"] == round(raw["peak_rss_mb"][0])
    assert d["peak_rss_262k_vocab_mb"] == round(raw["peak_rss_262k_vocab_mb"][0])


def test_records_hold_the_load_when_the_bench_began(tmp_path, monkeypatch):
    """The load average a record calls "at start" is read by ``begin()``, not when the module is imported (a bench
    importing bench/artifact.py after its work) nor when the record is written (the bench's own load)."""
    import os

    def no_load():
        raise AssertionError("load average read on import")

    monkeypatch.setattr(os, "getloadavg", no_load)
    spec = importlib.util.spec_from_file_location("artifact", BENCH / "artifact.py")
    artifact = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(artifact)  # no load average read here
    monkeypatch.setattr(os, "getloadavg", lambda: (1.234, 0.0, 0.0))
    start = artifact.begin()
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 0.0, 0.0))  # the bench's own load, by the time it writes
    monkeypatch.setattr(artifact, "RESULTS", tmp_path)
    path = artifact.write("trial", {"seconds": [1.0, 1.0, 1.0]}, {}, start=start)
    assert json.loads(path.read_text())["machine"]["load_average_1m_at_start"] == 1.23


@pytest.mark.parametrize("stem", [s for s in RECORDS if s.startswith("cost_")])
def test_cost_record_recomputed(stem):
    """bench/cost.py: every ratio from the raw repetitions, the goals it missed, the KLD, profile and layout ratios."""
    r = _rec(stem)
    sec, d = r["raw"]["seconds"], r["derived"]
    med = {k: _median(v) for k, v in sec.items()}
    for key, ratio in d["ratio"].items():
        kind = key.split(" ", 1)[0]
        assert abs(ratio - med[key] / med[f"{kind} unquantized sdpa"]) <= 0.0006, key
    assert sorted(d["over_goal"]) == sorted(k for k, g in d["goal"].items() if d["ratio"][k] > g)
    assert set(d["ratio"]) == {k for k in med if k.startswith(("text ", "hellaswag ")) and not k.endswith(", separate")}
    full = not r["raw"].get("kinds") or len(r["raw"]["kinds"]) == 2  # a --kinds text record has no HellaSwag cells
    if "kld w8a8" in med or full:
        assert abs(d["kld_vs_nll_cell"] - med["kld w8a8"] / med["text w8a8"]) <= 0.0006
    if "profile" in med or (full and "--only" not in r["command"]):  # the profile cell: text, every spec
        assert abs(d["profile_vs_sdpa_forward"] - med["forward sdpa"] / med["profile"]) <= 0.0006
    if full:
        assert abs(d["hellaswag_layout_factor"] - med["hellaswag unquantized sdpa, separate"]
                   / med["hellaswag unquantized sdpa"]) <= 0.0006


@pytest.mark.parametrize("stem", [s for s in RECORDS if s.startswith("prefix_cost_")])
def test_prefix_cost_record_recomputed(stem):
    r = _rec(stem)
    sec, d = r["raw"]["seconds"], r["derived"]
    assert abs(d["ratio_reused_vs_whole"] - _median(sec["reused"]) / _median(sec["whole"])) <= 0.0006
    n = r["raw"]["layers"]
    assert d["layers_run"] == {"reused": n + n * (n + 1) // 2, "whole": n * (n + 1)}  # base + layers i..n-1 per cell


@pytest.mark.parametrize("stem", [s for s in RECORDS if s.startswith("prefix_items_cost_")])
def test_prefix_items_cost_record_recomputed(stem):
    r = _rec(stem)
    sec, d = r["raw"]["seconds"], r["derived"]
    assert abs(d["ratio_reused_vs_one_by_one"] - _median(sec["reused"]) / _median(sec["one_by_one"])) <= 0.0006
    n = r["raw"]["layers"]
    batches, rest = divmod(d["layers_run"]["one_by_one"], n * (n - 1))  # the cells of layers 1..n-1, each whole
    assert batches >= 1 and not rest
    # per batch: the recording forward up to layer n - 2, then the cell of layer i from layer i
    assert d["layers_run"]["reused"] == batches * (n - 1 + n * (n - 1) // 2)


@pytest.mark.parametrize("stem", [s for s in RECORDS if s.startswith("make_reproduce")])
def test_make_reproduce_record_recomputed(stem):
    """The minutes from the raw seconds, each run's total from its stages, the sweep's stage at least its cells."""
    r = _rec(stem)
    d = r["derived"]
    assert d["make_reproduce_min"] == round(r["raw"]["make_seconds"] / 60, 1)
    stages = d["stages_s"]
    assert d["runs_min"] == round(sum(t["total_s"] for t in stages.values()) / 60, 1)
    for t in stages.values():
        assert abs(t["total_s"] - (t["profile_s"] + t["sweep_s"] + t["report_s"])) <= 0.2
    assert stages["pair"]["sweep_s"] >= sum(d["pair_sweep_cells_s"].values())
    assert r["raw"]["make_seconds"] >= sum(t["total_s"] for t in stages.values())


def test_guide_cost_table_equals_the_record():
    tables = _tables()
    text = (ROOT / "docs" / "guide" / "cost.md").read_text()
    assert set(re.findall(r"<!-- bench:(\w+) -->", text)) == set(tables.COLUMNS)
    assert tables.rewrite(text) == text, "docs/guide/cost.md's cost table differs from bench/results: run `python bench/tables.py`"
