"""A quantization spec as the tools that build deployed models read it: compressed-tensors' ``quantization_config``
(what a checkpoint's config.json carries, what vLLM reads) and an llm-compressor recipe (what ``oneshot`` runs).

Its design in full: the developer guide's internals page (docs/develop/internals.md).
"""

from __future__ import annotations

import dataclasses
import re

from torch import nn

from outlierscope.errors import OutlierscopeError
from outlierscope.hooks.points import decoder_layers
from outlierscope.quant.numerics.registry import Block, format_of_ct_args
from outlierscope.quant.specs.calibrated import GPTQConfig
from outlierscope.quant.specs.spec import TARGETS, QuantSpec, TensorQuant
from outlierscope.quant.specs.transforms import Calib, Layers, Linears, Rotate, Smooth

TARGET_CLASS = "Linear"  # compressed-tensors matches a target without "re:" against the module's class name
GPTQ_ACTORDER = {"none": None, "desc": "weight"}  # gptq:order -> GPTQModifier's actorder (with static group scales)
WRITTEN = (Smooth, GPTQConfig, Calib, Linears, Layers)  # the transforms a recipe or an ignore list states
STRATEGY = {"per_channel": "channel", "per_group": "group", "per_tensor": "tensor", "per_token": "token",
            "static": "tensor", "per_head": "attn_head"}


def _ct():
    try:
        import compressed_tensors.quantization as ctq
    except ImportError:
        raise OutlierscopeError("exporting a quantization_config needs compressed-tensors (the library that reads "
                                "it): pip install compressed-tensors") from None
    return ctq


def tensor_args(p: TensorQuant) -> dict:
    """compressed-tensors' ``QuantizationArgs`` fields of one ``a=`` / ``w=`` part (or ``k`` / ``v`` of a KV cache).

    Args:
        p: the part."""
    dynamic = p.target == "a" and p.granularity != "static"
    fmt = p.fmt
    args = fmt.ct_args(p)
    if isinstance(fmt, Block):  # its own blocks
        args["dynamic"] = dynamic
        if dynamic and fmt.ct_dynamic:  # NVFP4: per-block scales dynamic, the global one calibrated
            args.update(fmt.ct_dynamic)
        return args
    args.update(strategy=STRATEGY[p.granularity], dynamic=dynamic)
    if p.granularity == "per_group":
        args["group_size"] = p.size
    return args


def kv_cache_args(spec: QuantSpec) -> dict | None:
    """The ``kv_cache_scheme`` of a spec whose attention parts are exactly a KV cache's.

    Args:
        spec: the spec: ``k`` and ``v`` in one 8-bit format (fint8 or e4m3), per_tensor or per_head.

    Returns:
        The scheme's fields; None when the spec quantizes nothing inside attention.

    Raises:
        OutlierscopeError: attention parts no KV cache scheme states."""
    if not spec.has_attention:
        return None
    k, v = spec.part("k"), spec.part("v")
    others = [str(p) for p in spec.parts if p.target in TARGETS and p.target not in ("k", "v")]
    others += [t.key for t in spec.transforms if t.attention]
    same = k is not None and v is not None and dataclasses.replace(k, target="v") == v
    if others or not same or not k.fmt.ct_kv or k.nominal_bits != 8 \
            or k.granularity not in ("per_tensor", "per_head"):
        raise OutlierscopeError(f"{spec}: compressed-tensors quantizes attention only as a KV cache (k and v alike, "
                                "fint8 or e4m3, per_tensor or per_head); expected e.g. 'kv=e4m3/per_tensor' or no "
                                "attention parts" + (f", got {', '.join(others)}" if others else ""))
    tensor_args(k)  # the grid's check, naming k's own spelling
    return {**tensor_args(dataclasses.replace(k, target="a", granularity="static")),
            "strategy": STRATEGY[k.granularity]}


