"""What the served model accepts, and what a request gets when it leaves a field out: one `ModelLimits`.

The engine builds it from the loaded model and its config (`engine.model_limits.model_limits`) and checks every
request against it; `describe()["limits"]` and `GET /v1/models` serve it; the video API (`jobs.limits`)
resolves and checks a job against it at creation without asking a worker, apart from the prompt's token
count (only the tokenizer knows it).

Pydantic only (no torch, no Ray): `jobs/` imports this module and nothing else of the engine.

Durations are bounds on the *snapped* clip, as the model applies them: a request of `seconds` becomes
`round(seconds * fps) + 1` frames, snapped up to the next `frames_per_chunk * n + frame_offset` (17n+5 for
MiniMax-H3), so 5 s -> 121 -> 124 frames = 5.17 s, and 15 s -> 362 frames = 15.08 s is over a 15 s bound.
"""

from __future__ import annotations

import math
from fractions import Fraction

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "DEFAULT_SECONDS", "DEFAULT_SHORT_EDGE", "DEFAULT_STEPS", "MAX_PROMPT_CHARS", "QUALITY_LINEARS", "Linears",
    "ModelLimits", "Quality", "Quantization", "ServedAdapter", "served_limits", "served_qualities",
]

#: Longest prompt in characters any request may send (the schema's bound; tokens are the model's).
MAX_PROMPT_CHARS = 20000
#: What a request that leaves the field out gets, where the model allows it.
DEFAULT_SECONDS = 5.0
DEFAULT_STEPS = 50
DEFAULT_SHORT_EDGE = 768
DEFAULT_ASPECT = Fraction(16, 9)
#: The largest edge a model without a fixed short edge is offered (the engine request's own bound).
MAX_EDGE = 8192


#: A request's tier: lossless (bf16 linears, Cache-DiT off), high (bf16 + the Cache-DiT profile), fp8 (float8
#: block linears, Cache-DiT off).
Quality = Literal["lossless", "high", "fp8"]
#: The weights the block linears run with.
Linears = Literal["bf16", "fp8"]
#: `engine.quantization`: none (bf16), fp8 (float8 only), bf16+fp8 (both held, chosen per request).
Quantization = Literal["none", "fp8", "bf16+fp8"]
QUALITY_LINEARS: dict[str, Linears] = {"lossless": "bf16", "high": "bf16", "fp8": "fp8"}
#: Which served tier a request without one gets: the first served in this order (high is never a default).
DEFAULT_QUALITY_ORDER: tuple[Quality, ...] = ("lossless", "fp8")


def served_qualities(quantization: Quantization, cache_dit: bool) -> tuple[Quality, ...]:
    """The tiers a server of `quantization` serves (`cache_dit`: engine.cache_dit.enabled, which `high` needs)."""
    bf16 = quantization in ("none", "bf16+fp8")
    tiers: list[Quality] = ["lossless", "high"] if bf16 and cache_dit else ["lossless"] if bf16 else []
    if quantization in ("fp8", "bf16+fp8"):
        tiers.append("fp8")
    return tuple(tiers)


