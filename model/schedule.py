"""The MiniMax-H3 sampling schedule: two shifted sigma grids and, per forward pass, the AdaLN plan.

Conventions (diffusers `MiniMaxH3Scheduler` and the modular pipeline's `MiniMaxH3SetTimestepsStep`):
- `num_steps` N counts sigma grid points, the terminal 0 included: sigmas = shift(linspace(1, 0, N)) with
  `shift(b) = s*b / (1 + (s-1)*b)`, so there are N - 1 forward passes. Video uses shift 12, audio shift 3.
- the transformer's timestep is `t = 1 - sigma` (fp32, in [0, 1], 1 = clean); forward i evaluates video rows (and
  text rows, which inherit the video timestep) at `1 - video_sigmas[i]` and audio rows at `1 - audio_sigmas[i]`.
- the `timestep` tensor of forward i holds the *distinct* values among its rows, **sorted ascending** (the pipeline
  reduces the per-row timesteps with `torch.unique(sorted=True)`), and every row's `timestep_indices` entry points
  into it. That tensor is the AdaLN plan: the plan cache keys on its exact fp32 bits in this order.
  Forward 0 has one plan row (both sigmas are 1, so both timesteps are 0.0); every later forward has two.

The sigma grids are computed by `MiniMaxH3Scheduler.set_timesteps` itself, so they are the reference's by
construction; `euler_update` reproduces `MiniMaxH3Scheduler.step` operation for operation (a test checks bit
equality), without its hidden step counter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
from diffusers import MiniMaxH3Scheduler
from torch import Tensor

VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0
MAX_STEPS = 1000  # far below where fp32 grid collisions could make the two grids differ in length


class Task(str, Enum):
    """Generation tasks whose schedule this module builds (only text -> video + audio so far)."""

    T2VA = "t2va"


class ScheduleError(ValueError):
    """A schedule parameter out of range; names the field, the value and the limit."""

    def __init__(self, field: str, value: object, limit: str):
        super().__init__(f"{field}={value!r} is out of range: {limit}")
        self.field = field
        self.value = value
        self.limit = limit


def _check(num_steps: int, video_shift: float, audio_shift: float, task: Task | str) -> Task:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or not 2 <= num_steps <= MAX_STEPS:
        raise ScheduleError("num_steps", num_steps, f"must be an integer in [2, {MAX_STEPS}] (sigma grid points)")
    for field, shift in (("video_shift", video_shift), ("audio_shift", audio_shift)):
        if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift) or shift <= 0:
            raise ScheduleError(field, shift, "must be a finite number > 0")
    try:
        return Task(task)
    except ValueError:
        raise ScheduleError("task", task, f"must be one of {[t.value for t in Task]}") from None


def schedule_key(
    num_steps: int, video_shift: float = VIDEO_SHIFT, audio_shift: float = AUDIO_SHIFT, task: Task | str = Task.T2VA
) -> str:
    """Stable id of a schedule, computed without tensors: equal keys mean equal plans (the router hashes it).

    Shifts are written with `float.hex` so two shifts that differ in any bit get different keys.
    """
    task = _check(num_steps, video_shift, audio_shift, task)
    return (
        f"h3-rf-euler/{task.value}/steps={num_steps}"
        f"/video_shift={float(video_shift).hex()}/audio_shift={float(audio_shift).hex()}"
    )


def shifted_sigmas(num_steps: int, shift: float) -> Tensor:
    """fp32 [num_steps]: the scheduler's sigma grid, from exactly 1 down to exactly 0 (CPU)."""
    scheduler = MiniMaxH3Scheduler(shift=float(shift))
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One forward pass: the distinct timesteps it embeds and which of them each modality's rows use."""

    timesteps: Tensor  # fp32 [M], M in {1, 2}, ascending, distinct: the transformer's `timestep` argument
    video_index: int  # into `timesteps`, for video rows and text rows
    audio_index: int  # into `timesteps`, for audio rows

    @classmethod
    def of(cls, video_timestep: Tensor, audio_timestep: Tensor) -> StepPlan:
        """Reduce the two row timesteps the way the pipeline does (`torch.unique`, sorted)."""
        pair = torch.stack((video_timestep, audio_timestep)).to(torch.float32)
        timesteps, inverse = torch.unique(pair, sorted=True, return_inverse=True)
        return cls(timesteps, int(inverse[0]), int(inverse[1]))


@dataclass(frozen=True, eq=False)
class H3Schedule:
    """Sigmas, timesteps and AdaLN plans of one (num_steps, shifts, task), built once, on CPU."""

    num_steps: int
    video_shift: float
    audio_shift: float
    task: Task
    video_sigmas: Tensor  # fp32 [num_steps]
    audio_sigmas: Tensor  # fp32 [num_steps]
    steps: tuple[StepPlan, ...]  # one per forward pass

    @classmethod
    def build(
        cls,
        num_steps: int,
        video_shift: float = VIDEO_SHIFT,
        audio_shift: float = AUDIO_SHIFT,
        task: Task | str = Task.T2VA,
    ) -> H3Schedule:
        task = _check(num_steps, video_shift, audio_shift, task)
        video_sigmas = shifted_sigmas(num_steps, video_shift)
        audio_sigmas = shifted_sigmas(num_steps, audio_shift)
        if video_sigmas.numel() != audio_sigmas.numel():  # unique_consecutive collapsed a grid point in one of them
            raise ScheduleError("num_steps", num_steps, "the video and audio grids collapse to different lengths")
        video_timesteps, audio_timesteps = 1.0 - video_sigmas[:-1], 1.0 - audio_sigmas[:-1]
        steps = tuple(StepPlan.of(v, a) for v, a in zip(video_timesteps, audio_timesteps))
        return cls(num_steps, float(video_shift), float(audio_shift), task, video_sigmas, audio_sigmas, steps)

    @property
    def num_forwards(self) -> int:
        return len(self.steps)

    @property
    def video_timesteps(self) -> Tensor:
        """fp32 [num_forwards]: `1 - video_sigmas[:-1]`, the scheduler's `timesteps`."""
        return 1.0 - self.video_sigmas[:-1]

    @property
    def audio_timesteps(self) -> Tensor:
        return 1.0 - self.audio_sigmas[:-1]

    @property
    def plans(self) -> list[Tensor]:
        """Every forward's `timestep` tensor, in forward order (the AdaLN plans to build or fetch)."""
        return [step.timesteps for step in self.steps]

    @property
    def key(self) -> str:
        return schedule_key(self.num_steps, self.video_shift, self.audio_shift, self.task)

    def __repr__(self) -> str:
        return f"H3Schedule({self.key})"


def euler_update(sample: Tensor, velocity: Tensor, timestep: Tensor, sigma: Tensor, sigma_next: Tensor) -> Tensor:
    """One rectified-flow Euler step (eta 0) in fp32, as `MiniMaxH3Scheduler.step` computes it.

    The model predicts a data-ward velocity: x0 = x_t + (1 - t) * v, with the sigma recovered from the timestep the
    transformer saw; the blend ratio uses the sigma grid: x_next = r * x_t + (1 - r) * x0, r = sigma_next / sigma.
    `timestep`, `sigma`, `sigma_next` are 0-d fp32 tensors on the sample's device.
    """
    sample = sample.float()
    denoised = sample + (1 - timestep) * velocity.float()
    ratio = sigma_next / sigma
    return ratio * sample + (1.0 - ratio) * denoised
