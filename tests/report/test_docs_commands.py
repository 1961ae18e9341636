"""The commands a study page says made its committed results are the ones that made them: each line of the page's
command block, parsed by the CLI's own parser, gives exactly the settings its directory's record holds, and every
record under the directory has its line."""

import json
import os
import re
import shlex
from dataclasses import asdict, fields
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _commands(folder: str, letter: str) -> list[list[str]]:
    """The README's command block for docs/``folder``/ as argument lists, with its ``letter`` (``Q``: the recipes,
    ``S``: the linear schemes; defined in the text above the block) expanded."""
    from tests.manual import manual

    after = manual().split(f"The committed results under `docs/{folder}/` were made by these commands", 1)[1]
    q = re.search(rf"\(`{letter}` = `(.*?)`;", after, re.S).group(1).replace("\n", " ")
    block = after.split("```")[1].split("\n", 1)[1]  # after the fence's language and attributes
    return [shlex.split(line.replace(f" {letter} ", f" {q} ").split("#")[0]) for line in block.strip().splitlines()]


def _at_defaults(cls, settings: dict, record: dict) -> dict:
    """``record`` with each setting added after the run (sensitivity's device_map, compare-quant's metric and text
    settings) at its default, as resume reads it."""
    defaults = {f.name: f.default for f in fields(cls)}
    return {**{k: json.loads(json.dumps(defaults[k])) for k in settings.keys() - record.keys()}, **record}


def _recorded_settings_made(argv: list[str]) -> Path:
    """Parse a sweep, sensitivity or profile command with the CLI's own parser, check that it gives exactly the
    settings its output directory's record holds, and return that directory."""
    from outlierscope.cli import build_parser
    from outlierscope.runs.profile import ProfileSettings
    from outlierscope.runs.sensitivity import SensitivitySettings
    from outlierscope.runs.sweep import SweepSettings
    from outlierscope.settings import from_cli

    classes = {"sweep": SweepSettings, "sensitivity": SensitivitySettings, "profile": ProfileSettings}
    assert argv[0] == "outlierscope", argv
    a = build_parser().parse_args(argv[1:])
    settings = json.loads(json.dumps(asdict(from_cli(classes[argv[1]], vars(a)))))  # as a record holds them
    record = json.loads((ROOT / a.out / f"{argv[1]}.json").read_text())["settings"]
    assert settings == _at_defaults(classes[argv[1]], settings, record), a.out
    return (ROOT / a.out).resolve()


def _recorded_dirs(folder: str, *names: str) -> set[Path]:
    """The directories under docs/``folder`` that hold a record of one of ``names``."""
    return {p.parent.resolve() for p in (ROOT / "docs" / folder).rglob("*.json") if p.name in names}


@pytest.mark.parametrize("folder,letter", [("recipes", "Q"), ("linear", "S"), ("weights", "W")])
def test_readme_commands_give_the_recorded_settings(folder, letter):
    made = {_recorded_settings_made(argv) for argv in _commands(folder, letter) if argv[1] != "report"}
    recorded = _recorded_dirs(folder, "sweep.json", "sensitivity.json")
    assert recorded and made == recorded


