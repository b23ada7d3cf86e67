"""The packed sequence `[text | conditions | audio | video]` MiniMax-H3's transformer runs over, and its latent codecs.

Row layout (diffusers `MiniMaxH3PrepareLayoutStep.build_packed_sequence` with no keyframes, reproduced bit for bit):
- rows [0, L): text, tag 1; rotary (t, h, w) = (row, 0, 0).
- rows [L, L + 2A): audio, tag 2, channel-major (left channel's A latents, then the right's); rotary t = L + latent
  index, h = 0, w pinned to the first (left channel) or last (right channel) value of the video's width grid.
- rows [L + 2A, S): video, tag 0, one row per (1, 2, 2) patch, frame-major then row-major; rotary t advances by
  5/3 * (1, 4, 4, 4, 4, 1, 4, ...) per latent frame from L (the VAE's 17 -> 5 frame grouping), and (h, w) are the
  patch centres of an aspect-normalised grid spanning [0, 32) along sqrt(latent area), built with numpy's
  `linspace(endpoint=False)` because that is the reference's float64 arithmetic.
Positions are float64, as the reference builds them; the transformer casts them to fp32 itself.

Conditions (diffusers `build_packed_sequence` with keyframe anchors, `build_ref2va_packed_sequence`) sit between
the text and the generated audio, one block each in packed order:
- fl2va `KeyframeBlock`: one latent frame of the target canvas, rotary t = L (`first`) or the last pixel frame's
  time (`last`, numpy's pairwise sum); keyframes do not move the media clock.
- ref2va blocks advance a shared clock from L: an `ImageBlock` (its own size, one integer slot), an `AudioBlock`
  (channel-major, w pinned to the target's width extremes, its latent count), a `VideoBlock` (its soundtrack's
  rows, then its frames at its own size from the same origin, advancing by max(soundtrack latents, the frames'
  sequentially summed span)); the generated audio and video then start at the clock's time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from model.geometry import VideoGeometry

# Per-row modality tags: they index the AdaLN table (row = timestep_index * 3 + tag), a checkpoint contract.
VIDEO_TAG = 0
TEXT_TAG = 1
AUDIO_TAG = 2

# Rotary time of one latent frame: 5/3 units per pixel frame it stands for (1 for a chunk's first, then 4 each).
_ROTARY_UNITS_PER_FRAME = 5.0 / 3.0
_PIXEL_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
_ROTARY_SPATIAL_EXTENT = 32


class PackingError(ValueError):
    """A tensor that does not fit the request's layout; names the argument, its shape and the expected one."""