#: A configured adapter's name: what requests put in `adapters[].name` (`/v1/generations`) or `lora` (`/v1/videos`).
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class ServedAdapter(BaseModel):
    """A LoRA adapter the server holds under `name` (`engine.adapters`), with what a request naming it gets
    for the fields it leaves out (None: the model's default). Clients name it; they never pass a path."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(..., pattern=ADAPTER_NAME_PATTERN, description="What a request names the adapter by.")
    steps: int | None = Field(None, ge=2, description="Grid points a request naming it gets by default "
                              "(a 4-step distilled adapter: 5; an 8-step one: 9).")
    flow_shift: float | None = Field(None, gt=0, description="Video shift it gets by default.")
    audio_flow_shift: float | None = Field(None, gt=0, description="Audio shift it gets by default.")
    scale: float = Field(1.0, description="Strength when the request gives none: a multiplier of alpha / rank.")
    fuse: bool = Field(False, description="Added into the base weights while requests use it (no per-forward cost).")


class ModelLimits(BaseModel):
    """Bounds and defaults of one served model. Sizes: both edges multiples of `size_multiple` within
    `min_edge..max_edge`, the short edge `short_edge` (None: any), at most `max_pixels`."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(..., min_length=1, description="Model name clients put in `model` (no weights fingerprint).")
    min_seconds: float = Field(..., gt=0, description="Shortest clip, of the snapped frame count.")
    max_seconds: float = Field(..., gt=0, description="Longest clip, of the snapped frame count.")
    default_seconds: float = Field(DEFAULT_SECONDS, gt=0, description="Duration when the request gives none.")
    fps: int = Field(24, ge=1, description="Frames per second of the MP4.")
    frames_per_chunk: int = Field(17, ge=1, description="Frame counts are snapped up to frames_per_chunk*n + frame_offset.")
    frame_offset: int = Field(5, ge=0, description="See frames_per_chunk.")
    size_multiple: int = Field(32, ge=1, description="Width and height must be multiples of this.")
    short_edge: int | None = Field(None, ge=1, description="The short edge every size must have; None: any.")
    min_edge: int = Field(..., ge=1, description="Smallest width or height.")
    max_edge: int = Field(..., ge=1, description="Largest width or height.")
    max_pixels: int = Field(..., ge=1, description="Largest width x height.")
    default_size: str = Field(..., description="`WIDTHxHEIGHT` when the request gives neither size nor aspect_ratio.")
    default_short_edge: int = Field(..., ge=1, description="Short edge with aspect_ratio when short_edge is absent.")
    min_steps: int = Field(2, ge=2, description="Fewest sampling grid points (2: one model pass).")
    max_steps: int = Field(..., ge=2, description="Most sampling grid points.")
    default_steps: int = Field(DEFAULT_STEPS, ge=2, description="Grid points when the request gives none.")
    default_flow_shift: float = Field(12.0, gt=0, description="Video timestep shift when the request gives none.")
    default_audio_flow_shift: float = Field(3.0, gt=0, description="Audio timestep shift when the request gives none.")
    max_flow_shift: float = Field(100.0, gt=0, description="Largest video or audio shift.")
    max_prompt_chars: int = Field(MAX_PROMPT_CHARS, ge=1, description="Longest prompt in characters.")
    max_prompt_tokens: int = Field(2048, ge=1, description="Longest prompt in tokens (checked by the text encoder).")
    tasks: tuple[str, ...] = Field(("t2va",), min_length=1, description="What the served partition takes: t2va and "
                                   "fl2va (FL2VA), ref2va (Ref2VA); t2va alone without the vision tower or with sp > 1 and "
                                   "a tensor-parallel text encoder (`EngineConfig.served_tasks`).")
    adapters: tuple[ServedAdapter, ...] = Field((), description="The LoRA adapters a request may name.")
    quantization: Quantization = Field("none", description="engine.quantization: none (bf16 block linears), fp8 "
                                       "(float8 only), bf16+fp8 (both, chosen per request by its quality).")
    qualities: tuple[Quality, ...] = Field(
        ("lossless", "high"), min_length=1, description="The quality tiers a request may ask for; one that leaves "
        "quality out gets the first served of lossless, fp8 (`default_quality`).")

    @property
    def default_quality(self) -> Quality:
        """The tier of a request that names none: lossless where bf16 is served, else fp8."""
        return next(q for q in (*DEFAULT_QUALITY_ORDER, *self.qualities) if q in self.qualities)

    def unserved_quality(self, quality: str) -> str:
        """What a request asking for a tier this server does not serve is told: the tiers it serves."""
        served = ", ".join(repr(q) for q in self.qualities)
        if quality == "high" and "lossless" in self.qualities:
            return (f"'high' runs Cache-DiT, which is off on this server (engine.cache_dit.enabled: false); "
                    f"served: {served}")
        return f"{quality!r} is not served by this server (engine.quantization: {self.quantization}); served: {served}"

    @model_validator(mode="after")
    def _defaults_within_bounds(self) -> ModelLimits:
        # Otherwise the server starts and refuses, as the client's fault, every request that leaves a field out.
        if not self.min_seconds <= self.snapped_seconds(self.default_seconds) <= self.max_seconds:
            raise ValueError(f"default_seconds={self.default_seconds:g} snaps to "
                             f"{self.snapped_seconds(self.default_seconds):g} s, outside "
                             f"{self.min_seconds:g}..{self.max_seconds:g}")
        if not self.min_steps <= self.default_steps <= self.max_steps:
            raise ValueError(f"default_steps={self.default_steps} is outside {self.min_steps}..{self.max_steps}")
        width, sep, height = self.default_size.partition("x")
        if not sep or not width.isdigit() or not height.isdigit():
            raise ValueError(f"default_size={self.default_size!r} is not WIDTHxHEIGHT")
        problem = self.size_problem(int(width), int(height))
        if problem is not None:
            raise ValueError(f"default_size: {problem}")
        for adapter in self.adapters:
            if adapter.steps is not None and not self.min_steps <= adapter.steps <= self.max_steps:
                raise ValueError(f"adapter {adapter.name!r}: steps={adapter.steps} is outside "
                                 f"{self.min_steps}..{self.max_steps}")
        return self

    def adapter(self, name: str) -> ServedAdapter | None:
        """The served adapter called `name` (None: no such adapter)."""
        return next((a for a in self.adapters if a.name == name), None)

    def unknown_adapter(self, name: str) -> str:
        """What a request naming an adapter this server does not hold is told: the names it holds."""
        served = ", ".join(repr(a.name) for a in self.adapters) or "none"
        return f"{name!r} is not an adapter of this server (served: {served})"

    def snapped_frames(self, seconds: float) -> int:
        """The frames a clip of `seconds` gets: `round(seconds * fps) + 1`, snapped up (5 s at 24 fps -> 124)."""
        return _snapped_frames(seconds, self.fps, self.frames_per_chunk, self.frame_offset)

    def snapped_seconds(self, seconds: float) -> float:
        """The duration actually generated for a request of `seconds` (5 -> 5.1667 at 24 fps)."""
        return self.snapped_frames(seconds) / self.fps

    def size_problem(self, width: int, height: int) -> str | None:
        """What is wrong with a `width x height` canvas (`"WxH: ..."` naming the limit), None when it fits."""
        size = f"{width}x{height}"
        for edge in (width, height):
            if edge % self.size_multiple:
                return f"{size}: {edge} is not a multiple of the model's size_multiple={self.size_multiple}"
            if edge < self.min_edge:
                return f"{size}: {edge} is below the model's min_edge={self.min_edge}"
            if edge > self.max_edge:
                return f"{size}: {edge} exceeds the model's max_edge={self.max_edge}"
        if self.short_edge is not None and min(width, height) != self.short_edge:
            return f"{size}: the short edge {min(width, height)} is not the model's short_edge={self.short_edge}"
        if width * height > self.max_pixels:
            return f"{size}: {width * height} pixels exceed the model's max_pixels={self.max_pixels}"
        return None


