"""The packed t2va sequence `[text | audio | video]` that MiniMax-H3's transformer runs over, and its latent codecs.

Row layout (diffusers `MiniMaxH3PrepareLayoutStep.build_packed_sequence` with no keyframes, reproduced bit for bit):
- rows [0, L): text, tag 1; rotary (t, h, w) = (row, 0, 0).
- rows [L, L + 2A): audio, tag 2, channel-major (left channel's A latents, then the right's); rotary t = L + latent
  index, h = 0, w pinned to the first (left channel) or last (right channel) value of the video's width grid.
- rows [L + 2A, S): video, tag 0, one row per (1, 2, 2) patch, frame-major then row-major; rotary t advances by
  5/3 * (1, 4, 4, 4, 4, 1, 4, ...) per latent frame from L (the VAE's 17 -> 5 frame grouping), and (h, w) are the
  patch centres of an aspect-normalised grid spanning [0, 32) along sqrt(latent area), built with numpy's
  `linspace(endpoint=False)` because that is the reference's float64 arithmetic.
Positions are float64, as the reference builds them; the transformer casts them to fp32 itself.
"""

from __future__ import annotations

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


def _position_ids(geometry: VideoGeometry, num_text_tokens: int) -> Tensor:
    """fp64 [S, 3] rotary (t, h, w) of every row of `[text | audio | video]`."""
    _, patch_h, patch_w = geometry.spec.patch_size
    num_audio_latents = geometry.num_audio_latents
    audio_start = num_text_tokens
    video_start = audio_start + geometry.num_audio_rows
    positions = torch.zeros(geometry.num_tokens(num_text_tokens), 3, dtype=torch.float64)

    positions[:audio_start, 0] = torch.arange(num_text_tokens, dtype=torch.float64)

    sqrt_area = np.sqrt(geometry.latent_height * geometry.latent_width)
    rows = torch.from_numpy(_spatial_axis(geometry.latent_height, patch_h, sqrt_area))
    cols = torch.from_numpy(_spatial_axis(geometry.latent_width, patch_w, sqrt_area))

    # Audio shares the video clock (40 latents/s = 24 fps * 5/3 units); channel c sits at the c-th width extreme.
    audio = positions[audio_start:video_start].view(geometry.spec.audio_channels, num_audio_latents, 3)
    audio[:, :, 0] = float(num_text_tokens) + torch.arange(num_audio_latents, dtype=torch.float64)
    audio[0, :, 2] = float(cols[0])
    audio[1:, :, 2] = float(cols[-1])

    video = positions[video_start:].view(geometry.num_latent_frames, rows.numel(), cols.numel(), 3)
    video[..., 0] = _latent_frame_times(geometry.num_latent_frames, float(num_text_tokens))[:, None, None]
    video[..., 1] = rows[None, :, None]
    video[..., 2] = cols[None, None, :]
    return positions


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Where every row of one request's packed sequence comes from; depends on geometry and text length only.

    Invariants (true by construction, checked in tests/test_h3_denoise.py): text, audio and video indices partition
    range(S) into three contiguous runs in that order; `token_tags` is TEXT_TAG / AUDIO_TAG / VIDEO_TAG on exactly
    those runs.
    """

    geometry: VideoGeometry
    num_text_tokens: int
    position_ids: Tensor  # fp64 [S, 3]
    token_tags: Tensor  # int64 [S]
    text_indices: Tensor  # int64 [L]
    audio_indices: Tensor  # int64 [2A]
    video_indices: Tensor  # int64 [Nv]

    @classmethod
    def build(cls, geometry: VideoGeometry, num_text_tokens: int, device: torch.device | str = "cpu") -> PackedLayout:
        if isinstance(num_text_tokens, bool) or not isinstance(num_text_tokens, int) or num_text_tokens < 1:
            raise PackingError(f"num_text_tokens={num_text_tokens!r} must be an integer >= 1")
        audio_start = num_text_tokens
        video_start = audio_start + geometry.num_audio_rows
        num_tokens = geometry.num_tokens(num_text_tokens)
        token_tags = torch.full((num_tokens,), VIDEO_TAG, dtype=torch.long)
        token_tags[:audio_start] = TEXT_TAG
        token_tags[audio_start:video_start] = AUDIO_TAG
        layout = cls(
            geometry=geometry,
            num_text_tokens=num_text_tokens,
            position_ids=_position_ids(geometry, num_text_tokens),
            token_tags=token_tags,
            text_indices=torch.arange(0, audio_start),
            audio_indices=torch.arange(audio_start, video_start),
            video_indices=torch.arange(video_start, num_tokens),
        )
        return layout.to(device)

    @property
    def num_tokens(self) -> int:
        return self.token_tags.shape[0]

    def to(self, device: torch.device | str) -> PackedLayout:
        return PackedLayout(
            geometry=self.geometry,
            num_text_tokens=self.num_text_tokens,
            position_ids=self.position_ids.to(device),
            token_tags=self.token_tags.to(device),
            text_indices=self.text_indices.to(device),
            audio_indices=self.audio_indices.to(device),
            video_indices=self.video_indices.to(device),
        )

    def timestep_indices(self, video_index: int, audio_index: int) -> Tensor:
        """int64 [S]: every row's index into its forward's `timestep` tensor (text rows share video's)."""
        indices = torch.full((self.num_tokens,), video_index, dtype=torch.long, device=self.token_tags.device)
        indices[self.audio_indices] = audio_index
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