def _spatial_axis(num_latents: int, patch: int, sqrt_area: float) -> np.ndarray:
    """Patch coordinates of one spatial axis: `num_latents // patch` points, centred, right end excluded, * 32."""
    extent = num_latents / sqrt_area
    start = (1.0 - extent) / 2.0
    return np.linspace(start, start + extent, num_latents // patch, endpoint=False) * _ROTARY_SPATIAL_EXTENT


def _latent_frame_times(num_latent_frames: int, origin: float) -> Tensor:
    """fp64 [F]: the rotary time of every latent frame, starting at `origin`."""
    pattern = _PIXEL_FRAMES_PER_LATENT
    spans = torch.tensor(
        [_ROTARY_UNITS_PER_FRAME * pattern[k % len(pattern)] for k in range(num_latent_frames)], dtype=torch.float64
    )
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


@dataclass(frozen=True)
class KeyframeBlock:
    """fl2va: one keyframe's latent frame on the target canvas, pinned at the first or last frame's rotary time."""

    anchor: str  # "first" | "last"


@dataclass(frozen=True)
class ImageBlock:
    """ref2va: one image reference's latent frame at its own size; takes one integer rotary slot."""

    latent_height: int
    latent_width: int


@dataclass(frozen=True)
class AudioBlock:
    """ref2va: one reference soundtrack's channel-major rows; advances the clock by its latent count."""

    num_rows: int


@dataclass(frozen=True)
class VideoBlock:
    """ref2va: one video reference (its soundtrack's rows first, sharing its origin) at its own size."""

    num_latent_frames: int
    latent_height: int
    latent_width: int
    num_audio_rows: int = 0


ConditionBlock = KeyframeBlock | ImageBlock | AudioBlock | VideoBlock


def _frame_grid(latent_height: int, latent_width: int, patch_h: int, patch_w: int) -> tuple[Tensor, Tensor]:
    """fp64 [rows * cols, 2] (h, w) of one latent frame's patches, row-major, and the width axis."""
    sqrt_area = np.sqrt(latent_height * latent_width)
    rows = torch.from_numpy(_spatial_axis(latent_height, patch_h, sqrt_area))
    cols = torch.from_numpy(_spatial_axis(latent_width, patch_w, sqrt_area))
    grid = torch.stack([rows[:, None].expand(-1, cols.numel()).reshape(-1),
                        cols[None, :].expand(rows.numel(), -1).reshape(-1)], dim=-1)
    return grid, cols


def _last_frame_time(num_latent_frames: int, origin: float) -> float:
    """The rotary time of the last *pixel* frame: the generated span summed pairwise by numpy (the reference's
    order for this anchor; a sequential sum differs in the last ulp from 16 latent frames on)."""
    spans = np.ones(num_latent_frames, dtype=np.float64) * _ROTARY_UNITS_PER_FRAME
    for offset in range(len(_PIXEL_FRAMES_PER_LATENT)):
        spans[offset:: len(_PIXEL_FRAMES_PER_LATENT)] *= _PIXEL_FRAMES_PER_LATENT[offset]
    return origin + float(spans.sum()) - _ROTARY_UNITS_PER_FRAME


def _sequential_span(num_latent_frames: int) -> float:
    """The rotary time a video reference advances the clock by, summed sequentially (the reference's order there)."""
    pattern = _PIXEL_FRAMES_PER_LATENT
    return sum(_ROTARY_UNITS_PER_FRAME * pattern[k % len(pattern)] for k in range(num_latent_frames))


def _fill_audio(positions: Tensor, start: int, num_latents: int, channels: int, time: float, cols: Tensor) -> None:
    """Channel-major audio rows: t = time + latent index; w pinned to the first / last value of `cols`."""
    rows = positions[start: start + num_latents * channels]
    rows[:, 0] = (time + torch.arange(num_latents, dtype=torch.float64)).repeat(channels)
    rows[:num_latents, 2] = float(cols[0])
    rows[num_latents:, 2] = float(cols[-1])


def _fill_video(positions: Tensor, start: int, num_frames: int, grid: Tensor, origin: float) -> None:
    rows = positions[start: start + num_frames * grid.shape[0]].view(num_frames, grid.shape[0], 3)
    rows[..., 0] = _latent_frame_times(num_frames, origin)[:, None]
    rows[..., 1:] = grid[None]


def _build_rows(geometry: VideoGeometry, num_text_tokens: int, blocks: tuple[ConditionBlock, ...]):
    """fp64 positions [S, 3], video row indices, audio row indices, condition video rows, condition audio rows."""
    _, patch_h, patch_w = geometry.spec.patch_size
    channels = geometry.spec.audio_channels
    target_grid, target_cols = _frame_grid(geometry.latent_height, geometry.latent_width, patch_h, patch_w)
    rows_per_frame = target_grid.shape[0]

    def video_rows(frames: int, height: int, width: int) -> int:
        return frames * (height // patch_h) * (width // patch_w)

    sizes = []
    for block in blocks:
        if isinstance(block, KeyframeBlock):
            sizes.append((0, rows_per_frame))
        elif isinstance(block, ImageBlock):
            sizes.append((0, video_rows(1, block.latent_height, block.latent_width)))
        elif isinstance(block, AudioBlock):
            sizes.append((block.num_rows, 0))
        else:
            sizes.append((block.num_audio_rows,
                          video_rows(block.num_latent_frames, block.latent_height, block.latent_width)))
    condition_rows = sum(a + v for a, v in sizes)
    num_tokens = geometry.num_tokens(num_text_tokens) + condition_rows
    positions = torch.zeros(num_tokens, 3, dtype=torch.float64)
    positions[:num_text_tokens, 0] = torch.arange(num_text_tokens, dtype=torch.float64)

    video_runs, audio_runs = [], []
    cursor, clock = num_text_tokens, float(num_text_tokens)
    for block, (num_audio, num_video) in zip(blocks, sizes):
        if isinstance(block, KeyframeBlock):  # keyframes do not move the clock
            if block.anchor == "first":
                time = float(num_text_tokens)
            elif block.anchor == "last":
                time = _last_frame_time(geometry.num_latent_frames, float(num_text_tokens))
            else:
                raise PackingError(f"a keyframe anchor must be 'first' or 'last', got {block.anchor!r}")
            positions[cursor: cursor + num_video, 0] = time
            positions[cursor: cursor + num_video, 1:] = target_grid
        elif isinstance(block, ImageBlock):
            grid, _ = _frame_grid(block.latent_height, block.latent_width, patch_h, patch_w)
            positions[cursor: cursor + num_video, 0] = clock
            positions[cursor: cursor + num_video, 1:] = grid
            clock += 1.0
        elif isinstance(block, AudioBlock):
            _fill_audio(positions, cursor, num_audio // channels, channels, clock, target_cols)
            clock += float(num_audio // channels)
        else:
            grid, cols = _frame_grid(block.latent_height, block.latent_width, patch_h, patch_w)
            _fill_audio(positions, cursor, num_audio // channels, channels, clock, cols)
            _fill_video(positions, cursor + num_audio, block.num_latent_frames, grid, clock)
            clock += max(float(num_audio // channels), _sequential_span(block.num_latent_frames))
        audio_runs.append(torch.arange(cursor, cursor + num_audio))
        video_runs.append(torch.arange(cursor + num_audio, cursor + num_audio + num_video))
        cursor += num_audio + num_video

    audio_start, video_start = cursor, cursor + geometry.num_audio_rows
    # Audio shares the video clock (40 latents/s = 24 fps * 5/3 units); channel c sits at the c-th width extreme.
    _fill_audio(positions, audio_start, geometry.num_audio_latents, channels, clock, target_cols)
    _fill_video(positions, video_start, geometry.num_latent_frames, target_grid, clock)
    video_indices = torch.cat(video_runs + [torch.arange(video_start, num_tokens)])
    audio_indices = torch.cat(audio_runs + [torch.arange(audio_start, video_start)])
    num_condition_video = sum(v for _, v in sizes)
    num_condition_audio = sum(a for a, _ in sizes)
    return positions, video_indices, audio_indices, num_condition_video, num_condition_audio


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Where every row of one request's packed sequence comes from: geometry, text rows and condition blocks.

    `[text | condition blocks | target audio | target video]`; t2va has no blocks. Invariants (checked in
    tests/test_h3_denoise.py and tests/test_h3_fl2va.py): text, audio and video indices partition range(S);
    `video_indices` / `audio_indices` list the condition rows first (`num_condition_video_rows`,
    `num_condition_audio_rows` of them), then the generated ones, which are one contiguous run each at the end;
    text rows are TEXT_TAG except a vision block's rows (VIDEO_TAG), audio rows AUDIO_TAG, video rows VIDEO_TAG.
    """

    geometry: VideoGeometry
    num_text_tokens: int
    position_ids: Tensor  # fp64 [S, 3]
    token_tags: Tensor  # int64 [S]
    text_indices: Tensor  # int64 [L]
    audio_indices: Tensor  # int64 [Nca + 2A]
    video_indices: Tensor  # int64 [Ncv + Nv]
    num_condition_video_rows: int = 0
    num_condition_audio_rows: int = 0

    @classmethod
    def build(cls, geometry: VideoGeometry, num_text_tokens: int, device: torch.device | str = "cpu", *,
              text_token_tags: Tensor | None = None, blocks: tuple[ConditionBlock, ...] = ()) -> PackedLayout:
        """`text_token_tags` [L] (default: all TEXT_TAG; a vision block's rows are VIDEO_TAG); `blocks` in packed
        order (fl2va: `KeyframeBlock`s; ref2va: one block per reference)."""
        if isinstance(num_text_tokens, bool) or not isinstance(num_text_tokens, int) or num_text_tokens < 1:
            raise PackingError(f"num_text_tokens={num_text_tokens!r} must be an integer >= 1")
        if text_token_tags is None:
            text_token_tags = torch.full((num_text_tokens,), TEXT_TAG, dtype=torch.long)
        if tuple(text_token_tags.shape) != (num_text_tokens,):
            raise PackingError(f"text_token_tags of shape {tuple(text_token_tags.shape)}; expected ({num_text_tokens},)")
        positions, video_indices, audio_indices, condition_video, condition_audio = _build_rows(
            geometry, num_text_tokens, tuple(blocks))
        token_tags = torch.empty(positions.shape[0], dtype=torch.long)
        text_indices = torch.arange(num_text_tokens)
        token_tags[text_indices] = text_token_tags.to(torch.long)
        token_tags[audio_indices] = AUDIO_TAG
        token_tags[video_indices] = VIDEO_TAG
        layout = cls(
            geometry=geometry, num_text_tokens=num_text_tokens, position_ids=positions, token_tags=token_tags,
            text_indices=text_indices, audio_indices=audio_indices, video_indices=video_indices,
            num_condition_video_rows=condition_video, num_condition_audio_rows=condition_audio,
        )
        return layout.to(device)

    @property
    def num_tokens(self) -> int:
        return self.token_tags.shape[0]

    def to(self, device: torch.device | str) -> PackedLayout:
        return dataclasses.replace(
            self, position_ids=self.position_ids.to(device), token_tags=self.token_tags.to(device),
            text_indices=self.text_indices.to(device), audio_indices=self.audio_indices.to(device),
            video_indices=self.video_indices.to(device),
        )

    def timestep_indices(self, video_index: int, audio_index: int, condition_video_index: int | None = None,
                         condition_audio_index: int | None = None) -> Tensor:
        """int64 [S]: every row's index into its forward's `timestep` tensor (text rows share video's)."""
        indices = torch.full((self.num_tokens,), video_index, dtype=torch.long, device=self.token_tags.device)
        indices[self.audio_indices] = audio_index
        if self.num_condition_video_rows:
            indices[self.video_indices[: self.num_condition_video_rows]] = condition_video_index
        if self.num_condition_audio_rows:
            indices[self.audio_indices[: self.num_condition_audio_rows]] = condition_audio_index
        return indices


def patchify_video(latents: Tensor, geometry: VideoGeometry) -> Tensor:
    """[C, F, H, W] -> [Nv, C*pt*ph*pw] rows, frame-major then row-major; a row's channels are (c, pt, ph, pw)."""
    expected = geometry.video_latent_shape
    if tuple(latents.shape) != expected:
        raise PackingError(f"video latents of shape {tuple(latents.shape)}; this request's are {expected}")
    channels = expected[0]
    patch_t, patch_h, patch_w = geometry.spec.patch_size
    frames, rows, cols = geometry.patch_grid
    patches = latents.reshape(channels, frames, patch_t, rows, patch_h, cols, patch_w)
    patches = patches.permute(1, 3, 5, 0, 2, 4, 6)  # [frames, rows, cols, C, pt, ph, pw]
    return patches.reshape(frames * rows * cols, geometry.spec.patch_dim).contiguous()


def unpatchify_video(rows: Tensor, geometry: VideoGeometry) -> Tensor:
    """Inverse of `patchify_video`: [Nv, patch_dim] -> [C, F, H, W]."""
    expected = (geometry.num_video_tokens, geometry.spec.patch_dim)
    if tuple(rows.shape) != expected:
        raise PackingError(f"video rows of shape {tuple(rows.shape)}; this request's are {expected}")
    channels = geometry.spec.latent_channels
    patch_t, patch_h, patch_w = geometry.spec.patch_size
    frames, grid_rows, grid_cols = geometry.patch_grid
    patches = rows.reshape(frames, grid_rows, grid_cols, channels, patch_t, patch_h, patch_w)
    patches = patches.permute(3, 0, 4, 1, 5, 2, 6)  # [C, frames, pt, rows, ph, cols, pw]
    return patches.reshape(geometry.video_latent_shape).contiguous()


def audio_rows_to_channels(rows: Tensor, geometry: VideoGeometry) -> Tensor:
    """Channel-major audio rows [2A, Ca] -> [2, Ca, A]: one batch item per stereo channel, as the audio VAE takes."""
    expected = (geometry.num_audio_rows, geometry.spec.audio_latent_channels)
    if tuple(rows.shape) != expected:
        raise PackingError(f"audio rows of shape {tuple(rows.shape)}; this request's are {expected}")
    per_channel = rows.reshape(geometry.spec.audio_channels, geometry.num_audio_latents, expected[1])
    return per_channel.permute(0, 2, 1).contiguous()
