"""A keyframe or reference request, prepared for the denoiser: canvas, presentation, condition latents, schedule.

    prepared = prepare_conditioning(conditioning, prompt, size, num_frames, rule, limits, encoders)
    embeds = encoder.encode_presentation(prepared.presentation)        # or the prompt-embedding cache
    Denoiser(prepared.geometry, schedule_for(prepared, steps, ...), embeds.shape[0], device, prepared.conditions)

The order is diffusers' fl2va / ref2va blocks (resize or setup, text encoder, VAE encoder, layout): the canvas
first (the request's size, else the first keyframe's aspect ratio, else 16:9 on the checkpoint's rule), then the
media normalized onto it, then Qwen3-VL's presentation and the VAE latents of the same pixels.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Qwen2TokenizerFast

from model.canvas import CanvasRule
from model.conditioning import (Conditioning, ImageReference, VideoReference, keyframe_canvas, normalize_references,
                                place_keyframes)
from model.denoise import ConditionLatents
from model.encode import AudioConditionEncoder, VisualConditionEncoder
from model.geometry import GeometryLimits, VideoGeometry
from model.packing import AudioBlock, ConditionBlock, ImageBlock, KeyframeBlock, VideoBlock
from model.presentation import ImageProcessing, Presentation, keyframe_presentation, reference_presentation
from model.qwen_video import QwenVideoProcessor
from model.schedule import H3Schedule, Task


@dataclass(frozen=True)
class ConditionEncoders:
    """What preparing a request reads: the tokenizer, image and video processors (Qwen3-VL's; no video processor:
    no video references), the VAE encoders."""

    tokenizer: Qwen2TokenizerFast
    image_processor: ImageProcessing
    visual: VisualConditionEncoder
    audio: AudioConditionEncoder
    video_processor: QwenVideoProcessor | None = None


@dataclass(frozen=True, eq=False)
class PreparedConditioning:
    task: Task
    geometry: VideoGeometry
    presentation: Presentation
    conditions: ConditionLatents

    @property
    def reference_audio(self) -> bool:
        return bool(self.conditions.audio)

    def schedule(self, num_steps: int, video_shift: float, audio_shift: float) -> H3Schedule:
        return H3Schedule.build(num_steps, video_shift, audio_shift, self.task, self.reference_audio)


def request_canvas(conditioning: Conditioning, size: tuple[int, int] | None, rule: CanvasRule) -> tuple[int, int]:
    """(width, height): the request's size, else the first keyframe's aspect ratio, else 16:9, on `rule`."""
    if size is not None:
        return size
    if conditioning.keyframes:
        return keyframe_canvas(conditioning.keyframes, rule)
    return rule.default_size()


def prepare_conditioning(conditioning: Conditioning, prompt: str, size: tuple[int, int] | None, num_frames: int,
                         rule: CanvasRule, limits: GeometryLimits, encoders: ConditionEncoders) -> PreparedConditioning:
    """`size`: (width, height) the request names, None for the model's canvas; `num_frames` as requested (snapped
    to 17n+5 by the geometry). Raises GeometryError / CanvasError / ConditioningError naming the field."""
    width, height = request_canvas(conditioning, size, rule)
    geometry = VideoGeometry.from_frames(width, height, num_frames, limits)
    if conditioning.task is Task.FL2VA:
        placed = place_keyframes(conditioning.keyframes, geometry.width, geometry.height)
        presentation = keyframe_presentation(encoders.tokenizer, encoders.image_processor, prompt, placed)
        blocks: tuple[ConditionBlock, ...] = tuple(KeyframeBlock(k.anchor.value) for k in conditioning.keyframes)
        conditions = ConditionLatents(presentation.token_tags, blocks,
                                      tuple(encoders.visual.encode_image(image) for image in placed))
        return PreparedConditioning(Task.FL2VA, geometry, presentation, conditions)
    if conditioning.task is not Task.REF2VA:
        raise ValueError("prepare_conditioning is for keyframe (fl2va) and reference (ref2va) requests")
    references = normalize_references(conditioning.references, geometry.num_frames, rule, encoders.audio.sample_rate)
    presentation = reference_presentation(encoders.tokenizer, encoders.image_processor, encoders.video_processor,
                                          prompt, references)
    visual, audio, blocks = [], [], []
    for reference in references:
        audio_rows = 0
        if reference.has_audio:
            audio.append(encoders.audio.encode(reference.audio))
            audio_rows = audio[-1].shape[0]
        if isinstance(reference, ImageReference):
            visual.append(encoders.visual.encode_image(reference.image))
            blocks.append(ImageBlock(*visual[-1].shape[2:]))
        elif isinstance(reference, VideoReference):
            visual.append(encoders.visual.encode_frames(reference.frames))
            blocks.append(VideoBlock(*visual[-1].shape[1:], num_audio_rows=audio_rows))
        else:
            blocks.append(AudioBlock(audio_rows))
    conditions = ConditionLatents(presentation.token_tags, tuple(blocks), tuple(visual), tuple(audio))
    return PreparedConditioning(Task.REF2VA, geometry, presentation, conditions)
