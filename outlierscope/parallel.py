"""Data parallelism with identical numbers for any number of processes.

The work of a run (the batches of a sweep cell, the batches of a profile) is cut into a fixed number
of **virtual shards** (``VIRTUAL_SHARDS``): batch ``b`` belongs to shard ``b % VIRTUAL_SHARDS``.
The batches themselves are the ones a single process forms (same rows, same padding), so a batch's
numbers do not depend on who computes it. A process takes the shards assigned to it, results are
keyed by item index (sweeps) or kept per shard where their merge is order-sensitive (the float64
moments of a profile), and everything is combined in shard order. So 1 process, N processes under
``torchrun``, and N ``--shard i/N`` runs merged by ``outlierscope merge`` give the same bytes.

Two ways to split the work:

* ``World``: processes started by ``torchrun`` or ``accelerate launch`` (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK`` in the environment); results are gathered to rank 0 over
  ``torch.distributed`` with the gloo backend (the payloads are small), and rank 0 alone writes.
* ``Shard``: one share ``i/N`` of the work without any communication (a batch scheduler's job);
  each writes a shard file, ``outlierscope merge`` combines them.

Both compose: the shards of ``--shard i/N`` are split again over a world's ranks.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from outlierscope.errors import OutlierscopeError, ParamError

VIRTUAL_SHARDS = 16  # fixed: the most processes (times --shard N) that get work


@dataclass(frozen=True)
class Shard:
    """One share of a run's virtual shards (``--shard i/N``).

    Attributes:
        index: which share, 0 .. count - 1.
        count: how many shares, 1 .. 16."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if not 1 <= self.count <= VIRTUAL_SHARDS:
            raise ParamError("shard", f"i/N with N in 1..{VIRTUAL_SHARDS}", f"{self.index}/{self.count}")
        if not 0 <= self.index < self.count:
            raise ParamError("shard", "i/N with 0 <= i < N", f"{self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str | None) -> Shard:
        """A shard from its text.

        Args:
            text: ``"i/N"`` (``"1/4"`` is Shard(1, 4)); None: the whole run."""
        if text is None:
            return cls()
        try:
            i, n = (int(p) for p in text.split("/"))
        except ValueError:
            raise ParamError("shard", "i/N, e.g. 0/4", text) from None
        return cls(i, n)

    @property
    def whole(self) -> bool:
        return self.count == 1

    @property
    def tag(self) -> str:
        return f"shard-{self.index}-of-{self.count}"


@dataclass(frozen=True)
class World:
    """This process's place among the processes of a run (rank 0 of 1 without a launcher).

    Attributes:
        rank: this process's rank.
        size: the number of processes.
        local_rank: its rank on this node (its GPU)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> World:
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (set by torchrun and accelerate launch); join the
        gloo process group when there are several processes."""
        env = os.environ
        try:
            world = cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))
        except ValueError:
            raise OutlierscopeError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)") from None
        if world.size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")
        return world

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, device: str) -> str:
        """The device this process runs on: ``cuda`` or ``auto`` on a multi-process run is its own GPU, ``cuda:LOCAL_RANK``.

        Args:
            device: the run's device setting."""
        if self.size > 1 and device in ("cuda", "auto"):
            import torch

            if torch.cuda.is_available():
                n = torch.cuda.device_count()
                if self.local_rank >= n:
                    raise OutlierscopeError(f"process with LOCAL_RANK {self.local_rank} but this node has {n} GPU(s); "
                                            f"start at most {n} processes per node (torchrun --nproc-per-node {n})")
                return f"cuda:{self.local_rank}"
        return device

    def gather(self, obj) -> list | None:
        """Every rank's object at rank 0, in rank order.

        Args:
            obj: this rank's object (picklable).

        Returns:
            The list on rank 0 (``[obj]`` alone); None on the other ranks."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj):
        """Rank 0's object on every rank.

        Args:
            obj: rank 0's object (the others' is ignored)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @contextlib.contextmanager
    def failing_together(self) -> Iterator[None]:
        """A block every rank runs before a collective: if it raises on any rank, it raises on every rank (the
        first failing rank's message, ``rank r: ...``), so no rank waits forever for a share that never comes
        and rank 0 writes nothing. One process: exceptions pass through unchanged."""
        if self.size == 1:
            yield
            return
        error = None
        try:
            yield
        except Exception as e:  # noqa: BLE001 (every failure must reach the other ranks)
            error = f"rank {self.rank}: {e if isinstance(e, OutlierscopeError) else f'{type(e).__name__}: {e}'}"
        self.agree(error)

    def agree(self, error: str | Exception | None) -> None:
        """Raise on every rank if any rank reports an error, else return.

        Args:
            error: this rank's error, or None; a rank with an exception raises it as it is, the others the first
                rank's message."""
        errors = [str(error) if error else None] if self.size == 1 else _all_gather(str(error) if error else None,
                                                                                   self.size)
        if isinstance(error, Exception):
            raise error
        bad = [e for e in errors if e]
        if bad:
            raise OutlierscopeError(bad[0])


