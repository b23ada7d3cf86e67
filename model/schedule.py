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
- fl2va and ref2va hold condition rows: keyframes and visual references at max(t_video, 0.999), reference
  soundtracks at 1.0 (diffusers `MiniMaxH3SetTimestepsStep.build_row_timesteps`); those values join each plan
  like any other row's (2-3 distinct timesteps per forward, 3-4 with a soundtrack), so the AdaLN plan cache, keyed
  by the plan's bits, needs no change; the schedule key names the task (and `+audio`).

The sigma grids are computed by `MiniMaxH3Scheduler.set_timesteps` itself, so they are the reference's by
construction; `euler_update` reproduces `MiniMaxH3Scheduler.step` operation for operation (a test checks bit
equality), without its hidden step counter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0
MAX_STEPS = 1000  # far below where fp32 grid collisions could make the two grids differ in length


class Task(str, Enum):
    """MiniMax-H3's tasks: text -> video + audio, keyframes (first / last), references."""

    T2VA = "t2va"
    FL2VA = "fl2va"
    REF2VA = "ref2va"


#: The `t` a visual condition (keyframe, image or video reference) is held at: its rows run at max(t, 0.999).
KEYFRAME_NOISE_AUG = 0.999
#: A reference soundtrack conditions clean, at t = 1.
REFERENCE_AUDIO_TIMESTEP = 1.0


class ScheduleError(ValueError):
    """A schedule parameter out of range; names the field, the value and the limit."""

    def __init__(self, field: str, value: object, limit: str):
        super().__init__(f"{field}={value!r} is out of range: {limit}")
        self.field = field
        self.value = value
        self.limit = limit


def _check(num_steps: int, video_shift: float, audio_shift: float, task: Task | str,
           reference_audio: bool = False) -> Task:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or not 2 <= num_steps <= MAX_STEPS:
        raise ScheduleError("num_steps", num_steps, f"must be an integer in [2, {MAX_STEPS}] (sigma grid points)")
    for field, shift in (("video_shift", video_shift), ("audio_shift", audio_shift)):
        if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift) or shift <= 0:
            raise ScheduleError(field, shift, "must be a finite number > 0")
    try:
        task = Task(task)
    except ValueError:
        raise ScheduleError("task", task, f"must be one of {[t.value for t in Task]}") from None
    if reference_audio and task is not Task.REF2VA:
        raise ScheduleError("reference_audio", reference_audio, "only ref2va requests hold reference audio rows")
    return task


def schedule_key(
    num_steps: int, video_shift: float = VIDEO_SHIFT, audio_shift: float = AUDIO_SHIFT, task: Task | str = Task.T2VA,
    reference_audio: bool = False,
) -> str:
    """Stable id of a schedule, computed without tensors: equal keys mean equal plans (the router hashes it).

    Shifts are written with `float.hex` so two shifts that differ in any bit get different keys. The task and
    whether a ref2va request holds reference audio rows are part of it: they add the condition rows' timesteps
    (0.999, 1.0) to the plans.
    """
    task = _check(num_steps, video_shift, audio_shift, task, reference_audio)
    rows = "+audio" if reference_audio else ""
    return (
        f"h3-rf-euler/{task.value}{rows}/steps={num_steps}"
        f"/video_shift={float(video_shift).hex()}/audio_shift={float(audio_shift).hex()}"
    )


def shifted_sigmas(num_steps: int, shift: float) -> Tensor:
    """fp32 [num_steps]: the scheduler's sigma grid, from exactly 1 down to exactly 0 (CPU)."""
    from diffusers import MiniMaxH3Scheduler  # here, not at import: the ingress imports this module's names

    scheduler = MiniMaxH3Scheduler(shift=float(shift))
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas


@dataclass(frozen=True, eq=False)
class StepPlan:
    """One forward pass: the distinct timesteps it embeds and which of them each modality's rows use."""

    timesteps: Tensor  # fp32 [M], M in 1..4, ascending, distinct: the transformer's `timestep` argument
    video_index: int  # into `timesteps`, for generated video rows and text rows
    audio_index: int  # into `timesteps`, for generated audio rows
    condition_video_index: int | None = None  # keyframe / visual reference rows (max(t, 0.999)); None: none
    condition_audio_index: int | None = None  # reference soundtrack rows (1.0); None: none

    @classmethod
    def of(cls, video_timestep: Tensor, audio_timestep: Tensor, *, condition_video: bool = False,
           condition_audio: bool = False) -> StepPlan:
        """Reduce the row timesteps the way the pipeline does (`torch.unique`, sorted): generated video (and text),
        generated audio, then (if present) visual condition rows at max(t, 0.999) and soundtrack rows at 1.0."""
        values = [video_timestep.to(torch.float32), audio_timestep.to(torch.float32)]
        if condition_video:
            values.append(torch.tensor(max(float(video_timestep), KEYFRAME_NOISE_AUG), dtype=torch.float32))
        if condition_audio:
            values.append(torch.tensor(REFERENCE_AUDIO_TIMESTEP, dtype=torch.float32))
        timesteps, inverse = torch.unique(torch.stack(values), sorted=True, return_inverse=True)
        return cls(timesteps, int(inverse[0]), int(inverse[1]),
                   int(inverse[2]) if condition_video else None,
                   int(inverse[-1]) if condition_audio else None)


@dataclass(frozen=True, eq=False)
class H3Schedule:
    """Sigmas, timesteps and AdaLN plans of one (num_steps, shifts, task), built once, on CPU."""

    num_steps: int
    video_shift: float
    audio_shift: float
    task: Task
    reference_audio: bool
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
        reference_audio: bool = False,
    ) -> H3Schedule:
        """`task` fl2va / ref2va adds the visual condition rows' timestep max(t, 0.999) to every plan;
        `reference_audio` (ref2va with a soundtrack) the soundtrack rows' 1.0."""
        task = _check(num_steps, video_shift, audio_shift, task, reference_audio)
        video_sigmas = shifted_sigmas(num_steps, video_shift)
        audio_sigmas = shifted_sigmas(num_steps, audio_shift)
        if video_sigmas.numel() != audio_sigmas.numel():  # unique_consecutive collapsed a grid point in one of them
            raise ScheduleError("num_steps", num_steps, "the video and audio grids collapse to different lengths")
        video_timesteps, audio_timesteps = 1.0 - video_sigmas[:-1], 1.0 - audio_sigmas[:-1]
        conditioned = task is not Task.T2VA
        steps = tuple(StepPlan.of(v, a, condition_video=conditioned, condition_audio=reference_audio)
                      for v, a in zip(video_timesteps, audio_timesteps))
        return cls(num_steps, float(video_shift), float(audio_shift), task, bool(reference_audio), video_sigmas,
                   audio_sigmas, steps)

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
        return schedule_key(self.num_steps, self.video_shift, self.audio_shift, self.task, self.reference_audio)

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
