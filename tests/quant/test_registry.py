"""The format registry: every registered format parses, prints and quantizes per its entry, and no module outside
outlierscope.quant.numerics compares a format name with a literal."""

import ast
from pathlib import Path

import pytest
import torch

from outlierscope.errors import OutlierscopeError
from outlierscope.quant.numerics.registry import FORMATS, Block, Grid, Kernel, format_named, read_format
from outlierscope.quant.specs.parts import GRANULARITIES, TensorQuant, parse_part

PKG = Path(__file__).resolve().parents[2] / "outlierscope"
HOME = PKG / "quant" / "numerics"  # the formats' arithmetic and their registry


def _named(node) -> bool:
    """Whether an expression names a format: ``p.format``, ``fmt``, ``tq.format``, ``format``."""
    text = ast.unparse(node)
    return "format" in text or "fmt" in text


def _literals(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {s for e in node.elts for s in _literals(e)}
    return set()


def format_comparisons(path: Path) -> list[str]:
    """``file:line`` of each comparison of a format-naming expression with a registered format's name."""
    names, hits = set(FORMATS), []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if any(_named(s) for s in sides) and any(_literals(s) & names for s in sides):
            hits.append(f"{path.relative_to(PKG)}:{node.lineno}: {ast.unparse(node)}")
    return hits


def test_no_module_outside_the_registry_compares_format_names(tmp_path):
    hits = [h for p in sorted(PKG.rglob("*.py")) if HOME not in p.parents for h in format_comparisons(p)]
    assert not hits, hits
    planted = tmp_path / "x.py"  # the scan finds what it looks for
    planted.write_text("def f(tq):\n    return tq.format in MX_FORMATS or tq.format == 'nvfp4'\n")
    assert len(format_comparisons_at(planted)) == 1


def format_comparisons_at(path: Path) -> list[str]:
    global PKG
    old, PKG = PKG, path.parent
    try:
        return format_comparisons(path)
    finally:
        PKG = old


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_format_parses_and_prints_on_each_of_its_targets(name):
    fmt = format_named(name)
    for target in fmt.targets:
        bits = fmt.bits[0] if fmt.bits else None
        kind = target if target in ("logits", "probs", "a", "w") else "qkv"
        gran = (GRANULARITIES[kind][0] + (":32" if GRANULARITIES[kind][0] in ("per_group", "per_block") else "")
                if fmt.granular else None)
        text = f"{target}={fmt.text(bits)}" + (f"/{gran}" if gran else "")
        (tq,) = parse_part(text)
        assert str(tq) == text and tq.fmt is fmt and tq.nominal_bits == (bits or fmt.nominal)
    outside = [t for t in ("logits", "q", "probs", "a", "w") if t not in fmt.targets]
    for target in outside:
        with pytest.raises(OutlierscopeError, match=f"^{target}: "):
            TensorQuant(target, name, fmt.bits[0] if fmt.bits else None, None)


def test_read_format_and_its_errors():
    assert read_format("int4") == (FORMATS["int"], 4) and read_format("e4m3") == (FORMATS["e4m3"], None)
    with pytest.raises(OutlierscopeError, match="int needs its bits: int2 to int8"):
        read_format("int")
    with pytest.raises(OutlierscopeError, match="did you mean nvfp4"):
        read_format("nvfp5")
    with pytest.raises(OutlierscopeError, match="no bits setting"):
        TensorQuant("a", "e4m3", 8, "per_token")


def test_format_arithmetic_is_the_primitives():
    """Each kind's quantize is the primitive it names, computed here independently: int4 per row by hand, an MX block
    by its OCP rule (E8M0 scale 2^(floor(log2 amax) - emax), E2M1 elements), bitsandbytes' kernels not emulated."""
    x = torch.tensor([[0.1, -0.7, 0.35, 1.4]], dtype=torch.float64)
    scale = 1.4 / 7  # int4: absmax / (2^3 - 1)
    want = torch.round(x / scale).clamp(-7, 7) * scale
    assert torch.equal(FORMATS["int"].quantize(x, (1,), None, 4), want)
    mx = FORMATS["mxfp4"]
    assert isinstance(mx, Block) and mx.block == 32 and not mx.granular
    block = torch.zeros(1, 32, dtype=torch.float64)
    block[0, :4] = x[0]
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    s = 2.0 ** (0 - 2)  # floor(log2 1.4) = 0, emax of E2M1 = 2
    mag = (block.abs() / s)[..., None]
    nearest = e2m1[(mag - e2m1).abs().argmin(-1)]  # no ties among these values
    assert torch.equal(mx.blocks(block), torch.sign(block) * nearest * s)
    assert isinstance(FORMATS["e4m3"], Grid) and isinstance(FORMATS["bnb-nf4"], Kernel)
    with pytest.raises(OutlierscopeError, match="brings its own kernels"):
        FORMATS["bnb-nf4"].quantize(x, (1,), None, None)
