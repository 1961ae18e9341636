"""The machinery of layer-by-layer calibration shared by GPTQ and AWQ (``gptq_model``,
``awq_model``): the calibration sequences, decoder layer 0's inputs (the forward stopped there),
one layer run on every sequence, the next layer's inputs, the groups of linears reading one input tensor, and a
rounded weight held in place by a parametrization while the pass goes on.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from outlierscope.data.text import LAMBADA_TAIL
from outlierscope.errors import OutlierscopeError, ParamError
from outlierscope.hooks.points import decoder_layers
from outlierscope.models.float64 import float64_model

DEFAULT_CALIB = LAMBADA_TAIL  # LAMBADA's test passages from the last one back (outlierscope.data.text)


class Fixed(nn.Module):
    """The parametrization ``W -> a given tensor``: a rounded weight in place while a calibration pass goes on.

    Args:
        w: the weight to put in place."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = w

    def forward(self, _):
        return self.w


class _Stop(Exception):
    """Raised by the pre-hook that records layer 0's inputs: nothing above it runs."""


def calibration_sequences(tokenizer, source: str | None, cfg, ctx: int | None) -> torch.Tensor:
    """The calibration sequences: ``cfg.samples`` of ``cfg.seqlen`` tokens of a text, packed with EOS between documents.

    Args:
        tokenizer: the model's tokenizer.
        source: the text (``calib:SOURCE``); None: ``DEFAULT_CALIB``.
        cfg: the ``GPTQConfig`` or ``AWQConfig`` (samples, seqlen).
        ctx: the model's context length, which caps seqlen; None: none.

    Returns:
        ``(N, T)`` int64; fewer than ``cfg.samples`` sequences with a warning when the text gives fewer.

    Raises:
        OutlierscopeError: a text too short for one sequence, naming it."""
    import warnings

    from outlierscope.data.text import pack_sequences, text_documents

    kind = type(cfg).__name__.removesuffix("Config").lower()  # gptq / awq: the spec's part naming these settings
    seqlen = min(cfg.seqlen, ctx) if ctx else cfg.seqlen
    where = f"calib:{source}" if source else f"the default calibration text ({DEFAULT_CALIB})"
    try:
        seqs = pack_sequences(tokenizer, text_documents(source or DEFAULT_CALIB), seqlen, cfg.samples * seqlen)
    except ParamError:
        raise OutlierscopeError(f"{where}: too short: fewer tokens than one sequence of {kind}:seqlen={seqlen}; give a "
                                f"longer text or a smaller {kind}:seqlen") from None
    if len(seqs) < cfg.samples:
        warnings.warn(f"{where} gives {len(seqs)} sequences of {seqlen} tokens, fewer than {kind}:samples="
                      f"{cfg.samples}: calibrating on {len(seqs)} (give a longer text for {cfg.samples})", stacklevel=2)
    return seqs


