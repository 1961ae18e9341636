"""``outlierscope reproduce``: Table 5 and Figure 8 of the Diff Transformer paper on the bundled pair (default)
or on any models (``models=("smollm2-135m",)``)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from outlierscope.errors import OutlierscopeError
from outlierscope.io import git_commit, machine, versions, write_run_record
from outlierscope.models.loading import (
    attn_block_option,
    device_map_option,
    device_option,
    dtype_option,
    fused_option,
    trust_remote_code_option,
)
from outlierscope.models.presets import DEFAULT_PAIR, PRESETS, ROLES
from outlierscope.parallel import World
from outlierscope.quant.numerics.names import GRANULARITIES
from outlierscope.settings import option


@dataclass(frozen=True)
class ReproduceSettings:
    """Settings of ``outlierscope reproduce``: Table 5 and Figure 8 in one run (profile, sweep, plot, report). Each
    field is a CLI flag of the same name (its help is the field's ``option`` text)."""

    out: str = option("runs/reproduce", "output directory (completed sweep cells are reused)")
    tokens: int = option(400_000, "profiling tokens per model")
    limit: int | None = option(None, "first N items of each task (default: all)", exclusive="items")
    sample: int | None = option(None, "N items of each task drawn at random (seed 0)", exclusive="items")
    bits: tuple[int, ...] = option((16, 8, 6, 4), "bit widths of the sweep; 16 = unquantized")
    granularity: str = option("per_tensor", "the sweep's scale granularity", choices=GRANULARITIES)
    models: tuple[str, ...] = option(DEFAULT_PAIR, "model spec, repeat (e.g. smollm2-135m)", flag="--model",
                                     repeat=True, metavar="SPEC")
    tasks: tuple[str, ...] = option(("hellaswag",), "the sweep's tasks, repeat (`paper` = the paper's seven, `all` = "
                                    "every task)", flag="--task", repeat=True, metavar="TASK")
    batch_size: int = option(32, "HellaSwag sequences per forward; the scores do not depend on it")
    text: str | None = option(None, "held-out .txt/.jsonl(.xz) text: also report LM loss per bit width")
    seq_len: int | None = option(None, "profile sequence length (default: min(model context, 256))")
    force: bool = option(False, "replace the tables of a sweep with other settings in OUT/sweep")
    check: bool = option(False, "check every setting, model and task, then stop without running (make reproduce does "
                                "this in one process before it starts torchrun's)")
    device: str = device_option()
    dtype: str = dtype_option()
    device_map: str | None = device_map_option()
    attn_block: int | None = attn_block_option()
    fused: bool = fused_option()
    trust_remote_code: bool = trust_remote_code_option()

    def __post_init__(self):  # the suites expanded and every name checked before anything runs
        from outlierscope.data.tasks import expand_tasks

        object.__setattr__(self, "tasks", expand_tasks((self.tasks,) if isinstance(self.tasks, str) else self.tasks))

    @property
    def placement(self) -> dict:
        return {"device": self.device, "dtype": self.dtype, "device_map": self.device_map, "attn_block": self.attn_block,
                "trust_remote_code": self.trust_remote_code}


def reproduce(s: ReproduceSettings, log=print, world: World | None = None) -> Path | None:
    """Profile, sweep, plot and report the paper's Table 5 and Figure 8 into ``s.out``; completed cells are reused.

    Under ``torchrun`` with one thread per process (as ``make reproduce`` runs, one process per core) the bytes are
    those of one process.

    Args:
        s: the reproduction's settings; with ``s.check``, every setting, model and task is checked and nothing run.
        log: where progress lines go.
        world: the ``torchrun`` processes (``World.from_env()``); rank 0 writes the tables, figures, report and
            ``reproduce.json``.

    Returns:
        The report's path; None with ``s.check`` and on ranks other than 0."""
    from outlierscope.data.tasks import task_label
    from outlierscope.models.loading import bundled_specs
    from outlierscope.report.markdown import write_report
    from outlierscope.runs.profile import ProfileSettings, profile
    from outlierscope.runs.sweep import SweepSettings, check_inputs, check_previous, sweep

    roles = {f"{p}:{r}" for p in PRESETS for r in ROLES}  # a mistyped role gets check_model's "did you mean"
    missing = [m for m in s.models if m in roles and m not in bundled_specs()]
    if missing:
        raise OutlierscopeError(f"bundled model(s) {', '.join(missing)} not installed; reinstall the package (make reproduce)")
    out = Path(s.out)
    # every setting, model and task checked before the profile runs: an error must not come after it
    prof_settings = ProfileSettings(tokens=s.tokens, batch_size=8, seq_len=s.seq_len, **s.placement)
    sweep_settings = SweepSettings(models=tuple(s.models), bits=tuple(s.bits), granularity=s.granularity, limit=s.limit,
                                   sample=s.sample, tasks=s.tasks, batch_size=s.batch_size, text=s.text, fused=s.fused,
                                   **s.placement)
    check_inputs(sweep_settings)
    check_previous(out / "sweep", asdict(sweep_settings), s.force)
    sweep_settings.task_items()
    world = world or World()
    log = log if world.is_main else (lambda *a, **k: None)
    if s.check:
        log(f"checked: {', '.join(s.models)}; {', '.join(s.tasks)}; {s.out} (nothing run)")
        return None
    t0 = time.time()
    log(f"[1/3] profiling {', '.join(s.models)} on {s.tokens:,} tokens of HellaSwag text (Table 5)")
    profile(list(s.models), prof_settings, out / "profile", world=world)
    t1 = time.time()
    tasks = s.tasks
    names = ", ".join(task_label(t) for t in tasks)
    log(f"[2/3] sweeping {', '.join(map(str, s.bits))} bits ({s.granularity}) on "
        f"{f'up to {s.limit or s.sample:,}' if s.limit or s.sample else 'all'} validation items of {names} (Figure 8)")
    sweep(sweep_settings, out / "sweep", log=log, force=s.force, world=world)
    t2 = time.time()
    if not world.is_main:
        return None
    log("[3/3] plotting and writing the report")
    path = write_report(out)
    t3 = time.time()
    timings = {"profile_s": round(t1 - t0, 1), "sweep_s": round(t2 - t1, 1), "report_s": round(t3 - t2, 1),
               "total_s": round(t3 - t0, 1)}
    write_run_record(out / "reproduce.json", {"settings": asdict(s), "timings": timings, "processes": world.size,
                                              "machine": machine(), "versions": versions(), "git_commit": git_commit()},
                     ["report.md", "profile/profile.json", "sweep/sweep.json"])
    log(f"timings: profile {timings['profile_s']:.0f} s, sweep {timings['sweep_s']:.0f} s, report "
        f"{timings['report_s']:.0f} s, total {timings['total_s'] / 60:.1f} min (recorded in reproduce.json)")
    return path
