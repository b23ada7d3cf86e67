"""Flow-matching Euler sampling: shifted sigma schedules for video and audio, and the per-step AdaLN plans.

Convention: x_sigma = (1 - sigma) * x0 + sigma * noise, the model predicts v = noise - x0, and the timestep
fed to the time embedder is sigma itself (fp32, in [0, 1]). Video and audio may use different shifts, so a
step can have two distinct timesteps; a step's distinct timesteps (first-appearance order: video, audio)
are its "plan", the unit the AdaLN cache keys on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

#: "video_audio": text -> video + audio (plan width 1 or 2); "video": video only (plan width 1).
MODES = ("video_audio", "video")


@dataclass(frozen=True)
class StepTimesteps:
    """One step's distinct timesteps and which of them each modality's tokens use (text uses video's)."""

    timesteps: Tensor  # fp32 [M], distinct bit patterns, first-appearance order
    video_index: int
    audio_index: int

    @classmethod
    def from_sigmas(cls, video_sigma: float | Tensor, audio_sigma: float | Tensor | None = None) -> "StepTimesteps":
        """Deduplicate by exact fp32 bits: M=1 when audio is absent or bitwise equal to video, else M=2."""
        video = torch.as_tensor(video_sigma, dtype=torch.float32).reshape(1)
        if audio_sigma is None:
            return cls(video, 0, 0)
        audio = torch.as_tensor(audio_sigma, dtype=torch.float32).reshape(1)
        if torch.equal(video.view(torch.int32), audio.view(torch.int32)):
            return cls(video, 0, 0)
        return cls(torch.cat((video, audio)), 0, 1)

    @property
    def num_rows(self) -> int:
        return self.timesteps.shape[0]


def shifted_sigmas(steps: int, shift: float) -> Tensor:
    """linspace(1, 0, steps+1) warped by s*sigma / (1 + (s-1)*sigma) (in fp64, then fp32); ends are exactly 1, 0."""
    sigma = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * sigma / (1 + (shift - 1) * sigma)).to(torch.float32)


class FlowMatchSchedule:
    """Sigmas and AdaLN plans for one request, all computed up front.

    sigmas_video / sigmas_audio: fp32 [steps+1], from 1 down to 0. Step i moves sigma[i] -> sigma[i+1] and
    evaluates the model at timesteps (sigmas_video[i], sigmas_audio[i]).
    """

    def __init__(self, steps: int, shift: float = 1.0, audio_shift: float | None = None, mode: str = "video_audio"):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        audio_shift = shift if audio_shift is None else audio_shift
        for label, value in (("shift", shift), ("audio_shift", audio_shift)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{label} must be a finite number > 0, got {value!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.steps, self.shift, self.audio_shift, self.mode = steps, float(shift), float(audio_shift), mode
        self.sigmas_video = shifted_sigmas(steps, self.shift)
        self.sigmas_audio = shifted_sigmas(steps, self.audio_shift)
        audio = self.sigmas_audio if mode == "video_audio" else [None] * (steps + 1)
        self._steps = [StepTimesteps.from_sigmas(self.sigmas_video[i], audio[i]) for i in range(steps)]

    def step(self, i: int) -> StepTimesteps:
        return self._steps[i]

    def step_timesteps(self, i: int) -> Tensor:
        """fp32 [M]: step i's distinct timesteps, first-appearance order (video, audio)."""
        return self._steps[i].timesteps

    def step_token_index(self, i: int) -> tuple[int, int]:
        """(video_index, audio_index) into step_timesteps(i); text tokens use the video index."""
        return self._steps[i].video_index, self._steps[i].audio_index

    @property
    def plans(self) -> list[Tensor]:
        """Every step's timesteps, one entry per step (steps entries, possibly with repeats)."""
        return [s.timesteps for s in self._steps]

    @property
    def schedule_key(self) -> str:
        """Stable id of the schedule (equal keys mean equal plans): routing and plan-group affinity use it."""
        return f"flow-euler/steps={self.steps}/shift={self.shift!r}/audio_shift={self.audio_shift!r}/mode={self.mode}"

    def __repr__(self) -> str:
        return f"FlowMatchSchedule({self.schedule_key})"


def euler_step(x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor) -> Tensor:
    """x_{next} = x + (sigma_next - sigma) * v, in fp32, returned in x's dtype."""
    dt = float(sigma_next) - float(sigma)
    return (x.float() + dt * v.float()).to(x.dtype)


def guided(cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
    """Classifier-free guidance: uncond + scale * (cond - uncond)."""
    return uncond + scale * (cond - uncond)
