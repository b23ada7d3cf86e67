"""Qwen3-VL's video processing (transformers' `Qwen3VLVideoProcessor`), written with torch ops alone.

Why ours: transformers' class needs torchvision, and the only torchvision wheel the registry serves is a CUDA build
that fails to import beside our CPU torch, here and in CI. The computation itself is small, so we serve this one
path everywhere (CPU tests check what serves) and check it against the library's output in
tests/test_qwen_video.py, against a fixture written by tests/data/qwen3vl_video/make_fixture.py where torchvision
installs.

The steps, as transformers takes them for diffusers' call (`do_sample_frames=False`, uint8 (T, H, W, 3) frames):
1. `smart_resize`: the frame size rounded to the patch factor (patch x merge), scaled into [min, max] pixels counted
   over the temporally padded frame count.
2. Bicubic antialiased resize of the uint8 frames; on CPU torchvision calls torch's native uint8 kernel, so do we
   (elsewhere it resizes in float32, clamps to [0, 255], rounds and casts back; so do we).
3. Rescale and normalize fused: (x - mean/scale) / (std/scale) in float32.
4. Temporal padding by repeating the last frame, then the patch flattening transformers' `patchify` uses.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"


class VideoProcessingError(ValueError):
    """A video the processor cannot take (too few frames, an aspect ratio over 200)."""


@dataclass(frozen=True)
class VideoProcessorConfig:
    """The fields of a checkpoint's video processor config that the computation reads; defaults are transformers'."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dict(cls, config: dict) -> "VideoProcessorConfig":
        """From the json transformers saves (`size` holds the pixel bounds as shortest_edge / longest_edge)."""
        size = config.get("size") or {}
        defaults = cls()
        return cls(patch_size=int(config.get("patch_size", defaults.patch_size)),
                   temporal_patch_size=int(config.get("temporal_patch_size", defaults.temporal_patch_size)),
                   merge_size=int(config.get("merge_size", defaults.merge_size)),
                   min_pixels=int(size.get("shortest_edge", defaults.min_pixels)),
                   max_pixels=int(size.get("longest_edge", defaults.max_pixels)),
                   image_mean=tuple(float(v) for v in config.get("image_mean", defaults.image_mean)),
                   image_std=tuple(float(v) for v in config.get("image_std", defaults.image_std)),
                   rescale_factor=float(config.get("rescale_factor", defaults.rescale_factor)))

    @classmethod
    def from_pretrained(cls, processor_dir: str | Path) -> "VideoProcessorConfig":
        return cls.from_dict(json.loads((Path(processor_dir) / VIDEO_PROCESSOR_FILE).read_text()))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class VideoFeatures:
    """What Qwen3-VL's forward takes for videos: the flattened patches of all videos and one (t, h, w) grid each."""

    pixel_values_videos: torch.Tensor
    video_grid_thw: torch.Tensor


def smart_resize(num_frames: int, height: int, width: int, config: VideoProcessorConfig) -> tuple[int, int]:
    """transformers' Qwen3-VL video `smart_resize` (the uncapped budget diffusers' call gets)."""
    factor, temporal = config.factor, config.temporal_patch_size
    if num_frames < temporal:
        raise VideoProcessingError(f"a video needs at least {temporal} frames, got {num_frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise VideoProcessingError(f"aspect ratio must be under 200, got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > config.max_pixels:
        beta = math.sqrt(num_frames * height * width / config.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < config.min_pixels:
        beta = math.sqrt(config.min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_bicubic(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 (T, C, H, W) frames resized as torchvision's bicubic antialiased resize does."""
    if frames.shape[-2:] == (height, width):
        return frames
    if frames.device.type == "cpu":  # torch's native uint8 kernel, which torchvision picks on CPU for bicubic
        return F.interpolate(frames, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    resized = F.interpolate(frames.to(torch.float32), size=[height, width], mode="bicubic", align_corners=False,
                            antialias=True)
    return resized.clamp_(0, 255).round_().to(torch.uint8)


def normalize(frames: torch.Tensor, config: VideoProcessorConfig) -> torch.Tensor:
    """transformers' fused rescale + normalize: the mean and std scaled by 1/rescale_factor, in float32."""
    mean = torch.tensor(config.image_mean, device=frames.device) * (1.0 / config.rescale_factor)
    std = torch.tensor(config.image_std, device=frames.device) * (1.0 / config.rescale_factor)
    return frames.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))


def patchify(frames: torch.Tensor, config: VideoProcessorConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(T, C, H, W) float frames -> (grid_t * grid_h * grid_w, C * tp * p * p) patches, the last frame repeated to a
    multiple of the temporal patch; the order is merge-window major, as Qwen3-VL's vision tower reads it."""
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    if pad := -frames.shape[0] % tp:
        frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)), dim=0)
    num_frames, channels, height, width = frames.shape
    grid_t, grid_h, grid_w = num_frames // tp, height // p, width // p
    patches = frames.reshape(grid_t, tp, channels, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(grid_t * grid_h * grid_w, channels * tp * p * p), (grid_t, grid_h, grid_w)


def process_videos(videos: list[np.ndarray], config: VideoProcessorConfig) -> VideoFeatures:
    """uint8 (T, H, W, 3) videos -> the features transformers' processor returns for them, in order."""
    all_patches, grids = [], []
    for video in videos:
        if video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3:
            raise VideoProcessingError(f"a video is uint8 (frames, height, width, 3), got {video.dtype} {video.shape}")
        frames = torch.from_numpy(np.ascontiguousarray(video)).permute(0, 3, 1, 2).contiguous()
        height, width = smart_resize(frames.shape[0], frames.shape[2], frames.shape[3], config)
        patches, grid = patchify(normalize(resize_bicubic(frames, height, width), config), config)
        all_patches.append(patches)
        grids.append(grid)
    return VideoFeatures(pixel_values_videos=torch.cat(all_patches, dim=0),
                         video_grid_thw=torch.tensor(grids, dtype=torch.int64))


class QwenVideoProcessor:
    """Called as diffusers' ref2va step calls transformers' `Qwen3VLVideoProcessor`
    (`videos=[...], do_sample_frames=False, return_tensors="pt"`), so the oracle tests can hand diffusers ours."""

    def __init__(self, config: VideoProcessorConfig) -> None:
        self.config = config
        self.temporal_patch_size = config.temporal_patch_size
        self.merge_size = config.merge_size

    @classmethod
    def from_pretrained(cls, processor_dir: str | Path) -> "QwenVideoProcessor":
        return cls(VideoProcessorConfig.from_pretrained(processor_dir))

    def __call__(self, videos: list[np.ndarray], do_sample_frames: bool = False,
                 return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        if do_sample_frames or return_tensors != "pt":
            raise VideoProcessingError("frames are sampled by the caller (do_sample_frames=False), tensors are torch")
        features = process_videos(videos, self.config)
        return {"pixel_values_videos": features.pixel_values_videos, "video_grid_thw": features.video_grid_thw}
