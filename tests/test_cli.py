import subprocess
import sys

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
