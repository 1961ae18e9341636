"""Every number format a spec names, as one registered object (``Format``): its name and bit widths, its kind,
block size and nominal bits, the targets and granularities it takes, the arithmetic it quantizes with and what
compressed-tensors writes for it. Consumers look a format up (``format_named``, ``read_format``); no module
outside ``outlierscope.quant.numerics`` compares format names."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.numerics.formats import (
    asym_minmax,
    mx_quant,
    nvfp4_quant,
    pad_to,
    zero_point_params,
    zero_point_quant,
)
from outlierscope.quant.numerics.names import ALL_TARGETS
from outlierscope.quant.numerics.primitives import absmax_scale, fake_quant, qmax, quantize_absmax

ATTENTION_INPUTS = ("q", "k", "v", "probs")  # the matmul inputs inside attention (no logits)


@dataclass(frozen=True)
class Format:
    """One number format.

    Attributes:
        name: its name in a spec's text (``int``: ``int4``, ``int8``...; ``e4m3``; ``mxfp4``).
        summary: one line for the reference and ``outlierscope recipes``.
        targets: the targets it applies to.
        bits: the bit widths its text takes (``(2, 8)``: ``int2`` to ``int8``); None: a fixed width (``nominal``).
        logits_bits: the widest width on logits (the paper's axis runs to 16 = unquantized).
        nominal: bits per element of a fixed-width format.
        integer: whether it rounds onto an integer grid (what GPTQ and AWQ round weights on).
        ct_kv: whether compressed-tensors writes it as a KV cache (at 8 bits).
        ct: compressed-tensors' ``QuantizationArgs`` fields of the format (None: it has no such format).
        ct_read: the fields that read back as this format (a checkpoint's config; None: only ``ct``'s).
        outside: what is said of a target it does not take.
        identity: keys the identity of a cell whose spec uses the format gains (where its arithmetic changed, so that
            cells computed before are never read back as today's)."""

    name: str
    summary: str
    targets: tuple[str, ...] = ALL_TARGETS
    bits: tuple[int, int] | None = None
    logits_bits: int | None = None
    nominal: int = 8
    integer: bool = False
    ct_kv: bool = False
    ct: dict | None = field(default=None, compare=False)
    ct_read: dict | None = field(default=None, compare=False)
    outside: str = ""
    identity: dict = field(default_factory=dict, compare=False)

    granular = True  # takes a granularity (block and library-kernel formats bring their own)
    static = False  # takes a static scale (a calibrated absmax)

    def text(self, bits: int | None) -> str:
        """The format as a spec writes it: ``int4``, ``e4m3``.

        Args:
            bits: the width, for a format that takes one."""
        return f"{self.name}{bits}" if self.bits is not None else self.name

    def nominal_bits(self, bits: int | None) -> int:
        """Bits per element.

        Args:
            bits: the width, for a format that takes one."""
        return bits if self.bits is not None else self.nominal

    def words(self, bits: int | None) -> str:
        """The format in a table's words: ``4-bit int``.

        Args:
            bits: the width, for a format that takes one."""
        return f"{self.nominal_bits(bits)}-bit {self.name}"

    def check(self, target: str, bits: int | None, granularity: str | None) -> None:
        """One-line errors for a target, width or granularity the format does not take.

        The granularity's own rules, per target, are the part's.

        Args:
            target: the tensor (``k``, ``w``, ...).
            bits: the width given (None: none).
            granularity: the granularity given."""
        if target not in self.targets:
            raise OutlierscopeError(f"{target}: " + (self.outside or f"{self.name} applies to "
                                                     f"{' and '.join(t + '=' for t in self.targets)} only"))
        if self.bits is None:
            if bits is not None:
                raise OutlierscopeError(f"{target}: format {self.name} has no bits setting")
        else:
            lo, hi = self.bits[0], self.logits_bits if target == "logits" and self.logits_bits else self.bits[1]
            if not isinstance(bits, int) or isinstance(bits, bool) or not lo <= bits <= hi:
                raise OutlierscopeError(f"{target}: {self.name} needs bits in {lo}..{hi}, got {bits!r}")
        if not self.granular and granularity is not None:
            raise OutlierscopeError(f"{target}: {self.name} brings its own blocks; leave out the granularity")
        if granularity == "static" and not self.static:
            raise OutlierscopeError(f"{target}: static scales need a symmetric format (int or FP8)")

    def quantize(self, x, dims: tuple, valid, bits: int | None):
        """``x`` quantized-dequantized with one scale per granule, valid entries only.

        Args:
            x: the tensor.
            dims: the dimensions each granule reduces.
            valid: bool, broadcastable to ``x``; None: all.
            bits: the width, for a format that takes one."""
        raise OutlierscopeError(f"{self.name} has no emulation over granules; it brings its own kernels")

    def quantize_static(self, x, amax, bits: int | None, valid=None):
        """``x`` quantized-dequantized with the scale of a given absmax, valid entries only.

        Args:
            x: the tensor.
            amax: the calibrated absmax.
            bits: the width, for a format that takes one.
            valid: bool, broadcastable to ``x``; None: all."""
        raise OutlierscopeError(f"{self.name}: static scales need a symmetric format (int or FP8)")

    def ct_args(self, part) -> dict:
        """compressed-tensors' fields of this format for a part (its granularity's fields are the exporter's).

        Args:
            part: the ``TensorQuant``.

        Raises:
            OutlierscopeError: a format compressed-tensors does not write, naming the spellings it does."""
        if self.ct is None:
            raise OutlierscopeError(f"{part}: compressed-tensors has no {self.name} format (it takes fintN, zintN, e4m3, "
                                    f"{', '.join(f.name for f in FORMATS.values() if isinstance(f, Block) and f.ct)}); "
                                    "export a spec in one of those")
        return {k: (part.bits if v is None else v) for k, v in self.ct.items()}


@dataclass(frozen=True)
class Grid(Format):
    """A symmetric absmax grid: the restricted integer grid, the full-range one, or an FP8 format.

    The restricted ``int`` scales by absmax / (2^(b-1) - 1); the full-range ``fint`` is compressed-tensors' and
    torchao's; ``e4m3`` and ``e5m2`` are FP8.

    Attributes:
        grid: the grid's name in ``outlierscope.quant.numerics.primitives``.
        restricted: the restricted integer grid, which compressed-tensors does not write."""

    grid: str = "int"
    restricted: bool = False

    static = True

    def _bits(self, bits: int | None) -> int:
        return bits if self.bits is not None else 8

    def words(self, bits: int | None) -> str:
        return f"{bits}-bit {self.name}" if self.bits is not None else f"fp8 {self.name}"

    def quantize(self, x, dims, valid, bits):
        return quantize_absmax(x, self._bits(bits), dims, valid, self.grid)

    def quantize_static(self, x, amax, bits, valid=None):
        scale = amax / qmax(self._bits(bits), self.grid)
        if not isinstance(scale, torch.Tensor):  # a given number (P's 1): its scale as the work dtype's tensor
            scale = torch.tensor(scale, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
        return fake_quant(x, scale, self._bits(bits), self.grid, valid)

    def scale_params(self, w, bits: int, dims: tuple):
        """Each granule's ``(scale, None)`` for GPTQ and AWQ; a granule of zeros takes absmax 1.

        Args:
            w: the weight.
            bits: the width.
            dims: the dims each granule reduces (keepdim)."""
        s = absmax_scale(w, bits, dims, fmt=self.grid)
        return torch.where(s > 0, s, torch.ones_like(s) / qmax(bits, self.grid)), None

    def round(self, x, params: tuple, bits: int):
        """``x`` onto the grid of given parameters.

        Args:
            x: the tensor.
            params: ``scale_params``'s, broadcastable to ``x``.
            bits: the width."""
        return fake_quant(x, params[0], bits, self.grid)

    def ct_args(self, part):
        if self.restricted:
            b = part.bits
            raise OutlierscopeError(f"{part}: {part.format_text} is the restricted grid (absmax / {2 ** (b - 1) - 1}), "
                                    "which compressed-tensors does not write: its int grid is the full-range one "
                                    f"(absmax / {(2 ** b - 1) / 2}); measure and export {part.target}=fint{b}"
                                    + (f"/{part.granularity}" if part.granularity else "")
                                    + (f":{part.size}" if part.size else ""))
        return super().ct_args(part)


@dataclass(frozen=True)
class Asym(Format):
    """Asymmetric min-max integers with a float zero point (KIVI's caches)."""

    def quantize(self, x, dims, valid, bits):
        return asym_minmax(x, valid, dims, bits)

    def ct_args(self, part):
        raise OutlierscopeError(f"{part}: {part.format_text}'s zero point is a float here (min-max); compressed-tensors "
                                "rounds it to an integer, another grid; export a symmetric fint or FP format")


@dataclass(frozen=True)
class ZeroPoint(Format):
    """Integers with an integer zero point over [min(min, 0), max(max, 0)] (GPTQ and AWQ checkpoints' ``sym=False``)."""


    def quantize(self, x, dims, valid, bits):
        return zero_point_quant(x, *zero_point_params(x, bits, dims), bits)

    def scale_params(self, w, bits: int, dims: tuple):
        """Each granule's ``(scale, zero point)`` for GPTQ and AWQ.

        Args:
            w: the weight.
            bits: the width.
            dims: the dims each granule reduces (keepdim)."""
        return zero_point_params(w, bits, dims)

    def round(self, x, params: tuple, bits: int):
        """``x`` onto the grid of given parameters.

        Args:
            x: the tensor.
            params: ``scale_params``'s, broadcastable to ``x``.
            bits: the width."""
        return zero_point_quant(x, params[0], params[1], bits)


@dataclass(frozen=True)
class Block(Format):
    """A block format: ``block`` consecutive elements along the last dim share a scale (OCP MX; NVFP4 under a
    per-tensor global scale: ``global_scale``).

    Attributes:
        block: elements per block.
        global_scale: whether a per-tensor amax scales the block scales (NVFP4).
        ocp_of: for an MX format compressed-tensors writes with its own scale rounding, the OCP format it differs from.
        ct_dynamic: compressed-tensors' fields for dynamic activations (NVFP4: local block scales)."""

    block: int = 32
    global_scale: bool = False
    ocp_of: str | None = None
    ct_dynamic: dict | None = field(default=None, compare=False)

    granular = False

    def blocks(self, x, amax=None):
        """``x`` quantized-dequantized in blocks along its last dim (zero-padded to whole blocks, then cut back).

        Args:
            x: the tensor.
            amax: the per-tensor absmax of a global scale (NVFP4), broadcasting to ``x`` without its last dim."""
        xp = pad_to(x, -1, self.block)
        out = nvfp4_quant(xp, amax) if self.global_scale else mx_quant(xp, self.name)
        return out[..., : x.shape[-1]]

    def ct_args(self, part):
        ct = next((f for f in FORMATS.values() if isinstance(f, Block) and f.ocp_of == self.name), None)
        if ct is not None:
            raise OutlierscopeError(f"{part}: {self.name} is OCP's MX scale (floor(log2 max)), which compressed-tensors "
                                    "does not write: its MX rounds a block's max to a power of two first (up from "
                                    f"mantissa 1.75); measure and export {part.target}={ct.name}")
        return super().ct_args(part)


@dataclass(frozen=True)
class Kernel(Format):
    """A library's own quantized kernels (bitsandbytes' ``Linear8bitLt``, ``Linear4bit``), run by it, not emulated.

    Attributes:
        grid: the grid it computes on, where it is one (bitsandbytes' int8 rows: ``int``)."""

    grid: str | None = None

    granular = False

    def words(self, bits):
        return f"{self.nominal}-bit {self.name}"


FORMATS: dict[str, Format] = {}


def register_format(fmt: Format) -> Format:
    """Add ``fmt`` to the registry (a name already there is an error); returns it.

    Args:
        fmt: the format."""
    if fmt.name in FORMATS:
        raise ValueError(f"format {fmt.name!r} is registered already")
    FORMATS[fmt.name] = fmt
    return fmt


def format_named(name: str) -> Format:
    """The registered format ``name``; a one-line error with the near names otherwise.

    Args:
        name: the format's name (``int``, ``e4m3``, ``mxfp4``)."""
    if name in FORMATS:
        return FORMATS[name]
    import difflib

    close = difflib.get_close_matches(name, list(FORMATS), n=3)
    raise OutlierscopeError(f"unknown format {name!r}; expected one of {', '.join(spellings())}"
                            + (f"; did you mean {', '.join(close)}?" if close else ""))


def read_format(text: str) -> tuple[Format, int | None]:
    """(format, bits) of a format as a spec writes it (``int4`` -> int, 4; ``e4m3`` -> e4m3, None).

    Args:
        text: the format's text."""
    if text in FORMATS and FORMATS[text].bits is None:
        return FORMATS[text], None
    stem = text.rstrip("0123456789")
    if stem != text and stem in FORMATS and FORMATS[stem].bits is not None:
        return FORMATS[stem], int(text[len(stem):])
    if text in FORMATS:  # a width-taking format without its width
        fmt = FORMATS[text]
        raise OutlierscopeError(f"{text} needs its bits: {text}{fmt.bits[0]} to {text}{fmt.bits[1]}")
    return format_named(text), None


def spelling(fmt: Format) -> str:
    """The format as a spec writes it, with its range of widths: ``int2..int8``, ``e4m3``.

    Args:
        fmt: the format."""
    return f"{fmt.name}{fmt.bits[0]}..{fmt.name}{fmt.bits[1]}" if fmt.bits else fmt.name


def spellings() -> list[str]:
    """Every registered format as a spec writes it, for errors and the reference."""
    return [spelling(f) for f in FORMATS.values()]


def integer_formats() -> tuple[str, ...]:
    """The formats that round onto an integer grid (what GPTQ and AWQ round weights on)."""
    return tuple(f.name for f in FORMATS.values() if f.integer)


def logits_formats() -> tuple[str, ...]:
    """The formats of the paper's logits keyword form (``--format``): symmetric grids that take logits."""
    return tuple(f.name for f in FORMATS.values() if isinstance(f, Grid) and "logits" in f.targets)


def format_of_ct_args(args: dict) -> tuple[Format, int | None]:
    """(format, bits) of compressed-tensors ``QuantizationArgs`` fields: the block format whose fields they hold, else
    the format whose ``ct_read`` fields they hold; a one-line error otherwise.

    Args:
        args: the fields (``num_bits``, ``type``, ``symmetric``, ``group_size``, ``strategy``)."""
    keys = ("num_bits", "type", "group_size", "strategy")
    for f in FORMATS.values():
        if isinstance(f, Block) and f.ct is not None and all(args.get(k) == f.ct.get(k) for k in keys):
            return f, None
    given = {"symmetric": True, **args}
    for f in FORMATS.values():
        if f.ct_read is not None and all(given.get(k) == v for k, v in f.ct_read.items()):
            return f, args.get("num_bits") if f.bits is not None else None
    blocks = ", ".join(f.name for f in FORMATS.values() if isinstance(f, Block) and f.ct)
    raise OutlierscopeError(f"compressed-tensors arguments {args} have no emulation here (expected int, FP8 E4M3, "
                            f"{blocks})")


def _mx(name: str, nominal: int, summary: str, ocp_of: str | None = None, ct: dict | None = None) -> Block:
    return Block(name, summary, targets=(*ATTENTION_INPUTS, "a", "w"), nominal=nominal, block=32, ocp_of=ocp_of, ct=ct,
                 outside="block formats apply to the matmul inputs (q, k, probs, v), not to logits")


_CT_MX = {"type": "float", "group_size": 32, "strategy": "group", "scale_dtype": "torch.uint8", "symmetric": True}
_LOGITS = "symmetric formats only (int or FP8), as the paper's absmax"
for _f in (
    Grid("int", "symmetric integers on the restricted grid [-(2^(b-1) - 1), 2^(b-1) - 1], absmax / (2^(b-1) - 1) "
         "(SmoothQuant's, bitsandbytes', vLLM's dynamic kernels; the paper's)", bits=(2, 8), logits_bits=15,
         integer=True, ct_kv=True, grid="int", restricted=True),
    Grid("fint", "symmetric integers on the full-range grid [-2^(b-1), 2^(b-1) - 1], absmax / ((2^b - 1) / 2) "
         "(compressed-tensors', torchao's)", targets=("q", "k", "v", "a", "w"), bits=(2, 8), integer=True, ct_kv=True,
         ct={"num_bits": None, "type": "int", "symmetric": True}, ct_read={"type": "int", "symmetric": True},
         grid="fint", outside="fint (the full-range grid of compressed-tensors and torchao) is for a=, w=, q, k and v "
                              "parts; use int here"),
    Asym("asym", "asymmetric min-max integers with a float zero point (KIVI's caches)",
         targets=("q", "k", "v", "probs", "a", "w"), bits=(2, 8), ct_read={"type": "int", "symmetric": False},
         outside=_LOGITS),
    ZeroPoint("zint", "integers with an integer zero point (GPTQ and AWQ checkpoints' sym=False)", targets=("w",),
              bits=(2, 8), integer=True, ct={"num_bits": None, "type": "int", "symmetric": False},
              outside="zint (GPTQ's integer zero point) is a weight grid; use it in w="),
    Grid("e4m3", "FP8 E4M3 (OCP, max 448)", ct_kv=True, ct={"num_bits": 8, "type": "float", "symmetric": True},
         ct_read={"type": "float", "num_bits": 8}, grid="e4m3"),
    Grid("e5m2", "FP8 E5M2 (max 57344)", grid="e5m2"),
    _mx("mxfp8_e4m3", 8, "OCP MX v1.0 MXFP8 E4M3: 32-element blocks, an E8M0 scale"),
    _mx("mxfp8_e5m2", 8, "OCP MX v1.0 MXFP8 E5M2"),
    _mx("mxfp6_e3m2", 6, "OCP MX v1.0 MXFP6 E3M2"),
    _mx("mxfp6_e2m3", 6, "OCP MX v1.0 MXFP6 E2M3"),
    _mx("mxfp4", 4, "OCP MX v1.0 MXFP4 (E2M1 elements)"),
    _mx("mxint8", 8, "OCP MX v1.0 MXINT8 (8-bit fixed-point elements)"),
    _mx("ct-mxfp4", 4, "compressed-tensors' MXFP4 (a block max rounded to a power of two first)", ocp_of="mxfp4",
        ct={"num_bits": 4, **_CT_MX}),
    _mx("ct-mxfp8_e4m3", 8, "compressed-tensors' MXFP8 E4M3", ocp_of="mxfp8_e4m3", ct={"num_bits": 8, **_CT_MX}),
    Block("nvfp4", "NVIDIA NVFP4: 16-element blocks of E2M1, an E4M3 block scale under a float32 global scale "
          "(compressed-tensors' order of operations)", targets=(*ATTENTION_INPUTS, "a", "w"), nominal=4, block=16,
          global_scale=True, ct={"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group",
                                 "scale_dtype": "torch.float8_e4m3fn", "symmetric": True},
          ct_dynamic={"dynamic": "local", "observer": "static_minmax"}, identity={"nvfp4": "compressed-tensors-order"},
          outside="block formats apply to the matmul inputs (q, k, probs, v), not to logits"),
    Kernel("bnb-int8", "bitsandbytes' LLM.int8 weights (Linear8bitLt) or int8 rows of the logits",
           targets=("w", "logits"), nominal=8, grid="int", outside="bnb-int8 (bitsandbytes) applies to w= and logits= only"),
    Kernel("bnb-nf4", "bitsandbytes' NF4 weights (Linear4bit)", targets=("w",), nominal=4,
           outside="bnb-nf4 (bitsandbytes) applies to w= only"),
):
    register_format(_f)
