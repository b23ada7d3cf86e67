"""What Qwen3-VL reads for a keyframe or reference request: the tokenized presentation and its vision inputs.

diffusers' `MiniMaxH3FL2VATextEncoderStep` / `MiniMaxH3Ref2VATextEncoderStep`, reproduced token for token:
- fl2va: per keyframe in packed order `"<Picture i>: "` then a vision block (`<|vision_start|>`, one
  `<|image_pad|>` per merged patch, `<|vision_end|>`), then the prompt verbatim (no chat template, no special
  tokens). The keyframes' pixels go through the image processor in one batch.
- ref2va: per reference in packed order `"<Audio j>: "` for a soundtrack (a waveform never reaches Qwen3-VL; a
  video's soundtrack is labelled before the video), `"<Picture i>: "` + a vision block for an image; labels
  numbered per modality; then the prompt.
A vision block's rows are tagged VIDEO_TAG (the transformer's AdaLN reads the video rows' modulation for them), the
labels and the prompt TEXT_TAG.

Video references need Qwen3-VL's video processor, which needs torchvision; without it they are refused
(`ConditioningError` naming the reference).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import torch
from PIL import Image
from transformers import Qwen2TokenizerFast

from model.conditioning import ConditioningError, ImageReference, Reference, VideoReference
from model.packing import TEXT_TAG, VIDEO_TAG


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


def reference_presentation(tokenizer: Qwen2TokenizerFast, image_processor: ImageProcessing, prompt: str,
                           references: tuple[Reference, ...]) -> Presentation:
    """ref2va: the normalized references (`model.conditioning.normalize_references`), packed order."""
    for index, reference in enumerate(references):
        if isinstance(reference, VideoReference):
            raise ConditioningError(f"references[{index}]", "video references need Qwen3-VL's video processor "
                                                            "(torchvision), which this server does not have")
    images = [reference.image for reference in references if isinstance(reference, ImageReference)]
    counts, pixels, grid = _image_features(image_processor, images)
    builder = _Builder(tokenizer)
    num_audio = num_images = 0
    for reference in references:
        if reference.has_audio:
            num_audio += 1
            builder.text(f"<Audio {num_audio}>: ")
        if isinstance(reference, ImageReference):
            builder.text(f"<Picture {num_images + 1}>: ")
            builder.vision("<|image_pad|>", counts[num_images])
            num_images += 1
    builder.text(prompt)
    return builder.build(prompt, pixels, grid, tuple(images))


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

    def build(self, prompt: str, pixels, grid, images) -> Presentation:
        digest = hashlib.sha256(repr(self.ids).encode())  # labels and block sizes, then every pixel
        for image in images:
            digest.update(f"{image.mode}:{image.size}".encode())
            digest.update(image.tobytes())
        return Presentation(prompt=prompt, token_ids=tuple(self.ids), token_tags=torch.tensor(self.tags),
                            pixel_values=pixels, image_grid_thw=grid,
                            media_hash=digest.hexdigest()[:16])
