"""Run a function on N local ranks, one fresh process each, with a deadline (tests, benchmarks, CPU dev runs).

    exits = launch_local(target, world_size=2, workdir=tmp_path, args=(...,), deadline_s=120)

Every process calls `target(rank, world_size, init_method, *args)`; `init_method` is a fresh `file://` rendezvous
in `workdir`, for `parallel.group.init_group`. Results travel through files the target writes (under `workdir`),
so nothing but the exit codes crosses process boundaries here.

Unlike `torch.multiprocessing.spawn`, a rank that dies does not take the others down: the survivors run on (that
is what a killed-rank test needs to watch), and a rank still running at the deadline is killed and reported as
hung (`RankExit.hung`), so a collective that never returns fails the caller instead of hanging it.

Ranks are forked from a forkserver that imported torch, diffusers and transformers once (and the first target's
module): a spawned rank spent 3-5 s of CPU importing them again, every launch. The server is single-threaded and
has run no torch op, so a fork of it is as clean as a spawn.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.multiprocessing as mp

#: How long a rank killed at the deadline gets to exit before the next one is looked at.
_KILL_GRACE_S = 5.0
#: Imported once by the forkserver, so that no rank imports them again.
_PRELOAD = ("torch", "transformers", "diffusers")


@dataclass(frozen=True)
class RankExit:
    rank: int
    exitcode: int | None  # None: still running at the deadline (then killed)

    @property
    def hung(self) -> bool:
        return self.exitcode is None

    @property
    def ok(self) -> bool:
        return self.exitcode == 0


def _rank_main(target: Callable[..., None], *args) -> None:
    """Run one rank, then leave with `os._exit`: no interpreter teardown, so no gloo teardown. A rank whose
    peer had already closed its connections sometimes died of SIGABRT in gloo's teardown (a healthy group's
    `destroy_process_group` or interpreter exit), after its work was done and reported (`parallel.group`)."""
    code = 0
    try:
        target(*args)
    except BaseException:  # noqa: BLE001 - reported here, then the exit code says it
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch_local(target: Callable[..., None], world_size: int, workdir: str | os.PathLike, *,
                 args: tuple = (), deadline_s: float = 120.0) -> list[RankExit]:
    """Start `world_size` processes (forkserver) running `target(rank, world_size, init_method, *args)`, wait for all
    of them until `deadline_s`, kill the ones still running, and return every rank's exit."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rendezvous = workdir / f"rendezvous-{os.getpid()}-{time.monotonic_ns()}"
    init_method = f"file://{rendezvous}"
    context = mp.get_context("forkserver")
    # Read only when the server starts (the first launch of this process); later targets' modules are then
    # imported by each rank, on top of what the server already holds.
    preload = [*_PRELOAD, *([target.__module__] if target.__module__ != "__main__" else [])]
    context.set_forkserver_preload(preload)
    processes = [context.Process(target=_rank_main, args=(target, rank, world_size, init_method, *args),
                                 daemon=True)
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + deadline_s
    exits = []
    for rank, process in enumerate(processes):
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(_KILL_GRACE_S)
            exits.append(RankExit(rank, None))
        else:
            exits.append(RankExit(rank, process.exitcode))
    return exits
