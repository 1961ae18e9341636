"""Data parallelism: 1 process, 2 gloo processes under torchrun, and 2 shards merged give byte-identical
files; merges of the reducers equal the single stream; a failing rank fails the run without a partial cell."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from outlierscope.analysis.reducers import LogBins, Moments, TopK
from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.parallel import VIRTUAL_SHARDS, Shard, World, local_processes, owned_shards

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
SWEEP = ["sweep", "--model", "pair-tiny:diff", "--bits", "16", "4", "--quant", "w8a8-sq", "--limit", "40", "--batch-size",
         "8", "--attn-error"]  # w8a8-sq: a calibration pass in every process, the linear error per virtual shard
SENS = ["sensitivity", "--model", "pair-tiny:diff", "--limit", "6", "--batch-size", "4", "--profile-tokens", "256"]
PROFILE = ["profile", "--model", "pair-tiny:diff", "--tokens", "20000", "--batch-size", "4"]


def _launch(args, procs: int = 1) -> list[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"] if procs > 1 \
        else [sys.executable]
    return [*launch, "-m", "outlierscope", *args]


def _cli(args, procs: int = 1):
    r = subprocess.run(_launch(args, procs), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _together(*runs):
    """Independent one-process runs side by side (one thread each, one per core): the fixture's wall time, not its
    arithmetic, which does not depend on what else runs."""
    procs = [subprocess.Popen(_launch(args), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for args in runs]
    for args, p in zip(runs, procs):
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"{args}: {err[-3000:]}"


def _csvs(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*.csv"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hellaswag_cached):
    root = tmp_path_factory.mktemp("parallel")
    out = {k: str(root / k) for k in ("sweep-1", "sweep-2", "sweep-shards", "sweep-apart-0", "sweep-apart-1",
                                      "sweep-apart", "sweep-torchrun-shards", "profile-1", "profile-2",
                                      "profile-shards", "sens-1", "sens-2", "sens-3", "sens-shards")}
    # one process; shards into one directory and merged; shards written apart and merged into a third directory
    _together([*SWEEP, "--out", out["sweep-1"]], [*PROFILE, "--out", out["profile-1"]])
    for i in range(2):
        _together([*SWEEP, "--out", out["sweep-shards"], "--shard", f"{i}/2"],
                  [*SWEEP, "--out", out[f"sweep-apart-{i}"], "--shard", f"{i}/2"])
    _together(*([*PROFILE, "--out", out["profile-shards"], "--shard", f"{i}/2"] for i in range(2)))
    _together(["merge", out["sweep-shards"]], ["merge", out["profile-shards"]])
    _together(["merge", out["sweep-apart-0"], out["sweep-apart-1"], "--out", out["sweep-apart"]],
              [*SENS, "--out", out["sens-1"]])
    # torchrun: 2 processes, and 2 processes inside each --shard
    _cli([*SWEEP, "--out", out["sweep-2"]], procs=2)
    _cli([*PROFILE, "--out", out["profile-2"]], procs=2)
    for i in range(2):
        _cli([*SWEEP, "--out", out["sweep-torchrun-shards"], "--shard", f"{i}/2"], procs=2)
    _cli(["merge", out["sweep-torchrun-shards"]])
    # sensitivity: 2 and 3 processes; 2 shards, merged, then the greedy in one process
    for procs in (2, 3):
        _cli([*SENS, "--out", out[f"sens-{procs}"]], procs=procs)
    _together(*([*SENS, "--out", out["sens-shards"], "--shard", f"{i}/2"] for i in range(2)))
    _cli(["merge", out["sens-shards"]])
    _cli([*SENS, "--out", out["sens-shards"]])
    return root


@pytest.mark.parametrize("kind", ["sweep", "profile"])
def test_two_processes_and_merged_shards_equal_one_process(runs, kind):
    one = _csvs(runs / f"{kind}-1")
    assert one and (("sweep.csv" in one and "attn_error.csv" in one and "linear_error.csv" in one
                     and len([k for k in one if k.startswith("cells/") and k.count(".") == 1]) == 3) if kind == "sweep"
                    else {"table5.csv", "per_layer.csv", "per_head.csv", "topk_hidden.csv"} <= set(one))
    for other in ("2", "shards", *(("apart", "torchrun-shards") if kind == "sweep" else ())):
        got = {k: v for k, v in _csvs(runs / f"{kind}-{other}").items() if ".shard-" not in k}
        assert got.keys() == one.keys(), other
        for name in one:
            assert got[name] == one[name], f"{kind}-{other}/{name} differs from the single process's"


@pytest.mark.parametrize("other", ["sens-2", "sens-3", "sens-shards"])
def test_sensitivity_on_processes_and_shards_equals_one_process(runs, other):
    """Every data file of a sensitivity study (per-layer table, greedy tries, attention error, each cell and its
    attention-error table) byte-identical for 1, 2 and 3 processes and for 2 shards merged (then the greedy in one)."""
    one = _csvs(runs / "sens-1")
    assert {"sensitivity.csv", "greedy.csv", "attn_error.csv"} <= set(one) and sum(k.startswith("cells/") for k in one) >= 9
    got = {k: v for k, v in _csvs(runs / other).items() if ".shard-" not in k}
    assert got.keys() == one.keys()
    for name in one:
        assert got[name] == one[name], f"{other}/{name} differs from the single process's"
    import json

    if other == "sens-shards":
        assert json.loads((runs / other / "sensitivity.shard-1-of-2.json").read_text())["shard"] == [1, 2]
    else:
        assert json.loads((runs / other / "sensitivity.json").read_text())["processes"] == int(other[-1])


def test_sensitivity_resumes_an_interrupted_study(runs, tmp_path):
    """A study stopped before its last cells (two removed, and its tables): the rerun computes only those and writes
    the same bytes."""
    import shutil

    d = tmp_path / "s"
    shutil.copytree(runs / "sens-1", d)
    cells = sorted((d / "cells").glob("*_b4_*.json"))[:2]
    for c in cells:
        for f in d.glob(f"cells/{c.stem}.*"):
            f.unlink()
    for f in ("sensitivity.csv", "greedy.csv", "sensitivity.json"):
        (d / f).unlink()
    r = _cli([*SENS, "--out", str(d)])
    assert r.stdout.count("done earlier") + r.stderr.count("done earlier") >= 7
    assert _csvs(d) == _csvs(runs / "sens-1")


def test_records_say_how_it_ran(runs):
    import json

    assert json.loads((runs / "sweep-2" / "sweep.json").read_text())["processes"] == 2
    assert json.loads((runs / "sweep-1" / "sweep.json").read_text())["processes"] == 1
    assert json.loads((runs / "sweep-shards" / "sweep.json").read_text())["merged_shards"] == 2
    rec = json.loads((runs / "sweep-shards" / "sweep.shard-1-of-2.json").read_text())
    assert rec["shard"] == [1, 2]
    facts = json.loads((runs / "profile-2" / "profile.json").read_text())["models"]
    assert next(iter(facts.values()))["processes"] == 2


def test_merge_needs_every_shard(tmp_path, hellaswag_cached):
    _cli(["sweep", "--model", "pair-tiny:diff", "--limit", "8", "--bits", "16", "--out", str(tmp_path), "--shard", "0/2"])
    r = subprocess.run([sys.executable, "-m", "outlierscope", "merge", str(tmp_path)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "shard(s) 1/2 missing" in r.stderr
    assert not (tmp_path / "sweep.csv").exists()


def test_merge_damaged_profile_shard_is_one_line(runs, tmp_path):
    """A truncated profile shard file: one line naming it, no traceback, no table written."""
    import shutil

    d = tmp_path / "p"
    shutil.copytree(runs / "profile-shards", d)
    for f in d.glob("*.csv"):
        f.unlink()
    f = d / "profile.shard-1-of-2.pt"
    f.write_bytes(f.read_bytes()[:1000])
    r = subprocess.run([sys.executable, "-m", "outlierscope", "merge", str(d)], cwd=ROOT, env=ENV, capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert "profile.shard-1-of-2.pt: its content does not match its digest" in r.stderr  # checked before unpickling
    assert "run that shard again" in r.stderr
    assert not (d / "table5.csv").exists()


def test_merge_truncated_sweep_shard_cell_writes_nothing(runs, tmp_path):
    """A shard's cell csv cut short (its second cell): named as incomplete with what to do (it said "different
    evaluations"), and no merged cell is written, not even the first, whose parts are whole."""
    import shutil

    d = tmp_path / "s"
    shutil.copytree(runs / "sweep-shards", d)
    for f in [*d.glob("*.csv"), *d.glob("sweep.json")]:
        f.unlink()
    for f in (d / "cells").glob("*.*"):
        if ".shard-" not in f.name:
            f.unlink()
    second = sorted((d / "cells").glob("*_b4_*.shard-1-of-2.csv"))[0]
    second.write_text("\n".join(second.read_text().splitlines()[:5]) + "\n")
    r = subprocess.run([sys.executable, "-m", "outlierscope", "merge", str(d)], cwd=ROOT, env=ENV, capture_output=True,
                       text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert "part 1/2 of cell" in r.stderr and "does not match the digest its record holds" in r.stderr
    assert second.name in r.stderr and "rerun that shard" in r.stderr
    assert not [f for f in (d / "cells").iterdir() if ".shard-" not in f.name] and not (d / "sweep.csv").exists()


@pytest.mark.parametrize("text, msg", [("2/2", "0 <= i < N"), ("1/40", "N in 1..16"), ("a/b", "i/N, e.g. 0/4")])
def test_bad_shard(text, msg):
    with pytest.raises(ParamError, match=msg):
        Shard.parse(text)


def test_world_device_is_the_local_gpu(monkeypatch):
    """Several processes with cuda/auto: each takes cuda:LOCAL_RANK (device count mocked); an explicit device or the
    CPU stays as asked; a single process keeps 'cuda'; more processes than GPUs on a node is one line."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    w = World(rank=11, size=16, local_rank=3)
    assert w.device("cuda") == "cuda:3" and w.device("auto") == "cuda:3"
    assert w.device("cpu") == "cpu" and w.device("cuda:5") == "cuda:5"
    assert World().device("cuda") == "cuda" and World().device("auto") == "auto"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(OutlierscopeError, match="LOCAL_RANK 3 but this node has 2 GPU"):
        w.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert w.device("auto") == "auto"  # no GPU: load_model resolves auto to the CPU


def test_local_processes_one_per_core_or_gpu(monkeypatch):
    """make reproduce's NPROC: the cores this process may use (2 of a 40-core machine's affinity: 2), or the GPUs
    where there are GPUs (8 on a 96-core node: 8), never more than the 16 virtual shards (40 free cores: 16)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5, 9}, raising=False)
    assert local_processes() == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(40)), raising=False)
    assert local_processes() == 16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(96)), raising=False)
    assert local_processes() == 8


