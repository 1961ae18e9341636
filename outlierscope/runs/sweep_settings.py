"""The settings of a sweep (``outlierscope sweep``), one frozen dataclass: every field a CLI flag of the same name,
checked on construction, written to the run's record (``SweepSettings``)."""

from __future__ import annotations

from dataclasses import dataclass

from outlierscope.analysis.attention_error import measured_spec
from outlierscope.errors import OutlierscopeError, ParamError, check_seed
from outlierscope.eval.evaluate import select_items, subset_items
from outlierscope.models.loading import (
    attn_block_option,
    check_placement,
    device_map_option,
    device_option,
    dtype_option,
    fused_option,
    trust_remote_code_option,
)
from outlierscope.models.presets import DEFAULT_PAIR
from outlierscope.quant.numerics.names import GRANULARITIES, UNQUANTIZED_BITS, WEIGHT_MODES
from outlierscope.quant.numerics.registry import logits_formats
from outlierscope.quant.specs.spec import QuantSpec, build_spec, layers_option
from outlierscope.runs.cells import DEFAULT_BATCH
from outlierscope.runs.perplexity import length_option, max_windows_option, protocol_option
from outlierscope.settings import check_defaults, option


def _bits_order(s) -> list[int]:
    return sorted(set(s.bits) | {UNQUANTIZED_BITS}, key=lambda b: -b)  # the 16-bit reference first