def test_readme_commands_made_docs_checkpoints():
    """docs/checkpoints/: each export, compare-quant and profile line of the README gives its record's settings (the
    profile: also its models), each llm-compressor line names the export and checkpoint its record holds, each
    GPT-QModel line the checkpoint, scheme and calibration its record holds, each packed_nll line is its record's
    command, and every record under the directory has its line."""
    from outlierscope.cli import build_parser
    from outlierscope.runs.compare import CompareSettings
    from outlierscope.runs.export import ExportSettings
    from outlierscope.runs.profile import ProfileSettings
    from outlierscope.settings import from_cli

    classes = {"export": (ExportSettings, "export.json"), "compare-quant": (CompareSettings, "compare.json"),
               "profile": (ProfileSettings, "profile.json")}
    made = set()
    for argv in _commands("checkpoints", "W"):
        if argv[0] == "rm":  # the profile's bulky per-channel and per-position tables (tens of MB)
            continue
        if argv[0].endswith("python") and argv[1] == "references/packed_nll.py":  # either venv: its record names its argv
            out = argv[argv.index("--out") + 1]
            assert json.loads((ROOT / out).read_text())["command"].split()[1:] == argv[2:], out
            made.add((ROOT / out).resolve())
            continue
        if argv[0].endswith("python") and argv[1] == "references/weight_grid.py":  # its record names its argv
            out = argv[argv.index("--out") + 1]
            record = json.loads((ROOT / out).read_text())
            assert record["command"].split()[1:] == [os.path.expanduser(x) for x in argv[2:]], out
            assert record["tensors"] and set(record["summary"]) >= {"mlp.down_proj", "self_attn.q_proj"}
            made.add((ROOT / out).resolve())
            continue
        if argv[0].endswith("python") and argv[1] == "references/gptq_oneshot.py":  # GPT-QModel's venv
            flags = [x for x in argv[2:] if x in ("--asym", "--desc-act")]
            a = dict(zip(*[iter([x for x in argv[2:] if x not in flags])] * 2))
            record = json.loads((ROOT / a["--record"]).read_text())
            assert (record["out"], record["method"], record["calibration"]["text"]) == (a["--out"], a["--method"],
                                                                                        a["--calib-text"])
            assert (record["quantize_config"]["bits"], record["quantize_config"]["group_size"]) == (
                int(a["--bits"]), int(a["--group"]))
            assert record["quantize_config"]["sym"] == ("--asym" not in flags)
            assert record["command"].split()[1:] == [os.path.expanduser(x) for x in argv[2:]]
            made.add((ROOT / a["--record"]).resolve())
            continue
        if argv[0].endswith("python"):
            a = dict(zip(argv[2::2], argv[3::2]))
            record = json.loads((ROOT / a["--export"] / "llmc_oneshot.json").read_text())
            assert (record["export"], record["out"]) == (a["--export"], a["--out"])
            assert record["parser_matches_export"] and record["checkpoint_matches_export"]
            made.add((ROOT / a["--export"] / "llmc_oneshot.json").resolve())
            continue
        assert argv[0] == "outlierscope", argv
        a = build_parser().parse_args(argv[1:])
        cls, name = classes[argv[1]]
        record = json.loads((ROOT / a.out / name).read_text())
        settings = json.loads(json.dumps(asdict(from_cli(cls, vars(a)))))
        assert settings == _at_defaults(cls, settings, record["settings"]), a.out
        if argv[1] == "profile":
            assert [m["spec"] for m in record["models"].values()] == a.model
        made.add((ROOT / a.out / name).resolve())
    recorded = {p.resolve() for p in (ROOT / "docs" / "checkpoints").rglob("*.json")
                if p.name in ("export.json", "compare.json", "profile.json", "llmc_oneshot.json", "gptq_oneshot.json")
                or p.parent.name == "packed_nll" or p.name.endswith("weight-grid.json")}
    assert recorded and made == recorded


