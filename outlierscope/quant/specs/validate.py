"""The checks of a ``QuantSpec`` as a whole, at construction: each target once, each
transform's cross-checks with the rest of the spec (``check``), and
bitsandbytes' weights alone. A part's own checks are its constructor's."""

from __future__ import annotations

from outlierscope.errors import OutlierscopeError

BNB_ALONE = ("smooth", "rotate", "outliers", "bnb_outliers", "linears", "calib")  # what bitsandbytes' linears refuse


def check_spec_parts(spec) -> None:
    """One-line errors where the parts of ``spec`` do not fit together.

    Args:
        spec: a just-built spec (its parts in target order, its transforms in canonical order)."""
    seen = [p.target for p in spec.parts]
    dup = sorted({t for t in seen if seen.count(t) > 1})
    if dup:
        raise OutlierscopeError(f"target {dup[0]} is quantized twice; give each target one format")
    for t in spec.transforms:
        t.check(spec)
    _check_bnb(spec)


def _check_bnb(spec) -> None:
    """bitsandbytes' weights replace every decoder linear by its own module: none of our linear emulation applies
    to them, and they do not take ``layers:``."""
    if spec.weights_mode == "none":
        return
    other = [t.key for t in spec.transforms if t.key in BNB_ALONE] + (["a="] if spec.part("a") else [])
    if other:
        raise OutlierscopeError(f"{spec.part('w')} (bitsandbytes' own linears) with {other[0]}: our linear "
                                "emulation does not apply to bitsandbytes' modules; drop one of the two")
    if spec.layers is not None:
        raise OutlierscopeError(f"{spec.part('w')} applies to every decoder layer; leave out layers: (or quantize "
                                "the weights with w=int8/per_channel, which takes layers:)")
