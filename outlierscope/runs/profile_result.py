"""What a profile returns: ``ProfileResult``, the statistics of one or more profiled models, their tables and how
they are written (``save``: every table and ``profile.json``; ``save_shard``: a partial profile's part)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from outlierscope.analysis.outliers import KIND_LABEL, OutlierStats
from outlierscope.errors import OutlierscopeError
from outlierscope.io import (
    git_commit,
    machine,
    output_dir,
    save_torch_checked,
    versions,
    write_csv,
    write_run_record,
    write_text,
)
from outlierscope.parallel import Shard
from outlierscope.report.tables import table5_markdown

# one CSV per table: (file stem, OutlierStats method)
STAT_TABLES = (("per_layer", "per_layer"), ("per_head", "per_head"), ("per_channel", "per_channel"),
               ("histograms", "histograms"), ("outlier_features", "outlier_features"),
               ("massive_activations", "massive_activations"))
# every point (outlierscope.analysis.activations): written when not empty
POINT_TABLES = (("channels", "channels"), ("positions", "positions"), ("int8_features", "int8_features"),
                ("sinks", "sink_table"))


def _with_model(name: str, df: pd.DataFrame) -> pd.DataFrame:
    df = df.copy()
    df.insert(0, "model", name)
    return df


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({"model": []})


@dataclass
class ProfileResult:
    """Statistics of one or more profiled models; ``tables`` builds every tidy DataFrame, ``save`` writes them.

    Attributes:
        stats: model name -> its ``OutlierStats``.
        facts: model name -> what ran (its source, tokens, sequences, processes, seconds ...).
        settings: the run's ``ProfileSettings``."""

    stats: dict[str, OutlierStats]
    facts: dict[str, dict]
    settings: Any
    _digests: dict[str, Callable[[], str]] = field(default_factory=dict, repr=False)

    @property
    def table5(self) -> pd.DataFrame:
        return _concat([_with_model(n, st.table5()) for n, st in self.stats.items()])

    @property
    def tables(self) -> dict[str, pd.DataFrame]:
        """Every table by file stem: table5, per_layer, per_head, ..., topk_logits, topk_hidden, lambda."""
        out = {"table5": self.table5}
        for stem, method in STAT_TABLES:
            out[stem] = _concat([_with_model(n, getattr(st, method)()) for n, st in self.stats.items()])
        for kind, stem in (("attn.logits", "topk_logits"), ("hidden", "topk_hidden")):
            df = _concat([_with_model(n, st.topk_frame(kind)) for n, st in self.stats.items()])
            if not df.empty:
                out[stem] = df
        massive = {n: st.massive() for n, st in self.stats.items()}  # built once: its recurrence is counted from it
        for stem, get in (*((stem, lambda n, st, m=m: getattr(st, m)()) for stem, m in POINT_TABLES),
                          ("massive", lambda n, st: massive[n]),
                          ("massive_recurrence", lambda n, st: st.massive_recurrence(massive[n])),
                          ("topk_maps", lambda n, st: st.topk_points(True)),
                          ("topk_tokens", lambda n, st: st.topk_points(False))):
            df = _concat([_with_model(n, get(n, st)) for n, st in self.stats.items()])
            if len(df):
                out[stem] = df
        lam = pd.DataFrame([{"model": n, "layer": i, "lambda_init": a, "lambda": b}
                            for n, f in self.facts.items() for i, (a, b) in enumerate(f.get("lambda", []))])
        if not lam.empty:
            out["lambda"] = lam
        return out

    def __or__(self, other: ProfileResult) -> ProfileResult:
        """Both results side by side (distinct model names)."""
        clash = set(self.stats) & set(other.stats)
        if clash:
            raise OutlierscopeError(f"model {sorted(clash)[0]} is in both results; give the models distinct names")
        return ProfileResult({**self.stats, **other.stats}, {**self.facts, **other.facts}, self.settings,
                             {**self._digests, **other._digests})

    def markdown(self) -> str:
        return table5_markdown(self.table5, self.facts)

    def save_shard(self, out: str | Path, shard: Shard) -> Path:
        """Write a partial profile (``--shard i/N``) as ``profile.shard-i-of-N.pt``: statistics, facts and settings.

        Args:
            out: the directory.
            shard: the shard it holds.

        Returns:
            The file's path."""
        facts = {n: {**f, "weights_sha256": f.get("weights_sha256") or self._digests[n]()} for n, f in self.facts.items()}
        path = Path(out) / f"profile.{shard.tag}.pt"
        save_torch_checked(path, {"stats": {n: st.state() for n, st in self.stats.items()}, "facts": facts,
                                  "settings": asdict(self.settings), "shard": [shard.index, shard.count]})
        return path

    def act_scales(self) -> dict[str, dict[str, torch.Tensor]]:
        """SmoothQuant's act_scales per model (models with observed ``nn.Linear`` inputs only)."""
        return {n: a for n, st in self.stats.items() if (a := st.act_scales())}

    def _save_act_scales(self, stage: Path) -> None:
        """``act_scales.pt`` as SmoothQuant's generate_act_scales.py writes it (``act_scales.<model>.pt`` each when
        several models have one)."""
        scales = self.act_scales()
        for name, a in scales.items():
            slug = name.replace(":", "-").replace("/", "_")  # a file name on any system
            torch.save(a, stage / ("act_scales.pt" if len(scales) == 1 else f"act_scales.{slug}.pt"))

    def save(self, out: str | Path) -> Path:
        """Write every table, staged and moved in file by file (each rename atomic), the sealed ``profile.json`` last.

        Weights are hashed here, not while profiling.

        Args:
            out: the directory.

        Returns:
            The directory."""
        facts = {n: {**f, "weights_sha256": f.get("weights_sha256") or self._digests[n]()} for n, f in self.facts.items()}
        with output_dir(out) as out:
            stage = Path(tempfile.mkdtemp(prefix=".profile-", dir=out))
            try:
                for stem, df in self.tables.items():
                    write_csv(stage / f"{stem}.csv", df)
                write_text(stage / "table5.md", table5_markdown(self.table5, facts))
                self._save_act_scales(stage)
                meta = {"settings": asdict(self.settings), "models": facts, "versions": versions(),
                        "machine": machine(), "git_commit": git_commit(),
                        "median_rel_error_bound": next(iter(self.stats.values())).bins.rel_error_bound,
                        "activation_types": KIND_LABEL,
                        "excluded": "masked (future/padding/out-of-window) logits, padding tokens"}
                write_run_record(stage / "profile.json", meta, sorted(f.name for f in stage.iterdir()))
                for f in sorted(stage.iterdir(), key=lambda p: p.name == "profile.json"):
                    f.replace(out / f.name)
            finally:
                shutil.rmtree(stage, ignore_errors=True)
        return out