def test_readme_commands_made_docs_perplexity():
    """docs/perplexity/: each perplexity line of the README gives its record's settings, each compare-perplexity and
    rank-agreement line names the directories its record compared; a references/ggml_snap.py line's record (committed beside
    the perplexity record of the model it wrote) names the line and the bytes that run read; every record under the
    directory has its line; every committed table re-renders from its csv (the markdown the command wrote)."""
    import pandas as pd

    from outlierscope.cli import build_parser
    from outlierscope.runs.perplexity import PerplexitySettings, perplexity_markdown
    from outlierscope.runs.perplexity_compare import agreement_markdown, compare_markdown
    from outlierscope.settings import from_cli

    made, snaps = set(), {}
    for argv in _commands("perplexity", "Q"):
        if argv[0].endswith("python"):  # references/ggml_snap.py: a model the next lines read as --model
            assert argv[1] == "references/ggml_snap.py", argv
            snaps[argv[argv.index("--out") + 1]] = argv[2:]
            continue
        assert argv[0] == "outlierscope", argv
        a = build_parser().parse_args(argv[1:])
        out = ROOT / a.out
        if argv[1] == "perplexity":
            record = json.loads((out / "perplexity.json").read_text())
            if a.model in snaps:  # the snapped model's record, committed beside: its command, the bytes the run read
                snap = json.loads((out / "ggml_snap.json").read_text())
                assert snap["command"].split()[1:] == snaps.pop(a.model), a.out
                assert list(snap["sha256"].values()) == [record["model_source"]["weights_sha256"]], a.out
            got = json.loads(json.dumps(asdict(from_cli(PerplexitySettings, vars(a)))))
            default = json.loads(json.dumps(asdict(PerplexitySettings(model=a.model))))
            got = {k: v for k, v in got.items() if k in record["settings"] or v != default[k]}  # fields added since
            assert got == record["settings"], a.out
            assert perplexity_markdown(pd.read_csv(out / "perplexity.csv")) == (out / "perplexity.md").read_text()
            made.add((out / "perplexity.json").resolve())
        elif argv[1] == "compare-perplexity":
            record = json.loads((out / "compare.json").read_text())
            assert (record["a"]["dir"], record["b"]["dir"], record["seed"]) == (a.a, a.b, a.seed)
            names = record["a"]["settings"]["model"], record["b"]["settings"]["model"]
            assert compare_markdown(pd.read_csv(out / "compare.csv"), *names) == (out / "compare.md").read_text()
            made.add((out / "compare.json").resolve())
        else:
            assert argv[1] == "rank-agreement", argv
            record = json.loads((out / "rank_agreement.json").read_text())
            assert (record["perplexity"], record["sweep"], record["seed"]) == (a.perplexity, a.sweep, a.seed)
            summary = {k: record[k] for k in ("spearman", "ci_low", "ci_high", "schemes", "windows", "items")}
            frame = pd.read_csv(out / "rank_agreement.csv")
            md = agreement_markdown(frame, summary, record["model"], record["task"])
            assert md == (out / "rank_agreement.md").read_text()
            made.add((out / "rank_agreement.json").resolve())
    recorded = {p.resolve() for p in (ROOT / "docs" / "perplexity").rglob("*.json")
                if p.name in ("perplexity.json", "compare.json", "rank_agreement.json")}
    assert recorded and made == recorded and not snaps


def test_smollm2_commands_give_the_recorded_settings():
    """docs/smollm2/: each profile and sweep line of its page gives exactly the settings its record holds (settings
    added after the run at their defaults), and every record under the directory has its line."""
    from tests.manual import commands_joined

    page = commands_joined((ROOT / "docs" / "smollm2" / "README.md").read_text())
    block = page.split("## The commands", 1)[1].split("```")[1].split("\n", 1)[1]
    lines = [shlex.split(line) for line in block.strip().splitlines()]
    made = {_recorded_settings_made(argv) for argv in lines if argv[1] != "report"}
    recorded = _recorded_dirs("smollm2", "sweep.json", "profile.json")
    assert recorded and made == recorded


@pytest.mark.parametrize("folder", ["sensitivity", "suite", "activations"])
def test_study_table_commands_give_the_recorded_settings(folder):
    """docs/sensitivity/, docs/suite/, docs/activations/: each row of the page's table names a directory and the
    command that made it (its output DIR or RUN); the command gives exactly the settings the directory's record holds
    (settings added after the run at their defaults), and every record under the folder has its row."""
    page = (ROOT / "docs" / folder / "README.md").read_text()
    made = set()
    for directory, cells in re.findall(r"^\| `([\w.-]+)/` \|(.*)$", page, re.M):
        command = re.search(r"`(outlierscope [^`]+)`", cells)
        assert command, f"{folder}/{directory}: its row names no command"
        out = f"docs/{folder}/{directory}"
        argv = [out if word in ("DIR", "RUN") else word for word in shlex.split(command.group(1))]
        assert _recorded_settings_made(argv) == (ROOT / out).resolve(), f"{folder}/{directory}: its command's --out"
        made.add((ROOT / out).resolve())
    recorded = _recorded_dirs(folder, "sweep.json", "profile.json", "sensitivity.json")
    assert recorded and made == recorded