@dataclass(frozen=True)
class SweepSettings:
    """Settings of a sweep (``outlierscope sweep``): models x quantization specs x tasks, each pair a resumable cell.
    Each field is a CLI flag of the same name (its help is the field's ``option`` text); the record holds them all
    and a rerun into the same ``out`` resumes only with the same settings (``force`` to change them)."""

    models: tuple[str, ...] = option(DEFAULT_PAIR, "Hub id (ORG/NAME[@REVISION]), HF model directory, .gguf file, preset role or fetched model; repeat",
                                     flag="--model", repeat=True, metavar="SPEC")
    bits: tuple[int, ...] = option((16, 8, 6, 4), "bit widths; 16 = unquantized")
    format: str = option("int", "int absmax or FP8 (bits 8)", choices=logits_formats())
    granularity: str = option("per_tensor", "one scale per sequence and layer / per head / per query row",
                              choices=GRANULARITIES)
    quant: tuple[str, ...] = option((), "also: an attention recipe or spec (q/k/v/P/KV cache; see `outlierscope "
                                    "recipes`), e.g. sage2-int4 or 'k=int4/per_group:32'; repeat; --bits stays the "
                                    "logits' axis", flag="--quant", repeat=True, metavar="RECIPE_OR_SPEC")
    weights: str = option("none", "bitsandbytes weights in every cell (adds w=bnb-int8 or w=bnb-nf4 to each spec)", choices=WEIGHT_MODES)
    layers: tuple[int, ...] | None = option(None, "quantize only these layers, e.g. 0-3 or 0,2 (default all)",
                                            parse=layers_option)
    limit: int | None = option(None, "first N validation items of each task (all of a task with fewer)",
                               exclusive="items")
    sample: int | None = option(None, "N items of each task drawn at random (with --seed; all of a task with fewer)",
                                exclusive="items")
    seed: int = option(0, "seeds --sample and the bootstrap")
    tasks: tuple[str, ...] = option(("hellaswag",), "hellaswag or a zero-shot task (see `outlierscope tasks`); repeat "
                                    "for several; `paper` = the paper's seven, `all` = every task", flag="--task",
                                    repeat=True, metavar="TASK")
    data: str | None = option(None, "HellaSwag .jsonl (official format) or .arrow file (default: the cached "
                              "validation set)")
    text: str | None = option(None, "held-out .txt/.jsonl(.xz) text: also report LM loss (nats/token) per setting")
    text_tokens: int = option(65_536, "tokens of --text to use")
    kld_text: str | None = option(None, "also score every cell on this running text as `perplexity --text` does "
                                  "(lambada, a file, a dataset ORG/NAME:CONFIG:SPLIT): mean KL divergence to the "
                                  "unquantized model, PPL and the NLL change with intervals over windows, per model "
                                  "in text/ and together in text.csv")
    kld_protocol: str = protocol_option()
    kld_length: int | None = length_option()
    kld_max_windows: int | None = max_windows_option()
    batch_size: int = option(DEFAULT_BATCH, "(context, ending) sequences per forward; quantized scores depend on it by float32 "
                             "rounding (part of a quantized cell's identity); 1 is exactly batch-invariant, ~2x slower")
    dtype: str = dtype_option()
    device: str = device_option()
    device_map: str | None = device_map_option()
    attn_block: int | None = attn_block_option()
    fused: bool = fused_option()
    attn_error: bool = option(False, "also measure per layer and head what quantization does to attention (KL, "
                              "argmax changes, output error) into attn_error.csv, for the logits cells and the --quant cells, "
                              "and per layer and linear each quantized linear's relative output error into "
                              "linear_error.csv; costs 2-5x the time of a cell; split over processes and shards like the "
                              "scores")
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self):
        check_seed(self.seed)
        from outlierscope.data.tasks import expand_tasks

        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "bits", tuple(self.bits))
        names = (self.tasks,) if isinstance(self.tasks, str) else tuple(self.tasks)
        dup = sorted({t for t in names if names.count(t) > 1})
        if dup:
            raise ParamError("tasks", "distinct task names", list(names), f"{dup[0]} is given twice")
        # the suites expanded (and every name checked) here: the record holds the tasks that ran
        object.__setattr__(self, "tasks", expand_tasks(names))
        if not self.models:
            raise ParamError("models", "at least one model spec (two for a side-by-side sweep)", ())
        dup = sorted({m for m in self.models if self.models.count(m) > 1})
        if dup:
            raise ParamError("models", "distinct model specs", list(self.models), f"{dup[0]} is given twice")
        check_placement(self.device, self.dtype, self.device_map, self.attn_block, self.fused)
        if not self.tasks:
            raise ParamError("tasks", "at least one task (hellaswag or one of `outlierscope tasks`)", ())
        if self.data is not None and "hellaswag" not in self.tasks:
            raise ParamError("data", "None unless the tasks include hellaswag (the other tasks' rows come from the cache)",
                             self.data)
        if self.weights not in WEIGHT_MODES:
            raise ParamError("weights", f"one of {', '.join(WEIGHT_MODES)}", self.weights)
        for n, v in (("limit", self.limit), ("sample", self.sample)):  # per task; a task with fewer rows: all
            if v is not None and v < 1:
                raise ParamError(n, ">= 1", v)
        if self.limit is not None and self.sample is not None:
            raise OutlierscopeError("limit and sample exclude each other; pass one")
        if self.batch_size < 1:
            raise ParamError("batch_size", ">= 1", self.batch_size)
        if self.text_tokens < 1:
            raise ParamError("text_tokens", ">= 1", self.text_tokens)
        if not self.bits:
            raise ParamError("bits", "at least one bit width", ())
        self._check_kld()
        for b in self.bits:  # validate every spec up front: nothing runs with a bad one
            self.spec(b)
        object.__setattr__(self, "quant", tuple(self.quant))
        if self.kld_text is not None:
            self.kld_settings(self.models[0])  # protocol, length, windows and the specs as perplexity checks them
        parsed = {q: QuantSpec.parse(q) for q in self.quant}
        texts = [str(sp) for sp in parsed.values()]
        own = [q for q, sp in parsed.items() if sp.layers is not None]
        if own and self.layers is not None:  # one rule: layers applies to the specs that name none
            raise ParamError("layers", f"left out when a quant spec names its own layers ({own[0]!r}); layers applies to "
                             "the specs that name none: drop one of the two", list(self.layers))
        if self.attn_error:
            for q in self.quant:
                measured_spec(q)
        bnb = [q for q, sp in parsed.items() if sp.weights_mode != "none"]
        if bnb:
            raise ParamError("quant", "specs without bitsandbytes weights: they apply to every cell of a sweep "
                             f"(weights='{parsed[bnb[0]].weights_mode}', --weights)", bnb[0])
        linear_w = [q for q, sp in parsed.items() if sp.part("w") is not None]
        if linear_w and self.weights != "none":
            raise ParamError("weights", f"'none' with a quant spec that quantizes the weights itself ({linear_w[0]!r}): "
                             "one weight quantization at a time", self.weights)
        dup = sorted({t for t in texts if texts.count(t) > 1})
        if dup:
            raise ParamError("quant", "distinct specs", list(self.quant), f"{dup[0]} is given twice")

    def _check_kld(self) -> None:
        """The text settings only with ``kld_text``, checked as perplexity checks them; one device per model."""
        if self.kld_text is None:
            check_defaults(self, ("kld_protocol", "kld_length", "kld_max_windows"), "without kld_text")
            return
        for name, low in (("kld_length", 2), ("kld_max_windows", 1)):  # named as this command's settings
            value = getattr(self, name)
            if value is not None and value < low:
                raise ParamError(name, f">= {low}", value)
        if self.device_map is not None:
            raise ParamError("device_map", "None with kld_text (the text cells run the model on one device)",
                             self.device_map)

    def kld_settings(self, model: str):
        """The perplexity run of a model on ``kld_text``: every spec of this sweep, the same placement.

        Args:
            model: the model."""
        from outlierscope.runs.perplexity import PerplexitySettings

        return PerplexitySettings(model=model, quant=tuple(str(sp) for sp in self.specs() if not sp.is_identity),
                                  text=self.kld_text, protocol=self.kld_protocol, length=self.kld_length,
                                  max_windows=self.kld_max_windows, dtype=self.dtype, device=self.device,
                                  attn_block=self.attn_block, trust_remote_code=self.trust_remote_code)

    def spec(self, bits: int) -> QuantSpec:
        """The paper's logits spec of a bit width, in this sweep's format, granularity and layers.

        Args:
            bits: the width."""
        return build_spec(bits, self.format, self.granularity, self.layers)

    def specs(self) -> list[QuantSpec]:
        """Every cell's spec: the bit widths of the logits (16 first: the reference), then each ``quant`` (with
        ``layers`` when the spec names none). ``weights`` is not in them: each cell
        runs with it (``spec.with_weights(weights)``) and records it beside them."""
        out: list = [self.spec(b) for b in _bits_order(self)]
        for q in self.quant:
            a = QuantSpec.parse(q)
            out.append(a if a.layers is not None or self.layers is None else a.with_layers(self.layers))
        return out

    def spec_of(self, cell: dict) -> QuantSpec:
        """The spec of a cell as a record lists it: the one of ``specs`` that ran it, with its recipe name.

        Args:
            cell: the record's cell entry (``quant``: a spec's text; else its ``bits``)."""
        if cell.get("quant"):
            ran = (sp for sp in self.specs() if str(sp) == cell["quant"])
            return next(ran, None) or QuantSpec.parse(cell["quant"])
        return self.spec(cell["bits"])

    def task_items(self) -> dict[str, list]:
        """Each task's items: all rows, the first ``limit`` or a ``sample`` drawn with ``seed``, and all rows of a
        task with fewer. A ``limit``/``sample`` above every task's rows is an error (a typo, not a suite)."""
        full = {t: select_items(data=self.data if t == "hellaswag" else None, task=t) for t in self.tasks}
        n, most = self.limit or self.sample, max(len(v) for v in full.values())
        if n is not None and n > most:
            name = "limit" if self.limit else "sample"
            raise ParamError(name, f"in 1..{most} (the items of {'the largest task' if len(full) > 1 else 'the task'})", n)
        return {t: subset_items(v, self.limit, self.sample, self.seed, at_most=True) for t, v in full.items()}

    @classmethod
    def from_record(cls, settings: dict) -> SweepSettings:
        """The settings as a sweep.json holds them (lists for tuples; an older record's ``task``: one task).

        Args:
            settings: the record's settings."""
        return cls(**{k: tuple(v) if isinstance(v, list) and k in ("models", "bits", "layers", "tasks") else v
                      for k, v in _current_keys(settings).items()})


def _current_keys(settings: dict) -> dict:
    """Recorded settings with today's keys: ``task`` (one task, as sweeps recorded it before ``tasks``) -> ``tasks``."""
    d = dict(settings)
    if "task" in d:
        d.setdefault("tasks", [d.pop("task")])
    return d
