"""Request geometry of MiniMax-H3: pixels and seconds in, latent and token counts out.

The arithmetic is the diffusers modular pipeline's (`modular_pipelines/minimax_h3`, t2va):
- the canvas is `width x height` pixels, both multiples of `spatial_ratio * patch_w` (16 * 2 = 32);
- frames run at 24 fps and are snapped *up* to the next `17 n + 5` the video VAE encodes (121 -> 124);
- `17 n + 5` frames become `5 n + 2` latent frames; latent height and width are the pixel sizes / 16;
- audio has `round(frames / 24 * 40)` latents per stereo channel, packed channel-major as `2 * that` rows.

Limits are parameters (`GeometryLimits`) so a tiny test model can serve tiny canvases; `RELEASED_GEOMETRY` are the released
model's. Duration bounds are the diffusers pipeline's, 5 to 15 s, applied like the pipeline applies them: to the
duration of the *snapped* frame count (so a 15 s request, 361 -> 362 frames = 15.08 s, is rejected; the longest
accepted request snaps to 345 frames = 14.375 s). vllm-omni and sglang accept 4 s; pass `min_seconds=4` for that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class GeometryError(ValueError):
    """A request size or duration the model cannot generate; names the field, the value and the limit."""

    def __init__(self, field: str, value: object, limit: str):
        super().__init__(f"{field}={value!r} is out of range: {limit}")
        self.field = field
        self.value = value
        self.limit = limit


@dataclass(frozen=True)
class LatentSpec:
    """What the VAEs and the transformer fix about latents (the released model's values are the defaults)."""

    fps: int = 24
    spatial_ratio: int = 16  # video VAE: pixels per latent, each spatial axis
    frames_per_chunk: int = 17  # video VAE: a temporal chunk of 17 pixel frames ...
    latents_per_chunk: int = 5  # ... keeps 5 latent frames; valid counts are 17 n + 5 -> 5 n + 2
    latent_channels: int = 24
    patch_size: tuple[int, int, int] = (1, 2, 2)  # transformer (t, h, w) patch
    audio_latent_channels: int = 32
    audio_latents_per_second: int = 40  # 32 kHz / hop 800
    audio_channels: int = 2  # stereo, packed channel-major

    @property
    def pixel_multiple(self) -> int:
        """Both pixel axes must be a multiple of this: the VAE's ratio times the patch (16 * 2 = 32)."""
        return self.spatial_ratio * max(self.patch_size[1], self.patch_size[2])

    @property
    def patch_dim(self) -> int:
        """Channels of one packed video row: 24 * 1 * 2 * 2 = 96."""
        patch_t, patch_h, patch_w = self.patch_size
        return self.latent_channels * patch_t * patch_h * patch_w


@dataclass(frozen=True)
class GeometryLimits:
    """What a server accepts. `short_edge=None` accepts any short edge (tiny models)."""

    short_edge: int | None = 768
    max_pixels: int = 768 * 1344
    min_seconds: float = 5.0
    max_seconds: float = 15.0


H3_LATENTS = LatentSpec()
RELEASED_GEOMETRY = GeometryLimits()


def snap_num_frames(num_frames: int, spec: LatentSpec = H3_LATENTS) -> int:
    """The smallest `frames_per_chunk * n + latents_per_chunk` >= num_frames (121 -> 124, 124 -> 124)."""
    if num_frames < 1:
        raise GeometryError("num_frames", num_frames, "must be >= 1")
    shortfall = (spec.latents_per_chunk - num_frames) % spec.frames_per_chunk
    return num_frames + shortfall


def frames_for_seconds(seconds: float, spec: LatentSpec = H3_LATENTS) -> int:
    """Frames requested for a duration, before snapping: `round(seconds * fps) + 1` (5 s -> 121)."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise GeometryError("seconds", seconds, "must be a finite number > 0")
    return round(seconds * spec.fps) + 1


@dataclass(frozen=True)
class VideoGeometry:
    """One request's pixel, latent and token sizes. Build it with `from_frames` or `from_seconds`."""

    width: int
    height: int
    num_frames: int  # snapped, 17 n + 5
    num_latent_frames: int  # 5 n + 2
    latent_height: int
    latent_width: int
    num_audio_latents: int  # per stereo channel
    spec: LatentSpec = H3_LATENTS

    @classmethod
    def from_frames(
        cls,
        width: int,
        height: int,
        num_frames: int,
        limits: GeometryLimits = RELEASED_GEOMETRY,
        spec: LatentSpec = H3_LATENTS,
    ) -> VideoGeometry:
        """Validate the canvas, snap the frame count up, check the snapped duration, derive latent sizes."""
        _check_canvas(width, height, limits, spec)
        snapped = snap_num_frames(num_frames, spec)
        seconds = snapped / spec.fps
        if not limits.min_seconds <= seconds <= limits.max_seconds:
            raise GeometryError(
                "num_frames",
                num_frames,
                f"snaps to {snapped} frames = {seconds:g} s at {spec.fps} fps; "
                f"must be between {limits.min_seconds:g} and {limits.max_seconds:g} s",
            )
        num_chunks = (snapped - spec.latents_per_chunk) // spec.frames_per_chunk
        return cls(
            width=width,
            height=height,
            num_frames=snapped,
            num_latent_frames=num_chunks * spec.latents_per_chunk + 2,
            latent_height=height // spec.spatial_ratio,
            latent_width=width // spec.spatial_ratio,
            # Same expression (and float rounding) as the pipeline: frames / fps * rate, Python round.
            num_audio_latents=int(round(snapped / spec.fps * spec.audio_latents_per_second)),
            spec=spec,
        )

    @classmethod
    def from_seconds(
        cls,
        width: int,
        height: int,
        seconds: float,
        limits: GeometryLimits = RELEASED_GEOMETRY,
        spec: LatentSpec = H3_LATENTS,
    ) -> VideoGeometry:
        """`from_frames(round(seconds * fps) + 1)`: 5 s -> 121 -> 124 frames. A duration out of range is
        reported on `seconds`, the field the caller sent."""
        num_frames = frames_for_seconds(seconds, spec)
        try:
            return cls.from_frames(width, height, num_frames, limits, spec)
        except GeometryError as exc:
            if exc.field != "num_frames":
                raise
            snapped = snap_num_frames(num_frames, spec)
            raise GeometryError(
                "seconds", seconds,
                f"snaps to {snapped} frames = {snapped / spec.fps:g} s at {spec.fps} fps; "
                f"must be between {limits.min_seconds:g} and {limits.max_seconds:g} s",
            ) from None

    @property
    def seconds(self) -> float:
        """Duration actually generated (of the snapped frame count)."""
        return self.num_frames / self.spec.fps

    @property
    def video_latent_shape(self) -> tuple[int, int, int, int]:
        """[C, F, H, W] of the video latents."""
        return (self.spec.latent_channels, self.num_latent_frames, self.latent_height, self.latent_width)

    @property
    def patch_grid(self) -> tuple[int, int, int]:
        """(frames, rows, cols) of patches: the video token grid, frame-major then row-major."""
        patch_t, patch_h, patch_w = self.spec.patch_size
        return (
            self.num_latent_frames // patch_t,
            self.latent_height // patch_h,
            self.latent_width // patch_w,
        )

    @property
    def tokens_per_frame(self) -> int:
        _, rows, cols = self.patch_grid
        return rows * cols

    @property
    def num_video_tokens(self) -> int:
        frames, rows, cols = self.patch_grid
        return frames * rows * cols

    @property
    def num_audio_rows(self) -> int:
        """Audio rows of the packed sequence: every stereo channel's latents, channel-major."""
        return self.num_audio_latents * self.spec.audio_channels

    def num_tokens(self, num_text_tokens: int) -> int:
        """Length of the packed t2va sequence `[text | audio | video]`."""
        return num_text_tokens + self.num_audio_rows + self.num_video_tokens


def _check_canvas(width: int, height: int, limits: GeometryLimits, spec: LatentSpec) -> None:
    multiple = spec.pixel_multiple
    for field, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, int) or value < multiple:
            raise GeometryError(field, value, f"must be an integer >= {multiple}")
        if value % multiple:
            raise GeometryError(field, value, f"must be a multiple of {multiple} px")
    if limits.short_edge is not None and min(width, height) != limits.short_edge:
        field = "width" if width < height else "height"
        raise GeometryError(field, min(width, height), f"the short edge must be {limits.short_edge} px")
    if width * height > limits.max_pixels:
        raise GeometryError("width*height", width * height, f"must be <= {limits.max_pixels} px")