def layer_inputs(model: nn.Module, seqs: torch.Tensor) -> list[tuple[tuple, dict]]:
    """Every sequence's ``(args, kwargs)`` of decoder layer 0, the forward stopped there.

    Args:
        model: the model.
        seqs: token ids ``(N, T)``."""
    layer0, got = decoder_layers(model)[0], []

    def pre(mod, args, kwargs):
        got.append((args, kwargs))
        raise _Stop

    handle = layer0.register_forward_pre_hook(pre, with_kwargs=True)
    dev = next(model.parameters()).device
    try:
        for row in seqs:
            try:
                with float64_model(model):
                    model(input_ids=row[None].to(dev), attention_mask=torch.ones_like(row[None]).to(dev), use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return got


def run_layer(layer: nn.Module, inputs: list[tuple[tuple, dict]]) -> list[torch.Tensor]:
    """The layer's hidden-state output for each input.

    Args:
        layer: a decoder layer.
        inputs: ``(args, kwargs)`` of each sequence."""
    outs = []
    for args, kwargs in inputs:
        with float64_model(layer):
            out = layer(*args, **kwargs)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


def run_until(layer: nn.Module, inputs: list[tuple[tuple, dict]], modules: list[nn.Module]) -> None:
    """Run the layer on each input only until every module of ``modules`` has run once (the rest skipped).

    Args:
        layer: a decoder layer.
        inputs: ``(args, kwargs)`` of each sequence.
        modules: the modules whose inputs a pass records."""
    seen: set[int] = set()

    def post(mod, args, out):
        seen.add(id(mod))
        if len(seen) == len(modules):
            raise _Stop

    handles = [m.register_forward_hook(post) for m in modules]
    try:
        for args, kwargs in inputs:
            seen.clear()
            try:
                with float64_model(layer):
                    layer(*args, **kwargs)
            except _Stop:
                pass
    finally:
        for h in handles:
            h.remove()


def next_inputs(layer: nn.Module, inputs: list[tuple[tuple, dict]]) -> list[tuple[tuple, dict]]:
    """The next layer's inputs: this layer's outputs in the hidden states' place, the rest (positions, mask) kept.

    Args:
        layer: a decoder layer.
        inputs: its ``(args, kwargs)`` of each sequence."""
    out = []
    for h, (args, kwargs) in zip(run_layer(layer, inputs), inputs):
        out.append(((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h}))
    return out


def linear_calls(layer: nn.Module, linears: dict[str, nn.Linear], first: tuple[tuple, dict]) -> list[tuple[str, int]]:
    """The calls of a layer's linears in the order one forward makes them; a linear called twice is listed twice.

    Args:
        layer: a decoder layer.
        linears: path -> module.
        first: one input ``(args, kwargs)``.

    Returns:
        ``(path, the identity of the input tensor it read)`` per call."""
    calls: list[tuple[str, int]] = []
    seen: list[torch.Tensor] = []  # the inputs, held so that no later tensor takes their memory and identity
    handles = [m.register_forward_pre_hook(lambda mod, args, p=p: calls.append((p, id(args[0]))) or seen.append(args[0]))
               for p, m in linears.items()]
    try:
        run_layer(layer, [first])
    finally:
        for h in handles:
            h.remove()
    return calls


def subsets_of(calls: list[tuple[str, int]]) -> list[list[str]]:
    """The linears in call order, those reading one input tensor together (q/k/v, gate/up); a repeat keeps its place.

    Args:
        calls: ``linear_calls``' calls."""
    out: list[list[str]] = []
    placed: set[str] = set()
    for i, (p, x) in enumerate(calls):
        if p in placed:  # a linear called again in the same forward: its first call placed it
            continue
        placed.add(p)
        if out and x == calls[i - 1][1]:
            out[-1].append(p)
        else:
            out.append([p])
    return out


def input_subsets(layer: nn.Module, linears: dict[str, nn.Linear], first: tuple[tuple, dict]) -> list[list[str]]:
    """A layer's linears in the order its forward calls them, those reading one input tensor together (q/k/v, gate/up).

    Args:
        layer: a decoder layer.
        linears: path -> module.
        first: one input ``(args, kwargs)``, run once to find them."""
    return subsets_of(linear_calls(layer, linears, first))


def _checkpoint_path(directory, kind: str, model: nn.Module, seqs: torch.Tensor, spec, sites: list):
    """Where a calibration keeps its finished layers: ``directory/KIND-HASH.pt``, the hash of what the calibration
    reads: the spec's ``w=`` part and its gptq / awq settings (not its ``a=`` or attention parts: the pass runs the
    float model, so W4A8 with GPTQ reuses W4A16's layers), the model's name and dtype, the linears (``layers:`` and
    ``linears:`` choose them) and the calibration tokens (another model or text: another file)."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    cfg = getattr(model, "config", None)
    reads = f"{spec.part('w')}|{spec.gptq}|{spec.awq}"
    if kind == "awq" and _partial_layers(model, sites):  # part of a layer's groups: scales of those groups alone
        reads += "|awq-partial-groups"
    if kind == "gptq":  # the damping is the mean of a contiguous copy of the diagonal (GPT-QModel's order)
        reads += "|contiguous-damping-mean"
    h.update(f"{kind}|{reads}|{getattr(cfg, '_name_or_path', '')}|{next(model.parameters()).dtype}|".encode())
    h.update("|".join(s.name for s in sites).encode())
    h.update(seqs.cpu().numpy().tobytes())
    return Path(directory) / f"{kind}-{h.hexdigest()[:16]}.pt", h.hexdigest()


def _partial_layers(model: nn.Module, sites: list) -> bool:
    """Whether ``sites`` quantize some but not all linears of a decoder layer (the LM head aside)."""
    layers = decoder_layers(model)
    chosen: dict[int, set] = {}
    for s in sites:
        if s.layer < len(layers):
            chosen.setdefault(s.layer, set()).add(s.path)
    return any(sum(isinstance(m, nn.Linear) for m in layers[i].modules()) != len(paths) for i, paths in chosen.items())


def _load_layers(path, key: str) -> dict:
    """The finished layers a checkpoint holds (layer -> path -> fields), or none (no file, or another key); a file
    whose content does not match its digest (cut, changed, or written before digests) is calibrated again with one
    warning saying so."""
    import warnings

    from outlierscope.io import Damaged, load_torch_checked

    if path is None or not path.exists():
        return {}
    try:
        state = load_torch_checked(path)
    except (Damaged, Exception) as e:  # noqa: BLE001 - torch.load raises many types for a foreign payload
        why = str(e) if isinstance(e, Damaged) else f"{path}: not readable ({type(e).__name__})"
        warnings.warn(f"{why}; calibrating those layers again (the file is rewritten)", stacklevel=2)
        return {}
    return state["layers"] if isinstance(state, dict) and state.get("key") == key else {}


def _save_layers(path, key: str, layers: dict) -> None:
    """Every finished layer, written atomically behind its digest (a file cut by a kill is never read; processes of
    one run each write their own temporary file, the same content)."""
    from outlierscope.io import save_torch_checked

    save_torch_checked(path, {"key": key, "layers": layers})


@torch.no_grad()
def layerwise(model: nn.Module, seqs: torch.Tensor, spec, sites: list, kind: str, calibrate_layer, weight_of,
              result_type, progress: bool = True, checkpoint_dir=None, alone: bool = False) -> dict:
    """A layer-by-layer calibration (GPTQ's and AWQ's); the model comes back as it was.

    Layer 0's inputs are recorded for every sequence; each decoder layer holding linears of ``sites`` is calibrated,
    then the next layer's inputs run through the quantized layer. With ``checkpoint_dir`` every finished layer is
    saved and a rerun continues after the last one saved (no forward at all when every layer is).

    Args:
        model: the model.
        seqs: calibration token ids ``(N, T)``.
        spec: the spec.
        sites: the quantized linears.
        kind: ``gptq`` or ``awq``, for the progress bar and the saved files.
        calibrate_layer: ``calibrate_layer(layer, linears, inputs, fix)`` -> path -> result; ``fix(module, weight)``
            holds a weight in place from then on.
        weight_of: ``weight_of(result, module)``: the weight a result it did not fix is held at.
        result_type: the result's class (its fields are what a checkpoint saves).
        progress: show a progress bar.
        checkpoint_dir: where finished layers are saved; None: not kept.
        alone: each layer as if it alone were quantized (what ``layers:i`` calibrates: inputs through the float layers
            below), all in one pass of L layers instead of L^2 / 2.

    Returns:
        Full module name -> result."""
    from torch.nn.utils import parametrize
    from tqdm.auto import tqdm

    by_layer: dict[int, dict[str, nn.Linear]] = {}
    names = {}
    for s in sites:
        by_layer.setdefault(s.layer, {})[s.path] = s.module
        names[s.module] = s.name
    stores, saved = _saved_layers(checkpoint_dir, kind, model, seqs, spec, sites, sorted(by_layer), alone)
    out = {names[by_layer[i][p]]: result_type(**f) for i, got in saved.items() for p, f in got.items()}
    todo = [i for i in by_layer if i not in saved]  # no forward at all when every layer is saved
    fixed: list[nn.Module] = []

    def fix(m: nn.Module, w: torch.Tensor) -> None:
        parametrize.register_parametrization(m, "weight", Fixed(w))
        fixed.append(m)

    def unfix() -> None:
        while fixed:
            parametrize.remove_parametrizations(fixed.pop(), "weight", leave_parametrized=False)

    started = time.perf_counter()
    try:
        inputs = layer_inputs(model, seqs) if todo else []
        layers, last = decoder_layers(model), max(todo, default=-1)
        for i in tqdm(range(last + 1), desc=kind, unit="layer", disable=not progress or not todo or None):
            mine = by_layer.get(i, {})
            results = calibrate_layer(layers[i], mine, inputs, fix) if i in todo else \
                {p: out[names[m]] for p, m in mine.items()}
            for p, r in results.items():
                out[names[mine[p]]] = r
                if not parametrize.is_parametrized(mine[p], "weight"):
                    fix(mine[p], weight_of(r, mine[p]))
            if i in todo and stores[i][0] is not None:
                saved[i] = {p: dict(vars(r)) for p, r in results.items()}
                _save_layers(*stores[i], saved if not alone else {i: saved[i]})
            if alone:
                unfix()  # the next layer's inputs through the float layer
            if i < last:
                inputs = next_inputs(layers[i], inputs)
            if progress and i in todo:
                _said(kind, i, last, started)
    finally:
        unfix()
    return out


def _said(kind: str, i: int, last: int, started: float) -> None:
    """Without a terminal (a log file, where the bar is off), one line per calibrated layer on stderr."""
    import sys

    if not sys.stderr.isatty():
        print(f"{kind}: layer {i} of {last} calibrated ({time.perf_counter() - started:.0f} s)", file=sys.stderr)


def _saved_layers(directory, kind: str, model: nn.Module, seqs: torch.Tensor, spec, sites: list, layers: list[int],
                  alone: bool) -> tuple[dict, dict]:
    """Where each of ``layers`` is saved (layer -> (path, key); one checkpoint for the run, or with ``alone`` one per
    layer, that of ``layers:i``) and the layers found there (layer -> path -> fields)."""
    if directory is None:
        return {i: (None, "") for i in layers}, {}
    if not alone:
        whole = _checkpoint_path(directory, kind, model, seqs, spec, sites)
        got = _load_layers(*whole)
        return {i: whole for i in layers}, {i: got[i] for i in layers if i in got}
    stores = {i: _checkpoint_path(directory, kind, model, seqs, spec, [s for s in sites if s.layer == i])
              for i in layers}
    found = {i: _load_layers(*stores[i]).get(i) for i in layers}
    return stores, {i: got for i, got in found.items() if got is not None}
