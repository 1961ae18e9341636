"""The tables of bench/README.md and references/README.md, generated from the records in bench/results and
references/results (never typed by hand).

    python bench/tables.py            # rewrite the tables in both READMEs (and docs/guide/cost.md's) between their markers
    python bench/tables.py --check    # exit 1 if the README differs from what the records say (run by the tests)

A table sits between ``<!-- bench:NAME -->`` and ``<!-- /bench -->``; NAME is a key of TABLES.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
COST_PAGE = HERE.parent / "docs" / "guide" / "cost.md"  # the guide's compact cost table
RESULTS = HERE / "results"
REFERENCES = HERE.parent / "references" / "README.md"  # the proofs against other libraries (no timing)
RECORD_DIRS = (RESULTS, HERE.parent / "references" / "results")
TOP_README = HERE.parent / "README.md"  # the project's README: one summary table
PAGES = (README, REFERENCES, COST_PAGE, TOP_README)  # every file that holds generated tables


def _lmeval_rows(choices: str) -> list:
    """The rows every bench/eval_vs_lmeval.py table shares: agreement with lm-eval and batch sizes."""
    return [
        ("acc: outlierscope / lm-eval", ("acc_ours", "acc_lmeval"), "{:.6f} / {:.6f}"),
        ("acc_norm: outlierscope / lm-eval", ("acc_norm_ours", "acc_norm_lmeval"), "{:.6f} / {:.6f}"),
        ("items with the same `pred` / `pred_norm` as lm-eval's scores", ("same_pred", "same_pred_norm"), "{:.2%} / {:.2%}"),
        ("items with the same acc / acc_norm outcome as lm-eval's own flags", ("same_acc_flags", "same_acc_norm_flags"),
         "{:.2%} / {:.2%}"),
        (f"max \\|score difference\\| over all {choices} choices, nats", "max_abs_score_diff", "{:.2g}"),
        ("batch size, outlierscope / lm-eval", ("our_batch_size", "lmeval_batch_size"), "{} / {}"),
    ]


def _attention_memory_rows() -> list:
    """bench/attention_memory.py's rows, on the CPU and on a GPU (the same modes, shapes and goals)."""
    return [
        (f"{label}: {what}", tuple(f"{shape}_{m}_{unit}" for m in modes), fmt)
        for shape, label in (("smollm2-135m", "SmolLM2-135M shape"), ("llama3-8b-2l", "Llama-3-8B layers"))
        for what, modes, unit, fmt in (
            ("attention modules' peak MB: eager / ours one block / ours blocks of 128 rows",
             ("eager", "ours_unblocked", "ours_blocked"), "attention_mb", "{} / {} / {}"),
            ("whole forward's peak MB: eager / ours one block / ours blocks",
             ("eager", "ours_unblocked", "ours_blocked"), "peak_mb", "{} / {} / {}"),
            ("forward s: eager / ours one block / ours blocks", ("eager", "ours_unblocked", "ours_blocked"), "s",
             "{} / {} / {}"),
            ("8-bit per_tensor, attention peak MB: one block / blocks (two passes)",
             ("quant8_unblocked", "quant8_blocked"), "attention_mb", "{} / {}"),
            ("8-bit per_tensor, forward s: one block / blocks", ("quant8_unblocked", "quant8_blocked"), "s", "{} / {}"),
            ("attention memory down, unquantized / 8-bit (goal >= 8x)", ("ours", "quant8"), "memory_ratio",
             "**{}x** / **{}x**"),
            ("time blocks / one block, unquantized / 8-bit (goal <= 1.15x)", ("ours", "quant8"), "time_ratio",
             "**{}x** / **{}x**"),
        )
    ]


