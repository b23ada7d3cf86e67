"""Running a test's program on local ranks (`parallel.launch.launch_local`) and reading what each rank saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from parallel.launch import launch_local


def rank_reports(program: Callable[..., None], world_size: int, out_dir: Path, args: tuple[Any, ...],
                 deadline_s: float) -> list[Any]:
    """Run `program(rank, world_size, init_method, *args)` on `world_size` ranks; each saves its report to
    `out_dir / f"rank{rank}.pt"`. Every rank must exit 0; the reports in rank order."""
    exits = launch_local(program, world_size, out_dir, args=args, deadline_s=deadline_s)
    assert [e.exitcode for e in exits] == [0] * world_size
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
