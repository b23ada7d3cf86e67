"""Helpers shared by the AdaLN plan cache tests (no tests here; the `tiny` fixtures are in conftest.py).

Checkpoints are real tiny MiniMax-H3 checkpoints (`model.tiny.make_tiny_checkpoint`, transformer only), served as
the engine serves them: the reference transformer holds every weight; the online one is built without its AdaLN
weights and reads rows through `ExternalModulation`. Tiny numbers used throughout: 4 blocks, hidden 64,
time_embed_dim 32, so adaln_width = 3*6*64 = 1152, final_adaln_width = 2*64 = 128 and one host page (one plan row)
is 4*1152 + 128 = 4736 bf16 params = 9472 bytes; one rebuild pass reads 4 x (1152x32 + 1152) + (128x32 + 128) bf16.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from diffusers import MiniMaxH3Transformer3DModel

from cache.config import GB, AdalnConfig
from cache.plan_cache import PlanCache, PlanRows, ResidentModulation
from device.streams import Device
from model.adaln import ExternalModulation, Modulation, adaln_input, resident_modulation
from model.layout import CheckpointError, H3Checkpoint, Layout
from model.loading import load_transformer
from model.tiny import make_tiny_checkpoint
from model.weights import TensorLocation, TransformerWeights, is_adaln_param

NUM_BLOCKS, TIME_EMBED_DIM, ADALN_WIDTH, FINAL_WIDTH = 4, 32, 1152, 128
TINY_PAGE_BYTES = (NUM_BLOCKS * ADALN_WIDTH + FINAL_WIDTH) * 2
TINY_ADALN_BYTES = (NUM_BLOCKS * (ADALN_WIDTH * TIME_EMBED_DIM + ADALN_WIDTH)
                    + FINAL_WIDTH * TIME_EMBED_DIM + FINAL_WIDTH) * 2


def plan(*timesteps: float) -> torch.Tensor:
    """One forward's distinct timesteps as the fp32 [M] tensor the schedule produces."""
    return torch.tensor(timesteps, dtype=torch.float32)


def schedule(start: float, steps: int, width: int = 2) -> list[torch.Tensor]:
    """`steps` distinct plans of `width` ascending timesteps, all different from other `start`s."""
    return [plan(*(start - 0.01 * i + 0.001 * j for j in range(width))) for i in range(steps)]


def host_gb(pages: int, page_bytes: int = TINY_PAGE_BYTES) -> float:
    """`host_cache_gb` that holds exactly `pages` pages."""
    return pages * page_bytes / GB


def open_weights(root: Path) -> TransformerWeights:
    """The transformer of the H3 checkpoint at `root` (either layout)."""
    checkpoint = H3Checkpoint.open(root)
    return TransformerWeights(checkpoint.transformer_dir, checkpoint.layout)


@dataclasses.dataclass
class Models:
    """One checkpoint as the plan cache tests serve it."""

    path: Path                              # the checkpoint root
    reader: TransformerWeights
    online: MiniMaxH3Transformer3DModel     # built without AdaLN weights, ExternalModulation installed
    external: ExternalModulation            # feeds `online`'s AdaLN: `external.set(modulation)` per forward
    resident: MiniMaxH3Transformer3DModel   # every weight: the reference


def serve(root: Path) -> Models:
    """Load the checkpoint at `root` twice: online (no AdaLN weights) and resident."""
    reader = open_weights(root)
    online = load_transformer(reader, "cpu", skip=is_adaln_param)  # adaln params stay on meta...
    external = ExternalModulation.install(online)                  # ...until replaced by row readers
    return Models(root, reader, online, external, load_transformer(reader, "cpu"))


def make_models(root: Path, layout: Layout | str, seed: int = 0) -> Models:
    return serve(make_tiny_checkpoint(root, layout, seed, components=False))


_MADE: dict[Layout, Models] = {}