def _perplexity_cost_rows(marginal: bool = True) -> list:
    """bench/perplexity_cost.py's rows (the same for a record of another model: perplexity_cost_MODEL; ``marginal``:
    the record has the k = 4 -> 8 ratio, which records older than it lack)."""
    return [
        ("model, windows x tokens scored", ("model", "windows", "tokens"), "{}, {} windows, {} tokens"),
        *((f"k = {k} schemes: s per repetition, plain NLL / KLD run", (f"k{k}_plain_s", f"k{k}_kld_s"), "{} / {}")
          for k in (1, 4, 8)),
        ("KLD run / plain NLL at k = 1 / 4 / 8 (goal <= 1.15x at k = 8)", ("k1_ratio", "k4_ratio", "k8_ratio"),
         "{}x / {}x / **{}x**"),
        *([("the 4 schemes from k = 4 to 8, the base already paid: KLD / plain", "k4_to_k8_ratio", "{}x")]
          if marginal else []),
        ("peak RSS MB of a KLD run: the model's vocabulary / 262,144", ("peak_rss_mb", "peak_rss_262k_vocab_mb"),
         "{} / {}"),
    ]


def _load_cost_specs():
    """bench/cost_specs.py (bench/cost.py's specs by family, its base cell's names), loaded by its path: this file runs
    as a script and the tests load it by path too."""
    spec = importlib.util.spec_from_file_location("bench_cost_specs", HERE / "cost_specs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


COST_SPECS = _load_cost_specs()
BASE, OURS = COST_SPECS.BASE, COST_SPECS.OURS  # bench/cost.py's base cell and its own-attention cell


def _cost_specs(rec: dict) -> list[str]:
    """The specs of a bench/cost.py record, in the record's order (its layout map: the base, ours, then each spec)."""
    return [n for n in rec["derived"]["layout"] if n not in (BASE, OURS)]


def _cost_rows(rec: dict) -> list:
    """bench/cost.py's rows: per spec its text and HellaSwag cells against the unquantized sdpa cell, its layout."""
    return [
        ("model; text: windows x tokens, batch; HellaSwag items", ("model", "windows", "length", "batch", "items"),
         "{}; {} x {} tokens, batches of {}; {} items"),
        ("the base cells' attention (transformers' implementation, as loaded)", "base_attention", "`{}`"),
        ("16-bit through our attention function: text / HellaSwag", (f"ratio/text {OURS}", f"ratio/hellaswag {OURS}"),
         "{}x / {}x"),
        ("HellaSwag layout factor: the sdpa cell separate / shared", "hellaswag_layout_factor", "{}x"),
        *((f"`{n}`: text / HellaSwag (layout), goal", (f"ratio/text {n}", f"ratio/hellaswag {n}", f"layout/{n}",
                                                       f"goal/text {n}"), "{}x / {}x ({}), <= {}x")
          for n in _cost_specs(rec)),
        ("a KLD cell (w8a8) / its plain NLL cell (goal <= 1.1x)", "kld_vs_nll_cell", "**{}x**"),
        ("profile (Table 5's points) tokens/s / the sdpa forward's (goal >= 0.9x)", "profile_vs_sdpa_forward",
         "**{}x**"),
        ("peak RSS of the bench process, MB", "peak_rss_mb", "{:,}"),
    ]


# bench/make_reproduce.py records (the default and `--tag fused`): the same rows
MAKE_REPRODUCE_ROWS = [
    ("`make reproduce`, the whole target (install, data, both runs), min (goal 25)", "make_reproduce_min", "**{}**"),
    ("the two runs' own wall time (their reproduce.json), min", "runs_min", "{}"),
    ("pair: profile (400,000 tokens per model) / sweep (16/8/6/4 bits, 2 models, 10,042 items) / report, s",
     ("stages_s/pair/profile_s", "stages_s/pair/sweep_s", "stages_s/pair/report_s"), "{} / {} / {}"),
    ("SmolLM2-135M (`REAL_ARGS`): profile / sweep / report, s",
     ("stages_s/smollm2-135m/profile_s", "stages_s/smollm2-135m/sweep_s", "stages_s/smollm2-135m/report_s"),
     "{} / {} / {}"),
    ("the pair's sweep cells, s: unquantized / 8 / 6 / 4 bits (Transformer)",
     tuple(f"pair_sweep_cells_s/pair-tiny:transformer {b}" for b in
           ("16 (unquantized)", "8-bit int per_tensor", "6-bit int per_tensor", "4-bit int per_tensor")),
     "{} / {} / {} / {}"),
    ("the same (Diff)", tuple(f"pair_sweep_cells_s/pair-tiny:diff {b}" for b in
                              ("16 (unquantized)", "8-bit int per_tensor", "6-bit int per_tensor",
                               "4-bit int per_tensor")), "{} / {} / {} / {}"),
    ("the pair's Table 5 against docs/reproduction: largest relative difference",
     "vs_docs_reproduction/table5_largest_relative_difference", "{:.1e}"),
    ("the pair's sweep against docs/reproduction (same cell ids): largest difference of acc / acc_norm / flip rate",
     ("vs_docs_reproduction/sweep_max_abs_difference/acc", "vs_docs_reproduction/sweep_max_abs_difference/acc_norm",
      "vs_docs_reproduction/sweep_max_abs_difference/flip_rate"), "{} / {} / {:.1e}"),
]


# table name -> (record file stem, [(row label, key in the record's "derived", format)], or a function of the record
# that gives them)
TABLES = {
    "profile": ("profile", [
        (f"{label} (pair Diff / SmolLM2-135M)", tuple(f"{m}_{key}" for m in ("pair", "smollm2")), fmt)
        for label, key, fmt in (
            ("eager forward (batch 8 x 256), tokens/s", "eager_forward_tok_s", "{:,} / {:,}"),
            ("sdpa forward, tokens/s", "sdpa_forward_tok_s", "{:,} / {:,}"),
            ("`profile_model` (Table 5's two kinds: top-k, histograms, moments), tokens/s", "profile_tok_s", "{:,} / {:,}"),
            ("profile / eager (goal >= 0.7x)", "profile_vs_eager", "**{}x** / **{}x**"),
            ("the same, statistics uncompiled (`--no-compile`), tokens/s", "profile_uncompiled_tok_s", "{:,} / {:,}"),
            ("uncompiled / eager", "uncompiled_vs_eager", "{}x / {}x"),
            ("every point (`layers.*`, `lm_head.input`), tokens/s", "every_point_tok_s", "{:,} / {:,}"),
            ("every point / eager", "every_point_vs_eager", "{}x / {}x"),
            ("peak RSS, two kinds, MB", "peak_rss_mb", "{:,} / {:,}"),
            ("peak RSS, every point, MB", "every_point_peak_rss_mb", "{:,} / {:,}"),
        )
    ] + [
        ("peak RSS of the pair's profile, 0.1M / 1M tokens, MB", ("pair_peak_rss_mb_100k", "pair_peak_rss_mb_1m"),
         "{:,} / {:,}"),
        ("growth, MB (goal <= 100)", "pair_rss_growth_mb", "**{}**"),
    ]),
    "profile_points": ("profile_points", [
        ("tokens per profile (and for the last row, 4x)", ("tokens", "tokens_4x"), "{:,} ({:,})"),
        ("peak RSS, Table 5's two points, MB", "two_peak_rss_mb", "{:,}"),
        ("peak RSS, every nn.Linear input + q/k/v, MB", "linear_qkv_peak_rss_mb", "{:,}"),
        ("peak RSS, every point, MB", "every_peak_rss_mb", "{:,}"),
        ("peak RSS, every point, 4x the tokens, MB", "every_4x_peak_rss_mb", "{:,}"),
        ("linear inputs + q/k/v vs two points (goal <= 2x)", "rss_linear_qkv_vs_two", "**{}x**"),
        ("every point vs two points", "rss_every_vs_two", "{}x"),
        ("growth with 4x the tokens, every point, MB", "rss_growth_every_4x_tokens_mb", "{}"),
    ]),
    "profile_points_400k": ("profile_points_400k", [
        ("tokens per profile (one run each, side by side, one thread each)", "tokens", "{:,}"),
        ("peak RSS, Table 5's two points, MB", "two_peak_rss_mb", "{:,}"),
        ("peak RSS, every point (includes every nn.Linear input + q/k/v), MB", "every_peak_rss_mb", "{:,}"),
        ("every point vs two points (the goal's subset: <= this; goal <= 2x)", "rss_every_vs_two", "**{}x**"),
    ]),
    "quant": ("quant", [
        ("plain copy (`clone`) of a (8, 6, 256, 256) fp32 logits tensor, GB/s", "copy_GBps", "{}"),
        ("fake-quant 8-bit per_tensor (scale + round + mask), GB/s", "fake_quant_per_tensor_GBps", "{}"),
        ("fake-quant 8-bit per_head, GB/s", "fake_quant_per_head_GBps", "{}"),
        ("fake-quant 8-bit per_row, GB/s", "fake_quant_per_row_GBps", "{}"),
        ("bitsandbytes `int8_vectorwise_quant` per_row (incl. masking and dequant), GB/s", "bitsandbytes_per_row_GBps", "{}"),
        ("forward, eager attention (batch 8 x 256), ms", "forward_eager_ms", "{}"),
        ("forward, sdpa, ms", "forward_sdpa_ms", "{}"),
        ("forward, our attention function, 16 bits (unquantized), ms", "forward_ours_unquantized_ms", "{}"),
        ("forward, our attention function, 8-bit per_tensor, ms", "forward_quant8_per_tensor_ms", "{}"),
        ("quantized / eager (goal <= 1.5x)", "quant_vs_eager", "**{}x**"),
    ]),
    "lmeval_diff": ("eval_vs_lmeval_diff_10042", [*_lmeval_rows("40,168"),
        ("items/s, outlierscope / lm-eval", ("ours_items_per_s", "lmeval_items_per_s"), "{} / {}"),
        ("speed-up (goal >= 4x)", "speedup", "**{}x**"),
    ]),
    "lmeval_smollm2": ("eval_vs_lmeval_smollm2-135m_1000", [*_lmeval_rows("4,000"),
        ("whole process, s, every run: outlierscope / lm-eval", ("ours_process_s", "lmeval_process_s"), "{} / {}"),
        ("items/s, outlierscope / lm-eval", ("ours_items_per_s", "lmeval_items_per_s"), "{} / {}"),
        ("speed-up (goal >= 3x)", "speedup", "**{}x**"),
        ("FLOP-bound ratio: lm-eval's matmul FLOPs / ours for these items", "flop_ratio", "{}x"),
        ("measured speed-up / FLOP-bound ratio", "speedup_over_flop_ratio", "{}"),
    ]),
    "attention_memory": ("attention_memory", _attention_memory_rows()),
    "attention_memory_cuda": ("attention_memory_cuda", _attention_memory_rows()),
    "tasks_vs_lmeval": ("tasks_vs_lmeval", [
        (f"{t}: rows with identical requests and gold", f"{t}_identical_rows", "{}")
        for t in ("arc_easy", "arc_challenge", "boolq", "openbookqa", "piqa", "winogrande", "sciq", "copa", "social_iqa")
    ]),
    "tasks_scores_diff": ("tasks_vs_lmeval_diff", [
        (f"{t}", (f"{t}_summary",) + ((f"{t}_summary_norm",) if norm else ()), "{}" + ("; {}" if norm else ""))
        for t, norm in (("arc_easy", 1), ("arc_challenge", 1), ("boolq", 0), ("openbookqa", 1),
                        ("winogrande", 0), ("sciq", 1), ("copa", 0), ("social_iqa", 0))
    ]),
    "tasks_scores_smollm2": ("tasks_vs_lmeval_smollm2-135m", [
        ("piqa", ("piqa_summary", "piqa_summary_norm"), "{}; {}"),
    ]),
    "recipe_cost": ("recipe_cost", [
        ("HellaSwag items per cell, model", ("items", "model"), "{} items, {}"),
        *((f"{name}: s per cell (median), vs the logits cell", (f"median_s/{name}", f"ratio_vs_logits/{name}"),
           "{} s, {}x") for name in ("logits int4 per_tensor", "sage1", "sage2-int4", "fa3-fp8", "fa3-fp8-hadamard",
                                     "kivi-2bit", "kivi-4bit", "mxfp4-attn", "mxfp8-attn", "nvfp4-attn")),
        ("slowest recipe vs the logits cell (goal <= 1.5x)", "max_ratio", "**{}x**"),
    ]),
    "perplexity_cost": ("perplexity_cost", _perplexity_cost_rows()),
    "perplexity_cost_smollm2": ("perplexity_cost_smollm2-135m", _perplexity_cost_rows(marginal=False)),
    "gptq_cost": ("gptq_cost", [
        ("calibration (text, sequences x tokens), grid", ("calibration/text", "calibration/sequences",
                                                          "calibration/tokens_each", "calibration/bits",
                                                          "calibration/group", "calibration/damp"),
         "{}, {} x {}; {} bits, groups of {}, damp {}"),
        ("model dtype (both sides), torch threads each", ("dtype", "threads_each"), "{}, {}"),
        ("outlierscope `gptq_model`, s per repetition", "ours_s", "{}"),
        ("GPT-QModel 7.6 `quantize`, s per repetition", "theirs_s", "{}"),
        ("medians, s: ours / GPT-QModel", ("ours_median_s", "theirs_median_s"), "{} / {}"),
        ("ours / GPT-QModel (goal <= 2x)", "ours_vs_theirs", "**{}x**"),
        ("peak RSS, MB: ours (whole bench process) / GPT-QModel (each run)", ("ours_peak_rss_mb", "theirs_peak_rss_mb"),
         "{} / {}"),
    ]),
    "cost_smollm2": ("cost_smollm2-135m", _cost_rows),  # rows from the record's own specs
    "cost_pair": ("cost_pair-tiny-diff", _cost_rows),
    "prefix_cost": ("prefix_cost_smollm2-135m", [
        ("model, layers; windows x tokens; spec of each one-layer cell", ("model", "layers", "windows", "length", "spec"),
         "{}, {} layers; {} x {} tokens; `{}; layers:i`"),
        ("decoder-layer forwards of one pass: reused / whole", ("layers_run/reused", "layers_run/whole"), "{} / {}"),
        ("s per pass (median): reused / whole", ("median_s/reused", "median_s/whole"), "{} / {}"),
        ("reused / whole (goal <= 0.6x)", "ratio_reused_vs_whole", "**{}x**"),
        ("every per-token value the same bytes; control (whole twice)", ("same_bytes", "control_same_bytes"),
         "{}; {}"),
    ]),
    "prefix_items_cost": ("prefix_items_cost_smollm2-135m", [
        ("model, layers; HellaSwag items; spec of each one-layer cell", ("model", "layers", "items", "spec"),
         "{}, {} layers; {} items; `{}; layers:i`, i = 1 .. L - 1"),
        ("decoder-layer forwards of one set: reused / one by one", ("layers_run/reused", "layers_run/one_by_one"),
         "{} / {}"),
        ("s per set (median): reused / one by one", ("median_s/reused", "median_s/one_by_one"), "{} / {}"),
        ("reused / one by one (goal <= 0.6x)", "ratio_reused_vs_one_by_one", "**{}x**"),
        ("every per-item score the same bytes; control (one by one twice)", ("same_bytes", "control_same_bytes"),
         "{}; {}"),
    ]),
    "make_reproduce": ("make_reproduce", [
        ("each run: processes x threads per process (pair / SmolLM2-135M)",
         ("launch/pair/processes", "launch/pair/threads", "launch/smollm2-135m/processes",
          "launch/smollm2-135m/threads"), "{} x {} / {} x {}"), *MAKE_REPRODUCE_ROWS]),
    "make_reproduce_fused": ("make_reproduce_fused", MAKE_REPRODUCE_ROWS),
    "parallel": ("parallel_sweep_2", [
        ("items, processes", ("items", "procs"), "{} items, {} processes"),
        ("whole process, s: 1 process / 2 processes", ("one_process_s", "processes_s"), "{} / {}"),
        ("speed-up, 2 processes of one thread over 1 (2 cores)", "speedup", "{}x"),
        ("sweep.csv and cell files byte-identical", "identical_files", "{}"),
    ]),
}


def record_path(stem: str) -> Path:
    """The record ``{stem}.json`` in bench/results or references/results (a stem names one record in all)."""
    found = [d / f"{stem}.json" for d in RECORD_DIRS if (d / f"{stem}.json").exists()]
    if len(found) != 1:
        raise FileNotFoundError(f"expected one record {stem}.json in {', '.join(map(str, RECORD_DIRS))}; found {found}")
    return found[0]


def load(stem: str) -> dict:
    """The record ``stem``, its seal checked."""
    from outlierscope.io import read_record

    return read_record(record_path(stem), what="bench record", sealed_only=True)


def render_cost_columns(stem: str) -> str:
    """The guide's compact table (docs/guide/cost.md) of a bench/cost.py record: one row per spec, text and HellaSwag ratios to
    the unquantized sdpa cell with the layout, and the record line."""
    rec = load(stem)
    d = rec["derived"]
    lines = ["| spec | running text | HellaSwag (layout) |", "|---|---|---|"]
    for name in (OURS, *_cost_specs(rec)):
        lines.append(f"| `{name}` | {d['ratio'][f'text {name}']}x | {d['ratio'][f'hellaswag {name}']}x "
                     f"({d['layout'][name]}) |")
    lines += ["", f"Ratios to the unquantized sdpa cell (HellaSwag's own separate layout: "
                  f"{d['hellaswag_layout_factor']}x); {_cost_record(rec, stem)}."]
    return "\n".join(lines)


def _cost_record(rec: dict, stem: str, machine: str = "") -> str:
    """``record `bench/results/STEM.json` (commit ..., CPU, N cores, <machine>medians of R)`` of a cost record."""
    return (f"record `bench/results/{stem}.json` (commit `{rec['git']['commit'][:10]}`"
            f"{' + changes' if rec['git']['dirty'] else ''}, {rec['machine']['cpu']}, {rec['machine']['cores']} cores, "
            f"{machine}medians of {min(len(v) for v in rec['raw']['seconds'].values())})")


def render_fused(stem: str) -> str:
    """A ``bench/cost.py --fused`` record: per spec its text cell (and its HellaSwag cell, where the record has
    them) eager and fused against the unquantized sdpa cell of the same kind and run, and how much faster fused is."""
    rec = load(stem)
    d, med = rec["derived"], rec["derived"]["median_s"]
    kinds = [k for k in ("text", "hellaswag") if f"{k} unquantized sdpa" in d["ratio"]]
    label = {"text": "running text", "hellaswag": "HellaSwag"}
    prefix = {"text": "text ", "hellaswag": "HellaSwag "} if len(kinds) > 1 else {"text": ""}  # columns of each kind
    lines = ["| spec | " + " | ".join(f"{prefix[k]}eager | {prefix[k]}fused | eager / fused" for k in kinds) + " |",
             "|---|" + "---|---|---|" * len(kinds)]
    for name in _cost_specs(rec):
        cols = []
        for k in kinds:
            eager, fused = f"{k} {name}", f"{k} {name}, fused"
            layout = f" ({d['layout'][name]})" if k == "hellaswag" else ""
            cols.append(f"{d['ratio'][eager]}x{layout} | {d['ratio'][fused]}x | {med[eager] / med[fused]:.2f}x")
        lines.append(f"| `{name}` | " + " | ".join(cols) + " |")
    m, raw = rec["machine"], rec["raw"]
    what = f"{raw['windows']} windows x {raw['length']} tokens, batches of {raw['batch']}"
    if "hellaswag" in kinds:
        what += f"; HellaSwag: {raw['items']} items, each spec in its layout, against the shared sdpa cell"
    caption = " and ".join(label[k] for k in kinds)
    lines += ["", f"{caption[0].upper()}{caption[1:]}, ratios to the unquantized sdpa cell of the same run ({what}); "
                  + _cost_record(rec, stem, f"{m['torch_threads']} thread(s), {_load(m)}, ") + "."]
    return "\n".join(lines)


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def render_cost_summary(stem: str, make_stem: str) -> str:
    """The top-level README's table: per family of bench/cost.py's specs the range of its ratios to the unquantized
    sdpa cell (running text; HellaSwag by layout) against its goal, then the KLD cell, the profile and `make
    reproduce` (the make_reproduce record), each with its goal."""
    rec, make = load(stem), load(make_stem)
    d = rec["derived"]
    lines = ["| what | running text | HellaSwag | goal |", "|---|---|---|---|"]
    for family, names in COST_SPECS.FAMILIES.items():
        names = [n for n in names if n in d["layout"]]
        by_layout = {lay: [d["ratio"][f"hellaswag {n}"] for n in names if d["layout"][n] == lay]
                     for lay in ("shared", "separate")}
        hs = "; ".join(f"{_span(v)} ({lay})" for lay, v in by_layout.items() if v)
        goals = sorted({d["goal"][f"text {n}"] for n in names})
        lines.append(f"| {family} ({len(names)} specs) | {_span([d['ratio'][f'text {n}'] for n in names])} | {hs} | "
                     f"<= {' / '.join(f'{g}x' for g in goals)} |")
    lines += [f"| a KLD cell (`w8a8`) / its plain NLL cell | {d['kld_vs_nll_cell']}x | | <= 1.1x |",
              f"| profile (Table 5's points), tokens/s / the sdpa forward's | {d['profile_vs_sdpa_forward']}x | | "
              f">= 0.9x |",
              f"| `make reproduce` on a fresh clone, minutes | {make['derived']['make_reproduce_min']} | | "
              f"{make['derived']['goal_min']} |"]
    m = make["machine"]
    lines += ["", f"Ratios to the unquantized sdpa cell of the same run, {rec['raw']['model']}, HellaSwag's own layout "
                  f"for the context and its endings (the sdpa cell separate / shared: {d['hellaswag_layout_factor']}x); "
                  + _cost_record(rec, stem) + f"; `make reproduce`: record `bench/results/{make_stem}.json` (commit "
                  f"`{make['git']['commit'][:10]}`, {m['cpu']}, {m['cores']} cores, one run)."]
    return "\n".join(lines)


SUMMARY = {"cost_summary": ("cost_smollm2-135m", "make_reproduce")}  # the top-level README's table
COLUMNS = {"cost_columns_smollm2": "cost_smollm2-135m"}  # tables of the guide's cost page
# bench/cost.py --fused records: table name -> stem
FUSED = {"cost_fused_smollm2": "cost_smollm2-135m_fused", "cost_fused_attention_smollm2": "cost_smollm2-135m_fused-attention"}


def render(name: str) -> str:
    if name in SUMMARY:
        return render_cost_summary(*SUMMARY[name])
    if name in COLUMNS:
        return render_cost_columns(COLUMNS[name])
    if name in FUSED:
        return render_fused(FUSED[name])
    stem, rows = TABLES[name]
    rec = load(stem)
    rows = rows(rec) if callable(rows) else rows
    d = {**rec["raw"], **rec["derived"]}
    lines = ["| measure | value |", "|---|---|"]
    for label, key, fmt in rows:
        vals = [_get(d, k) for k in key] if isinstance(key, tuple) else [_get(d, key)]
        value = PIPE.sub(r"\\|", fmt.format(*vals))  # a bare | in a value would split the cell
        lines.append(f"| {label} | {value} |")
    m = rec["machine"]
    where = record_path(stem).relative_to(HERE.parent).as_posix()
    lines += ["", f"Record: `{where}` ({rec['date']}, commit `{rec['git']['commit'][:10]}`"
                  f"{' + changes' if rec['git']['dirty'] else ''}; {m['cpu']}, {m['cores']} cores, {m['torch_threads']} "
                  f"threads{', ' + m['gpu'] if m['gpu'] else ''}; {_load(m)}; "
                  f"torch {rec['versions']['torch']}). Raw timings of every repetition are in the record."]
    return "\n".join(lines)


def _load(m: dict) -> str:
    load = m["load_average_1m_at_start"]
    return "load at the start not recorded" if load is None else f"load average {load} at the start"


def _get(d: dict, key: str):
    """``d[key]``, or a nested value by its path ``outer/inner`` (a record's per-setting dictionaries; an inner key
    may hold ``/`` itself: a spec's text)."""
    if key in d:
        return d[key]
    parts = key.split("/")
    for i in range(1, len(parts)):
        outer = "/".join(parts[:i])
        if isinstance(d.get(outer), dict):
            try:
                return _get(d[outer], "/".join(parts[i:]))
            except KeyError:
                continue
    raise KeyError(key)


PIPE = re.compile(r"(?<!\\)\|")
BLOCK = re.compile(r"(<!-- bench:(\w+) -->\n)(.*?)(<!-- /bench -->)", re.S)


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda mt: mt.group(1) + render(mt.group(2)) + "\n" + mt.group(4), text)


def main() -> int:
    for path in PAGES:
        text = path.read_text()
        new = rewrite(text)
        if "--check" in sys.argv:
            if new != text:
                print(f"{path} differs from the records: run `python bench/tables.py`")
                return 1
            continue
        path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
