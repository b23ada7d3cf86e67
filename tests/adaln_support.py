"""Helpers shared by the AdaLN plan cache tests (no tests here; the `tiny` fixture is in conftest.py).

Checkpoints are real ones from `model.checkpoint.make_checkpoint` (what `python -m model.checkpoint make`
writes). Tiny numbers used throughout: `preset("tiny")` has 4 blocks, adaln_width 1152, final 128, so one
host page (one plan row) is 4*1152 + 128 = 4736 bf16 params = 9472 bytes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from cache.config import GB, AdalnConfig
from cache.plan_cache import PlanCache, ResidentModulation
from cache.streams import Streams
from model.checkpoint import CheckpointError, CheckpointReader, load_model, make_checkpoint
from model.config import preset

TINY_PAGE_BYTES = (4 * 3 * 6 * 64 + 2 * 64) * 2


def plan(*timesteps: float) -> torch.Tensor:
    """One step's distinct timesteps as the fp32 [M] tensor the sampler produces."""
    return torch.tensor(timesteps, dtype=torch.float32)


def schedule(start: float, steps: int, width: int = 2) -> list[torch.Tensor]:
    """`steps` distinct plans of `width` timesteps, all different from other `start`s."""
    return [plan(*(start - 0.01 * i - 0.001 * j for j in range(width))) for i in range(steps)]


def host_gb(pages: int, page_bytes: int = TINY_PAGE_BYTES) -> float:
    """`host_cache_gb` that holds exactly `pages` pages."""
    return pages * page_bytes / GB


@dataclasses.dataclass
class Models:
    path: Path
    reader: CheckpointReader
    online: torch.nn.Module     # DiT built with_adaln=False (what online mode serves with)
    resident: torch.nn.Module   # DiT with adaln_proj (the reference)


def make_models(path: Path, name: str) -> Models:
    make_checkpoint(path, preset(name), seed=0)
    return Models(path, CheckpointReader(path), load_model(path, with_adaln=False), load_model(path))


_MADE: dict[str, Models] = {}


def models_for(name: str, tmp_path_factory) -> Models:
    """Once per test session, whichever module asks first (small's checkpoint is ~110 MB)."""
    if name not in _MADE:
        _MADE[name] = make_models(tmp_path_factory.mktemp(name), name)
    return _MADE[name]


def online_cache(models: Models, *, reader=None, streams: Streams | None = None, **overrides) -> PlanCache:
    settings = dict(gpu_plans=4, plan_width=2, host_cache_gb=0.0, readers=2, read_chunk_mb=1)
    settings.update(overrides)
    return PlanCache(AdalnConfig(**settings), reader or models.reader, models.online, "cpu", streams=streams)


def resident(models: Models, projection: str = "match") -> ResidentModulation:
    return ResidentModulation(AdalnConfig(mode="resident", projection=projection), models.resident)


def assert_equal_to_resident(prepared, reference: ResidentModulation, plans: list[torch.Tensor]) -> None:
    """torch.equal on every step's block and final modulation."""
    expected = reference.prepare(plans)
    for step in range(len(plans)):
        got, want = prepared.modulation(step), expected.modulation(step)
        assert torch.equal(got.blocks, want.blocks), f"step {step}: block modulation differs"
        assert torch.equal(got.final, want.final), f"step {step}: final modulation differs"


class FaultyReader:
    """A CheckpointReader that pretends some tensors are missing or point past the end of their file."""

    def __init__(self, reader: CheckpointReader, missing=(), truncated=()):
        self.reader, self.missing, self.truncated = reader, set(missing), set(truncated)
        self.config, self.fingerprint = reader.config, reader.fingerprint

    def location(self, name: str):
        if name in self.missing:
            raise CheckpointError(f"tensor {name!r} is not in the index")
        loc = self.reader.location(name)
        if name in self.truncated:  # same shape, bytes beyond EOF: fails mid-stream, at read time
            loc = dataclasses.replace(loc, offset=loc.path.stat().st_size)
        return loc
