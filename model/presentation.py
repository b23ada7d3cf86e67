"""What Qwen3-VL reads for a keyframe or reference request: the tokenized presentation and its vision inputs.

diffusers' `MiniMaxH3FL2VATextEncoderStep` / `MiniMaxH3Ref2VATextEncoderStep`, reproduced token for token:
- fl2va: per keyframe in packed order `"<Picture i>: "` then a vision block (`<|vision_start|>`, one
  `<|image_pad|>` per merged patch, `<|vision_end|>`), then the prompt verbatim (no chat template, no special
  tokens). The keyframes' pixels go through the image processor in one batch.
- ref2va: per reference in packed order `"<Audio j>: "` for a soundtrack (a waveform never reaches Qwen3-VL; a
  video's soundtrack is labelled before the video), `"<Picture i>: "` + a vision block for an image, `"<Video k>: "`
  + per merged frame group `"<{t:.1f} seconds>"` and a block of `<|video_pad|>`; labels numbered per modality; then
  the prompt. A video is read at VIDEO_SAMPLE_FPS (every 24/2-th frame of the normalized 24 fps video); Qwen3-VL
  merges `temporal_patch_size` sampled frames into one block, labelled with the mean of their timestamps. The
  sampled frames go through our video processor (`model.qwen_video`) in one batch.
A vision block's rows are tagged VIDEO_TAG (the transformer's AdaLN reads the video rows' modulation for them), the
labels and the prompt TEXT_TAG.

A checkpoint whose processor has no video config serves no video references (`ConditioningError` naming the
reference).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2TokenizerFast

from model.conditioning import FPS, ConditioningError, ImageReference, Reference, VideoReference
from model.packing import TEXT_TAG, VIDEO_TAG
from model.qwen_video import QwenVideoProcessor, VideoProcessingError

#: The rate Qwen3-VL reads a reference video at (diffusers' `video_sample_fps` default).
VIDEO_SAMPLE_FPS = 2.0


class ImageProcessing(Protocol):
    """What the presentation needs of Qwen3-VL's image processor (`Qwen2VLImageProcessorPil`)."""

    merge_size: int

    def __call__(self, images: list[Image.Image], return_tensors: str) -> dict: ...


@dataclass(frozen=True, eq=False)
class Presentation:
    """One request's Qwen3-VL input: token ids, their MiniMax-H3 row tags, and the vision tensors."""

    prompt: str
    token_ids: tuple[int, ...]
    token_tags: torch.Tensor  # int64 [L]
    pixel_values: torch.Tensor | None = None  # the image processor's, for every image block in order
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None  # the video processor's, for every video reference in order
    video_grid_thw: torch.Tensor | None = None
    media_hash: str = ""  # of the token ids and every pixel that reached the processor (prompt-cache key part)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def keyframe_presentation(tokenizer: Qwen2TokenizerFast, image_processor: ImageProcessing, prompt: str,
                          keyframes: tuple[Image.Image, ...]) -> Presentation:
    """fl2va: the keyframes as placed on the canvas (`model.conditioning.place_keyframes`), packed order."""
    builder = _Builder(tokenizer)
    counts, pixels, grid = _image_features(image_processor, list(keyframes))
    for index, count in enumerate(counts):
        builder.text(f"<Picture {index + 1}>: ")
        builder.vision("<|image_pad|>", count)
    builder.text(prompt)
    return builder.build(prompt, pixels, grid, keyframes)


def reference_presentation(tokenizer: Qwen2TokenizerFast, image_processor: ImageProcessing,
                           video_processor: QwenVideoProcessor | None, prompt: str,
                           references: tuple[Reference, ...]) -> Presentation:
    """ref2va: the normalized references (`model.conditioning.normalize_references`), packed order."""
    images = [reference.image for reference in references if isinstance(reference, ImageReference)]
    counts, pixels, grid = _image_features(image_processor, images)
    videos = _video_features(video_processor, references)
    builder = _Builder(tokenizer)
    num_audio = num_images = num_videos = 0
    for reference in references:
        if reference.has_audio:
            num_audio += 1
            builder.text(f"<Audio {num_audio}>: ")
        if isinstance(reference, ImageReference):
            builder.text(f"<Picture {num_images + 1}>: ")
            builder.vision("<|image_pad|>", counts[num_images])
            num_images += 1
        elif isinstance(reference, VideoReference):
            builder.text(f"<Video {num_videos + 1}>: ")
            for timestamp in videos.timestamps[num_videos]:
                builder.text(f"<{timestamp:.1f} seconds>")  # str.format rounds half to even, as diffusers renders
                builder.vision("<|video_pad|>", videos.block_tokens[num_videos])
            num_videos += 1
    builder.text(prompt)
    return builder.build(prompt, pixels, grid, tuple(images), videos)