def served_limits(
    name: str, *, max_steps: int, short_edge: int | None, max_pixels: int, size_multiple: int, min_seconds: float,
    max_seconds: float, fps: int, frames_per_chunk: int, frame_offset: int, max_prompt_tokens: int,
    default_flow_shift: float, default_audio_flow_shift: float, tasks: tuple[str, ...] = ("t2va",),
    adapters: tuple[ServedAdapter, ...] = (), quantization: Quantization = "none",
    qualities: tuple[Quality, ...] = ("lossless", "high"), canvas: tuple[int, int] | None = None,
) -> ModelLimits:
    """The limits of a model serving these bounds, with the defaults a request gets: 5 s (within the bounds),
    50 steps (at most max_steps), and a frame: `canvas` (width, height), the checkpoint's own default canvas
    (`model.canvas.CanvasRule.default_size`), where it fits these bounds; else 16:9 at the model's short edge,
    else at the largest short edge <= 768 whose 16:9 frame fits max_pixels (768 -> 1344x768)."""
    if short_edge is not None:
        default_short = min_edge = short_edge
        max_edge = max_pixels // short_edge // size_multiple * size_multiple
    else:
        default_short = _default_short_edge(max_pixels, size_multiple)
        min_edge = size_multiple
        max_edge = min(MAX_EDGE, max_pixels // size_multiple // size_multiple * size_multiple)
    long_edge = _long_edge(default_short, size_multiple, max_pixels)
    if canvas is not None and _fits(canvas, short_edge, min_edge, max(max_edge, min_edge), max_pixels, size_multiple):
        default_short = min(canvas)  # aspect_ratio without short_edge: the checkpoint's short edge too
        default_size = f"{canvas[0]}x{canvas[1]}"
    else:
        default_size = f"{long_edge}x{default_short}"
    default_seconds = min(max(DEFAULT_SECONDS, min_seconds), max_seconds)
    if _snapped_frames(default_seconds, fps, frames_per_chunk, frame_offset) / fps > max_seconds:
        # 5 s snaps past a bound near 5 s: the longest clip within it (its frame count exactly, no snapping).
        longest = (math.floor(max_seconds * fps) - frame_offset) // frames_per_chunk * frames_per_chunk + frame_offset
        default_seconds = max(min_seconds, (longest - 1) / fps)
    return ModelLimits(
        name=name, min_seconds=min_seconds, max_seconds=max_seconds,
        default_seconds=default_seconds, fps=fps,
        frames_per_chunk=frames_per_chunk, frame_offset=frame_offset, size_multiple=size_multiple,
        short_edge=short_edge, min_edge=min_edge, max_edge=max(max_edge, min_edge), max_pixels=max_pixels,
        default_size=default_size, default_short_edge=default_short, max_steps=max_steps,
        default_steps=min(DEFAULT_STEPS, max_steps), default_flow_shift=default_flow_shift,
        default_audio_flow_shift=default_audio_flow_shift, max_prompt_tokens=max_prompt_tokens, tasks=tasks,
        adapters=adapters, quantization=quantization, qualities=qualities,
    )


def _fits(canvas: tuple[int, int], short_edge: int | None, min_edge: int, max_edge: int, max_pixels: int,
          multiple: int) -> bool:
    """Whether a checkpoint's default canvas is a size these bounds accept (a configured geometry may not)."""
    width, height = canvas
    return (all(edge % multiple == 0 and min_edge <= edge <= max_edge for edge in canvas)
            and (short_edge is None or min(canvas) == short_edge) and width * height <= max_pixels)


def _snapped_frames(seconds: float, fps: int, frames_per_chunk: int, frame_offset: int) -> int:
    # model.geometry.frames_for_seconds then snap_num_frames (tests/test_limits.py holds the two equal).
    frames = round(seconds * fps) + 1
    return frames + (frame_offset - frames) % frames_per_chunk


def _long_edge(short_edge: int, multiple: int, max_pixels: int) -> int:
    """The 16:9 long edge for `short_edge`, in multiples, within max_pixels (768 -> 1344)."""
    long_edge = math.floor(short_edge * DEFAULT_ASPECT) // multiple * multiple
    return max(short_edge, min(long_edge, max_pixels // short_edge // multiple * multiple))


def _default_short_edge(max_pixels: int, multiple: int) -> int:
    """The largest short edge <= 768 whose 16:9 frame fits max_pixels."""
    short_edge = DEFAULT_SHORT_EDGE // multiple * multiple
    while short_edge > multiple and short_edge * (math.floor(short_edge * DEFAULT_ASPECT) // multiple * multiple) > max_pixels:
        short_edge -= multiple
    return max(short_edge, multiple)