def check_exportable(spec: QuantSpec) -> None:
    """Refuse, before any model is read, what compressed-tensors and llm-compressor cannot state.

    Args:
        spec: the spec to export."""
    if spec.get(Rotate) is not None:
        raise OutlierscopeError(f"{spec}: rotate:SEED has no compressed-tensors form that reproduces it (llm-compressor's "
                                "QuIP/SpinQuant modifiers rotate differently); export the spec without it")
    if spec.outlier_threshold is not None:
        raise OutlierscopeError(f"{spec}: outliers:T is LLM.int8's decomposition, bitsandbytes' "
                                f"(BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold={spec.outlier_threshold})), not a "
                                "compressed-tensors scheme")
    if spec.weights_mode != "none":
        raise OutlierscopeError(f"{spec}: w=bnb-{spec.weights_mode} is bitsandbytes' own format (transformers' "
                                f"BitsAndBytesConfig), not a compressed-tensors scheme; export w=fint8/per_channel or "
                                "w=fint4/per_group:128 instead")
    if spec.part("w") is None and spec.part("a") is not None:
        raise OutlierscopeError(f"{spec}: compressed-tensors quantizes activations only with the weights; add a w= part")
    if kv_cache_args(spec) is None and spec.part("w") is None:  # kv_cache_args refuses other attention parts
        raise OutlierscopeError(f"{spec}: quantizes nothing compressed-tensors can state; expected w= (and a=) parts "
                                "or a KV cache (kv=e4m3/per_tensor)")
    for p in (spec.part("w"), spec.part("a")):
        if p is not None:
            tensor_args(p)
    if spec.gptq is not None and (not spec.gptq.static or spec.gptq.order not in GPTQ_ACTORDER
                                  or spec.gptq.sequential != "layer"):
        raise OutlierscopeError(f"{spec}: llm-compressor's GPTQModifier takes its group scales before any update, "
                                "orders columns as they are or by decreasing Hessian diagonal and calibrates a "
                                "layer's linears in one pass; export gptq:static,sequential=layer (order=none or "
                                "order=desc)")
    if spec.awq is not None:
        raise OutlierscopeError(f"{spec}: awq is AutoAWQ's search (ratios i/20, with clipping); llm-compressor's "
                                "AWQModifier searches other ratios without clipping, so its recipe would not give these "
                                "weights; export without awq (RTN) or with gptq:static,sequential=layer")
    other = [t for t in spec.transforms if not isinstance(t, WRITTEN) and not t.attention]  # attention: kv_cache_args
    if other:
        raise OutlierscopeError(f"{spec}: {other[0]} has no compressed-tensors form; export the spec without it")


def linear_scheme(spec: QuantSpec) -> dict | None:
    """The ``QuantizationScheme`` of the quantized linears (targets, weights, input activations).

    Args:
        spec: the spec.

    Returns:
        The scheme's fields; None without a ``w=`` part."""
    w, a = spec.part("w"), spec.part("a")
    if w is None:
        return None
    return {"targets": [TARGET_CLASS], "weights": tensor_args(w), **({"input_activations": tensor_args(a)} if a else {})}


def ignore_list(model: nn.Module, quantized: set[str]) -> list[str]:
    """Every ``nn.Linear`` of a model that is not quantized, as compressed-tensors' ignore list, in module order.

    A decoder layer none of whose linears is quantized is one ``re:`` pattern; the others are named.

    Args:
        model: the model.
        quantized: the full names of the quantized linears."""
    names = {id(m): n for n, m in model.named_modules()}
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    ignore, whole = [], set()
    for layer in decoder_layers(model):
        inside = [names[id(m)] for m in layer.modules() if isinstance(m, nn.Linear)]
        if inside and not quantized.intersection(inside):
            ignore.append(f"re:{re.escape(names[id(layer)])}\\.")
            whole.update(inside)
    return ignore + [n for n in linears if n not in quantized and n not in whole]


def differences(spec: QuantSpec) -> list[str]:
    """How the emulation of a spec and the real scheme built from its export differ, one note each.

    Args:
        spec: the exported spec."""
    notes = ["weights: the emulation rounds to nearest (RTN), as llm-compressor's QuantizationModifier; a "
             "GPTQModifier or AWQModifier in its place would correct the rounding error"] if spec.gptq is None else [
        f"weights: GPTQ as llm-compressor's GPTQModifier computes it (static group scales, one pass per layer, "
        f"block {spec.gptq.block}, "
        f"damping {spec.gptq.damp}), calibrated here on {spec.gptq.samples} x {spec.gptq.seqlen} tokens of "
        f"{spec.calib or 'lambada-tail'}; oneshot calibrates on the dataset given to it"]
    a = spec.part("a")
    if a is not None and a.granularity == "per_tensor":
        notes.append("a=.../per_tensor: the emulation's scale is each sequence's; compressed-tensors' dynamic "
                     "per-tensor scale is the whole batch's")
    w = spec.part("w")
    if w is not None and isinstance(w.fmt, Block) and w.fmt.global_scale:
        notes.append("nvfp4 weights: a loaded checkpoint's are decoded in float32 (compressed-tensors' dequantize, "
                     "q x fp32(s / gs), as the emulation computes them); compressed-tensors' own decompression computes "
                     "in bfloat16, and NVFP4 kernels multiply the codes by the E4M3 scales in the product and divide by "
                     "the global scales after it: the same values, rounded otherwise")
    if a is not None and isinstance(a.fmt, Block) and a.fmt.global_scale:
        notes.append("nvfp4 activations: the emulation's global scale is each sequence's; compressed-tensors "
                     "calibrates a static one (dynamic: local)")
    if spec.get(Smooth) is not None or a is not None and a.granularity == "static":
        notes.append("calibration: llm-compressor calibrates the smoothing factors and static scales on the dataset "
                     f"given to oneshot; the emulation on {spec.calib or 'hellaswag'}")
    if spec.has_attention:
        notes.append("KV cache: compressed-tensors' scales are static (calibrated); the emulation's per sequence")
    return notes