def test_owned_shards_partition():
    for n in (1, 2, 3):
        for p in (1, 2, 5):
            if n * p > VIRTUAL_SHARDS:
                continue
            got = sorted(v for i in range(n) for r in range(p) for v in owned_shards(Shard(i, n), World(r, p)))
            assert got == list(range(VIRTUAL_SHARDS))
    with pytest.raises(OutlierscopeError, match="exceed the 16 virtual shards"):
        owned_shards(Shard(0, 4), World(0, 8))


# -- merges of the reducers: a stream split anywhere, merged in order, equals the single stream -------------

@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 400), min_size=0, max_size=4), st.integers(0, 2**31 - 1))
def test_stream_split_and_merged(cuts, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(400, 6, generator=g, dtype=torch.float64) * 3 + 5).round(decimals=2)  # ties in |x| too
    bounds = [0, *sorted(cuts), 400]
    parts = [x[a:b] for a, b in zip(bounds, bounds[1:])]
    bins = LogBins()

    def stream(chunks):
        top, hist, mom = TopK(20, 2), torch.zeros(bins.n + 2, dtype=torch.int64), Moments((1, 6))
        for off, c in chunks:
            if len(c) == 0:
                continue
            top.update_dense(c.abs(), torch.ones_like(c, dtype=torch.bool),
                             lambda m, off=off: torch.stack([m[:, 0] + off, m[:, 1]], 1))
            hist += torch.bincount(bins.index(c.abs()).view(-1), minlength=bins.n + 2)
            mom.update(c, torch.ones_like(c, dtype=torch.bool), (0,), 0)
        return top, hist, mom

    offsets = bounds[:-1]
    whole = stream(zip([0], [x]))
    merged = None
    for off, c in zip(offsets, parts):
        s = stream([(off, c)])
        if merged is None:
            merged = s
        else:
            merged[0].merge(s[0])
            merged = (merged[0], merged[1] + s[1], merged[2])
            merged[2].merge(s[2])
    assert torch.equal(whole[0].values, merged[0].values) and torch.equal(whole[0].locs, merged[0].locs)
    assert torch.equal(whole[1], merged[1])
    a, b = whole[2].summary(), merged[2].summary()
    for k in ("mean", "std", "kurtosis"):
        np.testing.assert_allclose(a[k], b[k], rtol=1e-12, atol=1e-12)
    assert torch.equal(whole[2].count, merged[2].count) and torch.equal(whole[2].maxabs, merged[2].maxabs)