def models_for(layout: Layout, tmp_path_factory) -> Models:
    """The seed-0 tiny checkpoint of `layout`, once per test session, whichever module asks first."""
    if layout not in _MADE:
        _MADE[layout] = make_models(tmp_path_factory.mktemp(f"tiny-{layout.value}") / "tiny", layout)
    return _MADE[layout]


def online_cache(models: Models, *, reader=None, gpu: Device | None = None, **overrides) -> PlanCache:
    """A CPU PlanCache over `models` (4 slab plans of width 2, no host tier, 2 readers unless overridden)."""
    settings = dict(gpu_plans=4, plan_width=2, host_cache_gb=0.0, readers=2, read_chunk_mb=1)
    settings.update(overrides)
    return PlanCache(AdalnConfig(**settings), reader or models.reader, models.online, "cpu", gpu=gpu)


def resident(models: Models, projection: str = "match") -> ResidentModulation:
    return ResidentModulation(AdalnConfig(mode="resident", projection=projection), models.resident)


def resident_rows(transformer: MiniMaxH3Transformer3DModel, timesteps) -> Modulation:
    """The transformer's own modulation for one forward's distinct timesteps."""
    return resident_modulation(transformer, adaln_input(transformer, torch.as_tensor(timesteps)))


def assert_same_modulation(got: Modulation, want: Modulation, what: str) -> None:
    assert torch.equal(got.blocks, want.blocks), f"{what}: block modulation differs"
    assert torch.equal(got.final, want.final), f"{what}: final modulation differs"


def assert_equal_to_resident(prepared, reference: ResidentModulation, plans: list[torch.Tensor]) -> None:
    """torch.equal on every step's block and final modulation."""
    expected = reference.prepare(plans)
    for step in range(len(plans)):
        assert_same_modulation(prepared.modulation(step), expected.modulation(step), f"step {step}")


class MemoResident:
    """`resident(models)` answering each plan once: the resident projection depends on the weights and the
    timesteps only, and a long request sequence asks for the same few dozen plans thousands of times. Has the
    `prepare(plans).modulation(step)` that `assert_equal_to_resident` reads."""

    def __init__(self, reference: ResidentModulation):
        self._reference = reference
        self._answers: dict[tuple[float, ...], Modulation] = {}

    def modulation_for(self, timesteps: torch.Tensor) -> Modulation:
        key = tuple(timesteps.tolist())
        if key not in self._answers:
            self._answers[key] = self._reference.prepare([timesteps]).modulation(0)
        return self._answers[key]

    def prepare(self, plans: list[torch.Tensor]) -> MemoPlans:
        return MemoPlans(self, plans)


@dataclasses.dataclass(frozen=True)
class MemoPlans:
    memo: MemoResident
    plans: list[torch.Tensor]

    def modulation(self, step: int) -> Modulation:
        return self.memo.modulation_for(self.plans[step])


class DictRemote:
    """A node pool stand-in (the plan cache's RemoteTier): keeps copies of what it is sent once the copies landed."""

    def __init__(self):
        self.plans: dict = {}

    def lookup(self, keys):
        return {k: self.plans[k] for k in keys if k in self.plans}

    def publish_group(self, plans, ready):
        ready.synchronize()
        self.plans.update({k: PlanRows(rows.blocks.clone(), rows.final.clone()) for k, rows in plans.items()})


class FaultyReader:
    """A TransformerWeights that pretends some tensors are missing or point past the end of their file."""

    def __init__(self, reader: TransformerWeights, missing=(), truncated=()):
        self.reader, self.missing, self.truncated = reader, set(missing), set(truncated)
        self.config, self.fingerprint = reader.config, reader.fingerprint

    def location(self, name: str) -> TensorLocation:
        if name in self.missing:
            raise CheckpointError(f"tensor {name!r} is not in the index")
        loc = self.reader.location(name)
        if name in self.truncated:  # same shape, bytes beyond EOF: fails mid-stream, at read time
            loc = dataclasses.replace(loc, offset=loc.path.stat().st_size)
        return loc
