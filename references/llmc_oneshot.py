"""Build a compressed-tensors checkpoint from an ``outlierscope export`` with llm-compressor itself.

Runs in llm-compressor's own venv (``make llmc-venv``: llmcompressor 0.14.0.1 pins compressed-tensors 0.19.0 and
transformers <= 5.17, not ours), imports nothing of outlierscope. Steps:

1. llm-compressor's recipe parser reads the export's ``recipe.yaml``; its QuantizationModifier must hold the export's
   ``quantization_config`` (config groups, ignore list, KV cache scheme) field for field;
2. ``oneshot(model, recipe)`` on the float model (RTN weights; SmoothQuant and static scales calibrate on
   ``--calib-text``, packed into ``--calib-seqs`` sequences of ``--calib-len`` tokens);
3. the model saved compressed into ``--out``; the ``quantization_config`` llm-compressor wrote must again match the
   export's. What it found goes to llmc_oneshot.json in ``--out`` and in the export's directory (and stdout).

Usage: .venv-llmc/bin/python references/llmc_oneshot.py --model DIR --export EXPORT_DIR --out CKPT_DIR [--calib-text F]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

ARG_FIELDS = ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "scale_dtype")


def _args(d: dict | None) -> dict | None:
    """The fields the export states of one QuantizationArgs (others are llm-compressor's defaults, e.g. observers)."""
    return None if not d else {k: d.get(k) for k in ARG_FIELDS}


def _scheme(config: dict) -> dict:
    groups = {name: {"targets": g["targets"], "weights": _args(g.get("weights")),
                     "input_activations": _args(g.get("input_activations"))}
              for name, g in (config.get("config_groups") or {}).items()}
    return {"config_groups": groups, "ignore": config.get("ignore") or [],
            "kv_cache_scheme": _args(config.get("kv_cache_scheme"))}


def parsed_recipe(path: Path) -> dict:
    """The recipe as llm-compressor's parser reads it: the QuantizationModifier's scheme, and the modifiers' names."""
    from llmcompressor.recipe import Recipe

    recipe = Recipe.create_instance(str(path))
    quant = next(m for m in recipe.modifiers if type(m).__name__ == "QuantizationModifier")
    groups = {n: g.model_dump(mode="json") for n, g in (quant.config_groups or {}).items()}
    kv = quant.kv_cache_scheme.model_dump(mode="json") if quant.kv_cache_scheme else None
    return {"modifiers": [type(m).__name__ for m in recipe.modifiers],
            "scheme": _scheme({"config_groups": groups, "ignore": quant.ignore, "kv_cache_scheme": kv})}


def _calibration(tok, path: str | None, seqs: int, length: int):
    if path is None:
        return None
    from datasets import Dataset

    ids = tok(Path(path).read_text(), return_tensors=None)["input_ids"][: seqs * length]
    rows = [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * length for _ in rows]})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the float model's directory")
    p.add_argument("--export", required=True, help="an `outlierscope export` output directory")
    p.add_argument("--out", required=True, help="where the compressed checkpoint goes")
    p.add_argument("--calib-text", help="a .txt file for SmoothQuant / static scales")
    p.add_argument("--calib-seqs", type=int, default=32)
    p.add_argument("--calib-len", type=int, default=512)
    a = p.parse_args()

    import compressed_tensors
    import llmcompressor
    import torch
    import transformers
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = Path(a.export)
    want = _scheme(json.loads((export / "quantization_config.json").read_text()))
    parsed = parsed_recipe(export / "recipe.yaml")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(a.model)
    data = _calibration(tok, a.calib_text, a.calib_seqs, a.calib_len)
    oneshot(model=model, recipe=str(export / "recipe.yaml"), **({"dataset": data} if data is not None else {}))
    model.save_pretrained(a.out, save_compressed=True)
    tok.save_pretrained(a.out)
    written = json.loads((Path(a.out) / "config.json").read_text())["quantization_config"]
    record = {"model": a.model, "export": str(export), "out": a.out, "recipe_modifiers": parsed["modifiers"],
              "parser_matches_export": parsed["scheme"] == want, "checkpoint_matches_export": _scheme(written) == want,
              "checkpoint_format": written.get("format"), "export_format": json.loads(
                  (export / "quantization_config.json").read_text()).get("format"),
              "versions": {"llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
                           "transformers": transformers.__version__, "torch": torch.__version__,
                           "python": platform.python_version()}}
    for d in (Path(a.out), export):
        from textpack import write_sealed

        write_sealed(d / "llmc_oneshot.json", record)
    print(json.dumps(record, indent=1))
    if not (record["parser_matches_export"] and record["checkpoint_matches_export"]):
        raise SystemExit("llm-compressor's reading of the export differs from it (see the record above)")


if __name__ == "__main__":
    main()