def _all_gather(obj, size: int) -> list:
    import torch.distributed as dist

    out = [None] * size
    dist.all_gather_object(out, obj)
    return out


def local_processes() -> int:
    """How many processes of one thread a run on this machine should start (``make reproduce`` under ``torchrun``):
    one per GPU where there are GPUs, else one per core this process may use; at most ``VIRTUAL_SHARDS`` (the
    most that get work). One thread per process keeps the bytes of one process (a BLAS sums in another order with
    another number of threads)."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(gpus or cores, VIRTUAL_SHARDS))


def owned_shards(shard: Shard, world: World) -> tuple[int, ...]:
    """The virtual shards this process computes: those of ``shard``, then every ``world.size``-th of them.

    Args:
        shard: the run's ``--shard``.
        world: the run's processes.

    Raises:
        OutlierscopeError: shards times processes beyond the 16 virtual shards."""
    if shard.count * world.size > VIRTUAL_SHARDS:
        raise OutlierscopeError(f"{shard.count} shard(s) x {world.size} process(es) exceed the {VIRTUAL_SHARDS} virtual "
                                f"shards a run is cut into; use at most {VIRTUAL_SHARDS} in all")
    mine = [v for v in range(VIRTUAL_SHARDS) if v % shard.count == shard.index]
    return tuple(mine[world.rank :: world.size])


def shard_of(batch: int) -> int:
    """The virtual shard of a run's batch.

    Args:
        batch: the batch's index in the run."""
    return batch % VIRTUAL_SHARDS


def find_shards(dirs, stem: str, suffix: str, what: str) -> list[Path]:
    """The shard files of one split found in some directories, in shard order (the first found of each).

    Args:
        dirs: the directories to look in.
        stem: the files' stem: ``{stem}.shard-i-of-N{suffix}``.
        suffix: the files' suffix.
        what: the command that writes them, for the errors.

    Raises:
        OutlierscopeError: none found, several splits, or missing shards, in one line."""
    pattern = re.compile(rf"^{re.escape(stem)}\.shard-(\d+)-of-(\d+){re.escape(suffix)}$")
    found: dict[tuple[int, int], Path] = {}
    for d in map(Path, dirs):
        for f in sorted(d.glob(f"{stem}.shard-*-of-*{suffix}")):
            m = pattern.match(f.name)
            if m:
                found.setdefault((int(m[1]), int(m[2])), f)
    if not found:
        raise OutlierscopeError(f"no {what} shard files ({stem}.shard-i-of-N{suffix}) in {', '.join(map(str, dirs))}; "
                                f"run `outlierscope {what} ... --shard i/N` first")
    counts = {n for _, n in found}
    if len(counts) > 1:
        raise OutlierscopeError(f"{what} shards of different splits ({sorted(counts)} shards) in the same place; merge one run")
    n = counts.pop()
    missing = sorted(set(range(n)) - {i for i, _ in found})
    if missing:
        raise OutlierscopeError(f"{what} shard(s) {', '.join(f'{i}/{n}' for i in missing)} missing; run them, then merge again")
    return [found[(i, n)] for i in range(n)]
