"""What one served model accepts, and the resolution of an API request into a `VideoSpec` against it.

The defaults are MiniMax-H3's (shared/h3.md sections 4 and 6): 4-15 s at 24 fps, short edge 768, at most
1344x768 pixels, 32-px multiples, 50 steps, flow shift 12 (video) and 3 (audio). A tiny test model passes
its own limits.
"""

from __future__ import annotations

import secrets

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jobs.backend import VideoSpec
from jobs.errors import InvalidVideoRequest
from jobs.schemas import MAX_SEED, VideoCreateRequest

__all__ = ["H3_LIMITS", "VideoModelLimits", "parse_size", "resolve_spec"]


class VideoModelLimits(BaseModel):
    """Bounds and defaults of one served video model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(..., min_length=1, description="Model name clients put in `model`.")
    min_seconds: float = Field(4.0, gt=0, description="Shortest clip.")
    max_seconds: float = Field(15.0, gt=0, description="Longest clip.")
    default_seconds: float = Field(5.0, gt=0, description="Duration when the request gives none.")
    fps: int = Field(24, ge=1, description="Frames per second of the MP4 (informational).")
    size_multiple: int = Field(32, ge=1, description="Width and height must be multiples of this.")
    short_edge: int | None = Field(
        None, ge=1, description="The short edge every size must have (H3's engine serves 768 only); None: any."
    )
    min_edge: int = Field(256, ge=1, description="Smallest width or height.")
    max_edge: int = Field(1344, ge=1, description="Largest width or height.")
    max_pixels: int = Field(1344 * 768, ge=1, description="Largest width x height.")
    default_size: str = Field("1344x768", description="Size when the request gives neither size nor aspect_ratio.")
    default_short_edge: int = Field(768, ge=1, description="Short edge with aspect_ratio when short_edge is absent.")
    min_steps: int = Field(2, ge=1, description="Fewest sampling grid points (2: one model pass).")
    max_steps: int = Field(100, ge=1, description="Most sampling grid points.")
    default_steps: int = Field(50, ge=1, description="Grid points when the request gives none.")
    default_flow_shift: float = Field(12.0, gt=0, description="Video timestep shift when the request gives none.")
    default_audio_flow_shift: float = Field(3.0, gt=0, description="Audio timestep shift when the request gives none.")
    max_flow_shift: float = Field(100.0, gt=0, description="Largest video or audio shift.")
    max_prompt_chars: int = Field(8192, ge=1, description="Longest prompt in characters.")

    @model_validator(mode="after")
    def _defaults_within_bounds(self) -> VideoModelLimits:
        if not self.min_seconds <= self.default_seconds <= self.max_seconds:
            raise ValueError(
                f"default_seconds={self.default_seconds} is outside {self.min_seconds}..{self.max_seconds}"
            )
        if not self.min_steps <= self.default_steps <= self.max_steps:
            raise ValueError(f"default_steps={self.default_steps} is outside {self.min_steps}..{self.max_steps}")
        width, height = parse_size(self.default_size, "default_size")
        check_size(self, width, height, "default_size")
        return self


def parse_size(size: str, field: str = "size") -> tuple[int, int]:
    """`"1344x768"` -> (1344, 768)."""
    width, sep, height = size.partition("x")
    if not sep or not width.isdigit() or not height.isdigit():
        raise InvalidVideoRequest(field, f"{size!r} is not WIDTHxHEIGHT (e.g. '1344x768')")
    return int(width), int(height)


def check_size(limits: VideoModelLimits, width: int, height: int, field: str) -> None:
    size = f"{width}x{height}"
    for edge in (width, height):
        if edge % limits.size_multiple:
            raise InvalidVideoRequest(
                field, f"{size}: {edge} is not a multiple of the model's size_multiple={limits.size_multiple}"
            )
        if edge < limits.min_edge:
            raise InvalidVideoRequest(field, f"{size}: {edge} is below the model's min_edge={limits.min_edge}")
        if edge > limits.max_edge:
            raise InvalidVideoRequest(field, f"{size}: {edge} exceeds the model's max_edge={limits.max_edge}")
    if limits.short_edge is not None and min(width, height) != limits.short_edge:
        raise InvalidVideoRequest(
            field, f"{size}: the short edge {min(width, height)} is not the model's short_edge={limits.short_edge}"
        )
    if width * height > limits.max_pixels:
        raise InvalidVideoRequest(
            field, f"{width}x{height}: {width * height} pixels exceed the model's max_pixels={limits.max_pixels}"
        )


def size_from_aspect(limits: VideoModelLimits, aspect_ratio: str, short_edge: int) -> tuple[int, int]:
    """(width, height) with the short edge `short_edge` and the long edge the largest multiple of
    size_multiple within the ratio: 16:9 at 768 -> 1344x768, 9:16 -> 768x1344, 1:1 -> 768x768."""
    a, _, b = aspect_ratio.partition(":")
    ratio_w, ratio_h = int(a), int(b)
    if ratio_w == 0 or ratio_h == 0:
        raise InvalidVideoRequest("aspect_ratio", f"{aspect_ratio!r}: both sides must be positive")
    if short_edge % limits.size_multiple:
        raise InvalidVideoRequest(
            "short_edge", f"{short_edge} is not a multiple of the model's size_multiple={limits.size_multiple}"
        )
    larger, smaller = max(ratio_w, ratio_h), min(ratio_w, ratio_h)
    long_edge = short_edge * larger // smaller // limits.size_multiple * limits.size_multiple
    return (long_edge, short_edge) if ratio_w >= ratio_h else (short_edge, long_edge)


H3_LIMITS = VideoModelLimits(name="MiniMax-H3")


def resolve_spec(request: VideoCreateRequest, limits: VideoModelLimits, seed: int | None = None) -> VideoSpec:
    """The request with every default filled in, checked against the model. InvalidVideoRequest names the
    field, the value and the limit. `seed`: used when the request has none (None: drawn at random)."""
    prompt = request.prompt
    if not prompt.strip():
        raise InvalidVideoRequest("prompt", "must not be blank")
    if len(prompt) > limits.max_prompt_chars:
        raise InvalidVideoRequest(
            "prompt", f"{len(prompt)} characters exceed the model's max_prompt_chars={limits.max_prompt_chars}"
        )

    seconds = limits.default_seconds if request.seconds is None else request.seconds
    if seconds < limits.min_seconds:
        raise InvalidVideoRequest("seconds", f"{seconds:g} is below the model's min_seconds={limits.min_seconds:g}")
    if seconds > limits.max_seconds:
        raise InvalidVideoRequest("seconds", f"{seconds:g} exceeds the model's max_seconds={limits.max_seconds:g}")

    if request.size is not None:
        width, height = parse_size(request.size)
        check_size(limits, width, height, "size")
    elif request.aspect_ratio is not None:
        short_edge = limits.default_short_edge if request.short_edge is None else request.short_edge
        width, height = size_from_aspect(limits, request.aspect_ratio, short_edge)
        check_size(limits, width, height, "aspect_ratio")
    else:
        width, height = parse_size(limits.default_size, "default_size")

    steps = limits.default_steps if request.num_inference_steps is None else request.num_inference_steps
    if steps < limits.min_steps:
        raise InvalidVideoRequest("num_inference_steps", f"{steps} is below the model's min_steps={limits.min_steps}")
    if steps > limits.max_steps:
        raise InvalidVideoRequest("num_inference_steps", f"{steps} exceeds the model's max_steps={limits.max_steps}")

    shifts = {
        "flow_shift": limits.default_flow_shift if request.flow_shift is None else request.flow_shift,
        "audio_flow_shift": (
            limits.default_audio_flow_shift if request.audio_flow_shift is None else request.audio_flow_shift
        ),
    }
    for field, shift in shifts.items():
        if shift > limits.max_flow_shift:
            raise InvalidVideoRequest(field, f"{shift:g} exceeds the model's max_flow_shift={limits.max_flow_shift:g}")

    if request.seed is not None:
        seed = request.seed
    elif seed is None:
        seed = secrets.randbelow(MAX_SEED + 1)
    return VideoSpec(
        model=limits.name, prompt=prompt, seconds=seconds, width=width, height=height, num_inference_steps=steps,
        seed=seed, flow_shift=shifts["flow_shift"], audio_flow_shift=shifts["audio_flow_shift"],
        quality=request.quality,
    )
