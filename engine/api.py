"""The engine's API types: request, result, and the protocol a fake engine implements (no Ray).

`GenerationRequest` lives here rather than in `deployments/` so the engine does not import the Serve
layer (dependencies point one way: deployments -> engine); `deployments.schemas` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from cache.cache_dit import CacheDitOverrides
from engine.config import MAX_STEPS
from engine.errors import ClientError
from model.config import DiTConfig
from model.sampler import FlowMatchSchedule

MAX_SEED = 2**63 - 1

#: progress(step_index, num_steps) after each denoising step.
ProgressFn = Callable[[int, int], None]
#: cancelled() -> True stops the request between steps with GenerationCancelled.
CancelledFn = Callable[[], bool]


class GenerationRequest(BaseModel):
    """One text -> video+audio latent generation. Sizes are in latent units.

    Checks here are model-independent; limits that depend on the loaded model (max frames/height/width/
    audio, prompt bytes, patch multiples) are checked by the engine, which raises a ValueError naming the
    field and the limit (`engine.errors.ClientError`).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str = Field(..., max_length=4096, description="Text prompt (UTF-8; the model limits its byte length).")
    steps: int = Field(8, ge=1, le=MAX_STEPS, description="Denoising steps (Euler, flow matching).")
    frames: int = Field(2, ge=1, le=4096, description="Latent video frames (multiple of the temporal patch).")
    height: int = Field(16, ge=1, le=4096, description="Latent video height (multiple of the spatial patch).")
    width: int = Field(16, ge=1, le=4096, description="Latent video width (multiple of the spatial patch).")
    audio_len: int = Field(
        8, ge=0, le=65536, description="Audio latent frames (one token per frame); 0: video only."
    )
    shift: float = Field(5.0, gt=0, le=1e4, allow_inf_nan=False, description="Flow-matching shift of the video schedule.")
    audio_shift: float = Field(
        5.0, gt=0, le=1e4, allow_inf_nan=False, description="Flow-matching shift of the audio schedule."
    )
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED, description="Seed of the initial noise; same seed, same bits. None: drawn at random."
    )
    guidance_scale: float = Field(
        1.0, ge=1.0, le=100.0, allow_inf_nan=False,
        description="Classifier-free guidance; > 1 adds an unconditional pass with an empty prompt per step.",
    )
    return_latents: bool = Field(True, description="Include the latents (base64 safetensors) in the response.")
    cache_dit: CacheDitOverrides | None = Field(
        None, description="Per-request changes to the server's Cache-DiT settings (null: the server's)."
    )


def check_limits(request: GenerationRequest, config: DiTConfig, max_steps: int = MAX_STEPS) -> None:
    """Raise ClientError (a ValueError) naming the field and the limit when `request` does not fit the model
    `config`."""
    prompt_bytes = len(request.prompt.encode("utf-8"))
    if prompt_bytes > config.max_text_tokens:
        raise ClientError(
            f"prompt: {prompt_bytes} UTF-8 bytes exceeds the model's max_text_tokens={config.max_text_tokens} "
            "(one token per byte); shorten the prompt"
        )
    if request.steps > max_steps:
        raise ClientError(f"steps: {request.steps} exceeds this server's max_steps={max_steps}")
    for name, value, limit, patch in (
        ("frames", request.frames, config.max_frames, config.patch[0]),
        ("height", request.height, config.max_height, config.patch[1]),
        ("width", request.width, config.max_width, config.patch[2]),
    ):
        if value > limit:
            raise ClientError(f"{name}: {value} exceeds the model's max_{name}={limit} (latent units)")
        if value % patch:
            raise ClientError(f"{name}: {value} is not a multiple of the model's patch size {patch} along {name}")
    if request.audio_len > config.max_audio_len:
        raise ClientError(
            f"audio_len: {request.audio_len} exceeds the model's max_audio_len={config.max_audio_len} (latent frames)"
        )


def schedule_for(request: GenerationRequest) -> FlowMatchSchedule:
    """The request's sampling schedule (its AdaLN plans; `.schedule_key` routes requests to warm replicas)."""
    mode = "video_audio" if request.audio_len > 0 else "video"
    return FlowMatchSchedule(request.steps, request.shift, request.audio_shift, mode=mode)


@dataclass
class GenerationResult:
    """What the engine returns: latents on the CPU in fp32, phase timings and counters."""

    video: torch.Tensor  # [C, F, H, W] fp32, cpu
    audio: torch.Tensor  # [T, Ca] fp32, cpu
    seed: int
    model: str
    timings: dict[str, float] = field(default_factory=dict)  # encode_s, plan_s, denoise_s, total_s
    stats: dict[str, Any] = field(default_factory=dict)  # steps, tokens, plan stats when present


class EngineProtocol(Protocol):
    """What the Serve worker needs from an engine. `engine.engine.Engine` is the real one; a fake for
    Serve-layer tests implements the same. Errors are `engine.errors` types."""

    def validate(self, request: GenerationRequest) -> None:
        """ClientError if the loaded model cannot take `request` (cheap; no generation work)."""

    def generate(
        self, request: GenerationRequest, progress: ProgressFn | None = None, cancelled: CancelledFn | None = None
    ) -> GenerationResult: ...

    def validate_weight_update(self, path: str) -> str:
        """The checkpoint's fingerprint, or WeightsRejected; writes nothing."""

    def update_weights(self, path: str) -> dict[str, Any]:
        """Load the checkpoint at `path` in place, between generations; returns `describe()`."""

    def debug_stats(self) -> dict[str, Any]:
        """Plan bookkeeping for tests and operators; must include `model` (the served model's id)."""

    def health(self) -> dict[str, Any]: ...

    def describe(self) -> dict[str, Any]: ...