def quantization_config(spec: QuantSpec, ignore: list[str]) -> dict:
    """The ``quantization_config`` of config.json for a spec, validated by compressed-tensors' own classes.

    Args:
        spec: the spec.
        ignore: the ignore list (``ignore_list``)."""
    ctq = _ct()
    from compressed_tensors.compressors.format import infer_module_format

    scheme = linear_scheme(spec)
    groups = {"group_0": ctq.QuantizationScheme(**scheme)} if scheme else {}
    kv = kv_cache_args(spec)
    fmt = infer_module_format(nn.Linear, groups["group_0"]).value if groups else "dense"
    config = ctq.QuantizationConfig(config_groups=groups, ignore=ignore, format=fmt,
                                    kv_cache_scheme=ctq.QuantizationArgs(**kv) if kv else None,
                                    quantization_status="compressed")
    return config.model_dump(mode="json", exclude_none=True)


def recipe(spec: QuantSpec, ignore: list[str]) -> dict:
    """An llm-compressor recipe (``oneshot(model, recipe=...)``) for a spec.

    SmoothQuant where the spec smooths, then the quantization (GPTQ where it has ``gptq``) with the scheme, ignore
    list and KV cache scheme of ``quantization_config``.

    Args:
        spec: the spec.
        ignore: the ignore list."""
    modifiers = {}
    if (smooth := spec.get(Smooth)) is not None:
        modifiers["SmoothQuantModifier"] = {"smoothing_strength": smooth.alpha}
    scheme, kv = linear_scheme(spec), kv_cache_args(spec)
    quant = {"targets": [TARGET_CLASS], "ignore": ignore}
    if scheme:
        quant["config_groups"] = {"group_0": scheme}
    if kv:
        quant["kv_cache_scheme"] = kv
    if spec.gptq is not None:  # GPTQModifier in QuantizationModifier's place (gptq:static,sequential=layer, checked on export)
        quant.update(block_size=spec.gptq.block, dampening_frac=spec.gptq.damp,
                     actorder=GPTQ_ACTORDER[spec.gptq.order])
        modifiers["GPTQModifier"] = quant
    else:
        modifiers["QuantizationModifier"] = quant
    return {"default_stage": {"default_modifiers": modifiers}}


# the other direction: what a checkpoint's quantization_config says, as a spec the emulation runs on float weights

def _format_from_args(args: dict) -> tuple[str, bool]:
    """(format text, whether it brings its own blocks) of compressed-tensors ``QuantizationArgs`` fields."""
    fmt, bits = format_of_ct_args(args)
    return fmt.text(bits), isinstance(fmt, Block)


def part_text(target: str, args: dict) -> str:
    """One part of a spec (``a=``, ``w=`` or ``kv=``) from compressed-tensors ``QuantizationArgs`` fields.

    Symmetric integers are written on compressed-tensors' own full-range grid (``fint``).

    Args:
        target: ``a``, ``w`` or ``kv``.
        args: the ``QuantizationArgs`` fields."""
    fmt, block = _format_from_args(args)
    if block:
        return f"{target}={fmt}"
    strategy = args.get("strategy")
    if target == "a" and strategy == "tensor":
        return f"a={fmt}/{'per_tensor' if args.get('dynamic') else 'static'}"
    gran = {"channel": "per_channel", "token": "per_token", "tensor": "per_tensor", "attn_head": "per_head"}.get(strategy)
    if strategy == "group":
        gran = f"per_group:{args['group_size']}"
    if gran is None:
        raise OutlierscopeError(f"compressed-tensors strategy {strategy!r} of {target}= has no emulation here "
                                "(expected channel, group, tensor, token)")
    return f"{target}={fmt}/{gran}"


def _scope(model: nn.Module, quantized: set[str]) -> str:
    """``layers:``/``linears:`` items that select exactly ``quantized`` (the decoder layers' linear names)."""
    from outlierscope.quant.linears.sites import HEAD, layer_linears

    names = {id(m): n for n, m in model.named_modules()}
    per_layer = [{p: names[id(m)] for p, m in layer} for layer in layer_linears(model)]
    head = names.get(id(model.get_output_embeddings()))
    extra = quantized - {n for layer in per_layer for n in layer.values()} - {head}
    layers = [i for i, layer in enumerate(per_layer) if quantized.intersection(layer.values())]
    paths = {tuple(sorted(p for p, n in per_layer[i].items() if n in quantized)) for i in layers}
    if extra or len(paths) != 1:
        raise OutlierscopeError("the checkpoint quantizes "
                                + ("modules outside the decoder layers (" + ", ".join(sorted(extra)) + ")" if extra
                                   else "different linears in different layers")
                                + "; give the emulation's spec yourself (quant=)")
    (chosen,) = paths
    pats = ["*"] if set(chosen) == set(per_layer[layers[0]]) else list(chosen)
    pats += [HEAD] if head in quantized else []
    items = [] if pats == ["*"] else [f"linears:{','.join(pats)}"]
    return "; ".join(items + ([] if len(layers) == len(per_layer) else [f"layers:{','.join(map(str, layers))}"]))


