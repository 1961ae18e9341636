"""The settings of a per-layer sensitivity study (``outlierscope sensitivity``), one frozen dataclass: every field a
CLI flag of the same name, checked on construction, written to the study's record (``SensitivitySettings``)."""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass

from outlierscope.analysis.attention_error import (
    measured_spec,
)
from outlierscope.analysis.harm import RANK_BY, TEXT_METRICS
from outlierscope.errors import ParamError, check_seed
from outlierscope.models.loading import (
    attn_block_option,
    check_placement,
    device_map_option,
    device_option,
    dtype_option,
    fused_option,
    trust_remote_code_option,
)
from outlierscope.quant.numerics.names import GRANULARITIES, UNQUANTIZED_BITS
from outlierscope.quant.numerics.registry import logits_formats
from outlierscope.quant.specs.spec import QuantSpec, build_spec
from outlierscope.runs.cells import DEFAULT_BATCH
from outlierscope.runs.perplexity import (
    TEXT_FIELDS,
    check_text_fields,
    length_option,
    max_windows_option,
    protocol_option,
    text_batch_size_option,
    text_option,
)
from outlierscope.settings import check_defaults, option

ITEM_FIELDS = ("task", "limit", "sample", "batch_size")  # what only the gold_ll metric reads


@dataclass(frozen=True)
class SensitivitySettings:
    """Settings of a per-layer sensitivity study (``outlierscope sensitivity``): one model, one spec quantized layer
    by layer, ranked by a metric, with a greedy mixed-precision suggestion. Each field is a CLI flag of the same name
    (its help is the field's ``option`` text) and is written to the study's record."""

    model: str = option(MISSING, "Hub id (ORG/NAME[@REVISION]), HF model directory, .gguf file, preset role or fetched model", metavar="SPEC")
    bits: int = option(4, "bit width of the quantized layers")
    format: str = option("int", "int absmax or FP8 (bits 8)", choices=logits_formats())
    granularity: str = option("per_tensor", "one scale per sequence and layer / per head / per query row",
                              choices=GRANULARITIES)
    quant: str | None = option(None, "a recipe or spec of attention or linear layers (see `outlierscope recipes`) "
                               "instead of --bits, --format, --granularity: each layer in turn gets it",
                               metavar="RECIPE_OR_SPEC")
    task: str = option("hellaswag", "hellaswag or a zero-shot task (see `outlierscope tasks`)", metavar="TASK")
    limit: int | None = option(None, "first N validation items", exclusive="items")
    sample: int | None = option(None, "N items drawn at random (with --seed)", exclusive="items")
    seed: int = option(0, "seeds --sample")
    metric: str = option("gold_ll", "rank layers and bound the suggestion by gold_ll (the task's items: mean change of "
                         "the gold choice's log-likelihood), kld (running text: mean KL divergence to the unquantized "
                         "model at every token) or ppl (running text: ln of the PPL ratio)", choices=tuple(RANK_BY))
    text: str = text_option()
    protocol: str = protocol_option()
    length: int | None = length_option()
    max_windows: int | None = max_windows_option()
    text_batch_size: int = text_batch_size_option()
    tolerance: float = option(0.05, "largest harm the suggested assignment may have, in the metric's unit: nats of mean "
                              "gold log-likelihood lost (gold_ll), nats of mean KLD (kld), ln PPL ratio (ppl); a gain "
                              "always passes")
    keep_bits: int = option(16, "bits of the layers the suggestion keeps (16: unquantized; e.g. 8 for a 4/8-bit mix)")
    all_but: bool = option(True, "skip the second pass (every layer quantized but one)")
    attn_error: bool = option(True, "skip each layer's attention error (measured in the unquantized cell: costs 2-5x "
                              "one cell)")
    kinds: bool = option(True, "skip the pass over linear kinds (a linear spec: each kind, q_proj ... down_proj, "
                         "quantized alone in every layer)")
    profile_tokens: int = option(20_000, "tokens of the short profile for the per-layer outlier statistic")
    batch_size: int = option(DEFAULT_BATCH, "sequences per forward; quantized scores depend on it by float32 rounding (part of a "
                             "quantized cell's identity); 1 is exactly batch-invariant, ~2x slower")
    dtype: str = dtype_option()
    device: str = device_option()
    device_map: str | None = device_map_option()
    attn_block: int | None = attn_block_option()
    fused: bool = fused_option()
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self):
        check_seed(self.seed)
        from outlierscope.data.tasks import check_task

        check_task(self.task)
        if self.quant is not None:
            self._check_quant()
        spec = self.spec()  # bits, format, granularity (or the attention spec) checked before anything loads
        if self.attn_error and self.metric == "gold_ll":
            measured_spec(spec)
        if spec.bits == 16:
            raise ParamError("bits", "below 16 (16 is unquantized: nothing to be sensitive to)", self.bits)
        self.spec(bits=self.keep_bits)
        if not spec.bits < self.keep_bits:
            raise ParamError("keep_bits", f"above bits={spec.bits} (16 = kept layers unquantized)", self.keep_bits)
        self._check_metric_fields()
        if not self.tolerance >= 0:
            raise ParamError("tolerance", f">= 0 ({RANK_BY[self.metric].unit})", self.tolerance)
        for n in ("limit", "sample"):
            if getattr(self, n) is not None and getattr(self, n) < 1:
                raise ParamError(n, ">= 1", getattr(self, n))
        if self.profile_tokens < 1:
            raise ParamError("profile_tokens", ">= 1", self.profile_tokens)
        check_placement(self.device, self.dtype, self.device_map, self.attn_block, self.fused)

    def _check_metric_fields(self) -> None:
        """The item settings only with gold_ll, the text settings only with kld / ppl, whose cells keep no layers at
        other bits."""
        if self.metric not in RANK_BY:
            raise ParamError("metric", f"one of {', '.join(RANK_BY)}", self.metric)
        check_text_fields(self)
        scores = "items of a task" if self.metric == "gold_ll" else "running text"
        check_defaults(self, TEXT_FIELDS if self.metric == "gold_ll" else ITEM_FIELDS,
                       f"with metric={self.metric!r} (it scores {scores})")
        if self.metric in TEXT_METRICS and self.keep_bits != UNQUANTIZED_BITS:
            raise ParamError("keep_bits", f"16 with metric={self.metric!r} (a kept layer at other bits is not built "
                             "for the text metrics)", self.keep_bits)

    def _check_quant(self) -> None:
        """``quant`` replaces bits, format and granularity, quantizes something, and names no layers (each layer in
        turn gets it)."""
        spec = QuantSpec.parse(self.quant)
        if spec.is_identity:
            raise ParamError("quant", "a recipe or spec that quantizes something (see `outlierscope recipes`)",
                             self.quant, "'none' leaves every layer as it is")
        if spec.layers is not None:
            raise ParamError("quant", "a spec that names no layers (each layer in turn gets it)", self.quant)
        if spec.weights_mode != "none":
            raise ParamError("quant", "a spec without bitsandbytes weights (w=bnb-...: they replace every layer's "
                             "linears at once, so no layer can be ranked; rank w=int8/per_channel or "
                             "w=fint4/per_group:128 instead)", self.quant)
        if not spec.parts:
            raise ParamError("quant", "a spec with a quantized part (e.g. 'k=int4/per_token; smooth_k'): smoothing and "
                             "rotations alone are exact, nothing to be sensitive to", self.quant)
        if spec.linears is not None and "lm_head" in spec.linears:
            raise ParamError("quant", "linears inside the decoder layers: sensitivity ranks layers, and the LM head is "
                             "in none (evaluate it with sweep --quant '...; linears:lm_head')", self.quant)
        for name in ("bits", "format", "granularity"):
            default = next(f.default for f in dataclasses.fields(self) if f.name == name)
            if getattr(self, name) != default:
                raise ParamError(name, f"its default {default!r} with quant (quant replaces bits, format and "
                                 "granularity; keep_bits stays the logits' axis)", getattr(self, name))

    def spec(self, layers=None, bits: int | None = None) -> QuantSpec:
        """The quantization of some layers: ``quant`` when given, else the logits at a width.

        Args:
            layers: the layers; None: all.
            bits: the logits' width (the kept layers' ``keep_bits`` are always the logits'); None: ``bits``."""
        if self.quant is not None and bits is None:
            return QuantSpec.parse(self.quant).with_layers(layers)
        return build_spec(self.bits if bits is None else bits, self.format, self.granularity, layers)