@dataclass(frozen=True)
class _VideoFeatures:
    sampled: tuple[np.ndarray, ...] = ()  # per video, the frames that reached the processor
    timestamps: tuple[tuple[float, ...], ...] = ()  # per video, one per vision block
    block_tokens: tuple[int, ...] = ()  # per video, the pad tokens of each of its blocks
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None


def sample_video_frames(num_frames: int, temporal_patch: int, field: str,
                        index: int | None = None) -> tuple[list[int], list[float]]:
    """The frame indices Qwen3-VL reads of a normalized (24 fps) video, and the timestamp of each merged block:
    every FPS / VIDEO_SAMPLE_FPS-th frame (rounded, deduplicated); the sampled frames' times padded with the last
    to a multiple of `temporal_patch`, each block labelled with the mean of its first and last."""
    stride = FPS / VIDEO_SAMPLE_FPS
    indices: list[int] = []
    cursor = 0.0
    while round(cursor) < num_frames:
        if not indices or round(cursor) > indices[-1]:
            indices.append(round(cursor))
        cursor += stride
    if len(indices) < temporal_patch:
        minimum = round((temporal_patch - 1) * stride) + 1
        raise ConditioningError(field, f"a video reference must run at least {minimum} frames at {FPS} fps "
                                       f"({minimum / FPS:.2g} s), got {num_frames}", index)
    times = [index / VIDEO_SAMPLE_FPS for index in range(len(indices))]
    times += [times[-1]] * (-len(times) % temporal_patch)
    blocks = [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]
    return indices, blocks


def _video_features(video_processor: QwenVideoProcessor | None, references: tuple[Reference, ...]) -> _VideoFeatures:
    places = [i for i, reference in enumerate(references) if isinstance(reference, VideoReference)]
    if not places:
        return _VideoFeatures()
    if video_processor is None:
        raise ConditioningError(f"references[{places[0]}]", "this checkpoint's processor has no video processor "
                                "config (video_preprocessor_config.json), so it serves no video references", places[0])
    sampled, timestamps = [], []
    for place in places:
        video = references[place]
        assert isinstance(video, VideoReference)
        indices, blocks = sample_video_frames(video.frames.shape[0], video_processor.temporal_patch_size,
                                              f"references[{place}]", place)
        sampled.append(video.frames[indices])
        timestamps.append(tuple(blocks))
    try:
        features = video_processor(videos=sampled, do_sample_frames=False, return_tensors="pt")
    except VideoProcessingError as e:
        raise ConditioningError(f"references[{places[0]}]", str(e), places[0]) from None
    grid = features["video_grid_thw"]
    merge = video_processor.merge_size ** 2
    return _VideoFeatures(tuple(sampled), tuple(timestamps), tuple(int(g[1] * g[2]) // merge for g in grid),
                          features["pixel_values_videos"], grid)


def _image_features(image_processor: ImageProcessing, images: list[Image.Image]):
    if not images:
        return [], None, None
    features = image_processor(images=images, return_tensors="pt")
    grid = features["image_grid_thw"]
    merge = image_processor.merge_size ** 2
    return [int(g.prod()) // merge for g in grid], features["pixel_values"], grid


class _Builder:
    def __init__(self, tokenizer: Qwen2TokenizerFast) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.tags: list[int] = []

    def text(self, value: str) -> None:
        ids = self.tokenizer(value, add_special_tokens=False)["input_ids"]
        self.ids += ids
        self.tags += [TEXT_TAG] * len(ids)

    def vision(self, pad_token: str, count: int) -> None:
        token = self.tokenizer.convert_tokens_to_ids
        ids = [token("<|vision_start|>")] + [token(pad_token)] * count + [token("<|vision_end|>")]
        self.ids += ids
        self.tags += [VIDEO_TAG] * len(ids)

    def build(self, prompt: str, pixels, grid, images, videos: _VideoFeatures = _VideoFeatures()) -> Presentation:
        digest = hashlib.sha256(repr(self.ids).encode())  # labels, timestamps and block sizes, then every pixel
        for image in images:
            digest.update(f"{image.mode}:{image.size}".encode())
            digest.update(image.tobytes())
        for frames in videos.sampled:
            digest.update(f"video:{frames.shape}".encode())
            digest.update(np.ascontiguousarray(frames).tobytes())
        return Presentation(prompt=prompt, token_ids=tuple(self.ids), token_tags=torch.tensor(self.tags),
                            pixel_values=pixels, image_grid_thw=grid, pixel_values_videos=videos.pixel_values_videos,
                            video_grid_thw=videos.video_grid_thw, media_hash=digest.hexdigest()[:16])