def spec_from_config(qconfig: dict, model: nn.Module) -> QuantSpec:
    """The spec that emulates a checkpoint's compressed-tensors ``quantization_config`` on its float weights.

    One config group of ``Linear`` targets (weights, input activations), on the modules its ignore list leaves
    quantized, and the KV cache scheme.

    Args:
        qconfig: the checkpoint's ``quantization_config``.
        model: the model (a meta model will do), for the module names.

    Raises:
        OutlierscopeError: a config with no such form, in one line."""
    from compressed_tensors.utils.match import match_named_modules

    groups = list((qconfig.get("config_groups") or {}).values())
    if len(groups) > 1 or groups and groups[0].get("output_activations"):
        raise OutlierscopeError("the checkpoint's quantization_config has several config groups or output "
                                "activations; give the emulation's spec yourself (quant=)")
    items = []
    if groups:
        g = groups[0]
        items += [part_text(t, g[k]) for t, k in (("w", "weights"), ("a", "input_activations")) if g.get(k)]
        quantized = {n for n, m in match_named_modules(model, g["targets"], qconfig.get("ignore") or [])
                     if isinstance(m, nn.Linear)}
        items.append(_scope(model, quantized))
    if qconfig.get("kv_cache_scheme"):
        items.append(part_text("kv", {**qconfig["kv_cache_scheme"], "dynamic": False}).replace("/static", "/per_tensor"))
    return QuantSpec.parse("; ".join(i for i in items if i) or "none")


def _packed_symmetric(qconfig: dict) -> bool:
    """Whether a GPTQ / AWQ checkpoint's grid is symmetric (GPTQ ``sym``; AWQ without ``zero_point``)."""
    return qconfig.get("sym", True) if qconfig["quant_method"] == "gptq" else not qconfig.get("zero_point", True)


def spec_from_packed_config(qconfig: dict, model: nn.Module, packed: list[str]) -> QuantSpec:
    """The RTN emulation of a GPTQ / AWQ checkpoint's weights on its float weights: the same bits, groups and grid.

    Symmetric: fintB (GPTQ's scale 2 absmax / (2^b - 1) onto [-2^(b-1), 2^(b-1) - 1]); with zero points: asymB.

    Args:
        qconfig: the checkpoint's ``quantization_config``.
        model: the model, for the module names.
        packed: the names of the linears the checkpoint holds packed."""
    bits, group = int(qconfig["bits"]), int(qconfig.get("group_size") or -1)
    sym = _packed_symmetric(qconfig)
    gran = f"per_group:{group}" if group > 0 else "per_channel"
    scope = _scope(model, set(packed))
    return QuantSpec.parse("; ".join(i for i in (f"w={'fint' if sym else 'asym'}{bits}/{gran}", scope) if i))


def packed_differences(qconfig: dict) -> list[str]:
    """How a GPTQ / AWQ checkpoint and the RTN emulation of its scheme differ, one note each.

    Args:
        qconfig: the checkpoint's ``quantization_config``."""
    method = qconfig["quant_method"]
    if method == "gptq":
        notes = ["weights: GPTQ rounds the input columns one after another and moves each column's rounding error "
                 "onto the columns not yet rounded (through the Hessian of its calibration inputs); the emulation "
                 "rounds every weight to nearest (RTN), so the checkpoint's codes are not the emulation's"]
        if qconfig.get("desc_act"):
            notes.append("act order: GPTQ takes the input channels by decreasing Hessian diagonal and its groups "
                         "follow that order (g_idx); the emulation's groups are contiguous channels")
    else:
        notes = ["weights: AWQ scales each input channel by its calibration activations' magnitude before rounding "
                 "(the inverse folded into the previous op) and searches a clipping range per group; the emulation "
                 "rounds the unscaled weights to nearest over each group's full range"]
    notes.append("scales: the checkpoint stores them in float16, the emulation computes them in float32; on the "
                 "symmetric grid a weight at a group's absmax sits on a tie (w / scale = (2^b - 1) / 2) that either "
                 "rounding may take")
    if not _packed_symmetric(qconfig):
        notes.append(f"zero points: {method.upper()}'s are integers (0 lies exactly on its grid); the emulation's "
                     "asymB grid runs from each group's min to its max, its offset not rounded")
    return notes