# -- a rank that fails ---------------------------------------------------------------------------------------

def _failing_rank(rank: int, size: int, port: int, out: str, q) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    import torch.distributed as dist

    from outlierscope.runs.sweep import SweepSettings, sweep

    world = World.from_env()
    if rank == 1:  # this rank's model is broken: its forward raises
        import outlierscope.eval.evaluate as ev

        def broken(*a, **k):
            raise OutlierscopeError("forward failed")
        ev.score_requests = broken
    try:
        sweep(SweepSettings(models=("pair-tiny:diff",), bits=(16,), limit=8), out, progress=False, log=lambda *a: None,
              world=world)
        q.put((rank, "ok"))
    except Exception as e:  # noqa: BLE001 (reported to the parent)
        q.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_failing_rank_fails_the_run_and_writes_no_cell(tmp_path, hellaswag_cached):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_failing_rank, args=(r, 2, port, str(tmp_path / "out"), q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    results = {}
    while not q.empty():
        r, msg = q.get()
        results[r] = msg
    assert results.get(1) == "OutlierscopeError: rank 1: forward failed"
    assert results.get(0) == "OutlierscopeError: rank 1: forward failed"  # rank 0 fails too, at once
    cells = list((tmp_path / "out" / "cells").glob("*")) if (tmp_path / "out" / "cells").exists() else []
    assert cells == [] and not (tmp_path / "out" / "sweep.csv").exists()


def test_a_bad_flag_under_torchrun_is_said_once():
    """Every rank parses the same arguments and fails alike (exit 2); rank 0 alone prints the error (torchrun then
    reports the failed processes in its own words, our line as their root cause: the error file it reads)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    for args, msg in ((["sweep", "--model", "pair-tiny:diff", "--bits", "16", "--batch-size", "0", "--out", "x"],
                       "outlierscope: error: --batch-size must be >= 1"),
                      (["sweep", "--model", "pair-tiny:diff", "--bogus", "--out", "x"],
                       "error: unrecognized arguments: --bogus")):
        r = subprocess.run([*launch, "-m", "outlierscope", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=300)
        printed = [line for line in r.stderr.splitlines() if msg in line and "traceback :" not in line]
        assert r.returncode != 0 and len(printed) == 1, r.stderr[-3000:]
        if msg.startswith("outlierscope: error:"):  # ours (not argparse's): torchrun's report names it as root cause
            assert f"traceback : {msg}" in r.stderr, r.stderr[-3000:]


def test_text_metric_sensitivity_on_two_processes_equals_one(tmp_path):
    """sensitivity --metric kld under torchrun (2 gloo processes: each its virtual shards of every text cell, rank 0
    assembles, every rank takes the greedy's same next step): the per-layer table, the greedy tries and every text
    cell's per-token values as one process's, in float64."""
    import json

    from outlierscope.eval.perplexity import TokenScores

    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"Passage {i}: " + "the cat saw the dog " * (3 + i % 4)}) + "\n"
                            for i in range(40)))
    cmd = ["sensitivity", "--model", "pair-tiny:diff", "--metric", "kld", "--text", str(text), "--length", "32",
           "--max-windows", "10", "--text-batch-size", "2", "--dtype", "float64", "--profile-tokens", "256"]
    for procs in (1, 2):
        _cli([*cmd, "--out", str(tmp_path / f"p{procs}")], procs=procs)
    one, two = _csvs(tmp_path / "p1"), _csvs(tmp_path / "p2")
    assert {"sensitivity.csv", "greedy.csv"} <= set(one) and one == two
    recs = [json.loads((tmp_path / d / "sensitivity.json").read_text()) for d in ("p1", "p2")]
    assert recs[0]["cells"] == recs[1]["cells"] and recs[1]["processes"] == 2 and len(recs[0]["cells"]) >= 8
    for cid in recs[0]["cells"].values():
        a, b = (TokenScores.load(tmp_path / d / "cells" / f"{cid}.npz") for d in ("p1", "p2"))
        for k in ("window", "nll", "nll_base", "kld", "same_top", "p_diff"):
            assert np.array_equal(getattr(a, k), getattr(b, k)), (cid, k)


def test_reproduce_on_two_processes_equals_one(tmp_path):
    """reproduce under torchrun (as `make reproduce` runs it: processes of one thread): the profile's and the sweep's
    tables and cells byte-identical to one process's; rank 0 alone writes the report and the record, which counts
    the processes."""
    import json

    cmd = ["reproduce", "--model", "pair-tiny:diff", "--bits", "16", "4", "--limit", "24", "--tokens", "4096",
           "--seq-len", "64", "--batch-size", "8"]
    outs = {procs: tmp_path / f"p{procs}" for procs in (1, 2)}
    printed = {procs: _cli([*cmd, "--out", str(out)], procs=procs).stdout for procs, out in outs.items()}
    one, two = _csvs(outs[1]), _csvs(outs[2])
    assert {"profile/table5.csv", "sweep/sweep.csv"} <= set(one) and sum(k.startswith("sweep/cells/") for k in one) == 2
    assert one == two
    assert printed[2].count("report: ") == 1 and (outs[2] / "report.md").exists()
    for procs, out in outs.items():  # each stage split over the processes, not run whole by each
        rec = {name: json.loads((out / name).read_text()) for name in ("reproduce.json", "sweep/sweep.json",
                                                                       "profile/profile.json")}
        assert rec["reproduce.json"]["processes"] == rec["sweep/sweep.json"]["processes"] == procs
        assert rec["profile/profile.json"]["models"]["pair-tiny:diff"]["processes"] == procs


@pytest.mark.parametrize("nproc", ["0", "-1", "two", "", "01"])
def test_make_reproduce_checks_nproc_first(nproc):
    """`make reproduce NPROC=...` with no whole number >= 1: one line naming it, exit 2, before any install or run;
    a good one reaches torchrun's --nproc-per-node (a dry run)."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # as a user runs it: not inside another make (`make test` sets MAKELEVEL, which adds directory lines)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")}
    r = subprocess.run(["make", "reproduce", f"NPROC={nproc}"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=env)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and f"NPROC must be a whole number of processes >= 1, got '{nproc}'" in r.stderr
    dry = subprocess.run(["make", "-n", "reproduce", "NPROC=3"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=env)
    assert dry.returncode == 0 and "--nproc-per-node 3 -m outlierscope reproduce" in dry.stdout
