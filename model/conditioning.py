"""What a keyframe (fl2va) or reference (ref2va) request conditions on, decoded, and its normalization.

Typed decoded inputs (the media bytes are decoded by `model.media`, which is torch-free):

    Keyframe(image, anchor)              fl2va: the clip starts (`first`) and/or ends (`last`) on `image`
    ImageReference(image)                ref2va: up to `MAX_IMAGES`
    VideoReference(frames, fps, audio)   ref2va: frames uint8 [F, H, W, 3]; its soundtrack, if any, float32 [C, S]
    AudioReference(audio, sample_rate)   ref2va: a soundtrack alone (never the only reference)
    Conditioning(keyframes | references) one request's, in packed order; `.task`, `.content_hash`

The normalization is diffusers' (`MiniMaxH3ResizeStep`, `MiniMaxH3Ref2VASetupStep`), step for step, so the pixels
that reach the VAE and Qwen3-VL are the reference pipeline's:
- keyframes: the canvas comes from the first keyframe in packed order (first, else last) unless the request names a
  size; that keyframe is stretched onto the canvas (PIL LANCZOS), a second one cover-cropped (rounded size,
  `(src - dst) // 2` offsets).
- image references: their own short edge at `reference_image_short_edge`, rounded to 32, LANCZOS.
- video references: resampled onto 24 fps by whole frames, truncated to the generated frame count, put on the
  canvas their own aspect ratio resolves to (LANCZOS).
- soundtracks: at the audio VAE's rate (`model.media` resamples while decoding), stereo (mono repeated), truncated
  to the generated duration.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
from PIL import Image

from model.canvas import CanvasError, CanvasRule, reference_image_size, resolve_canvas
from model.schedule import Task

FPS = 24
#: Reference counts the released checkpoint documents (diffusers `MiniMaxH3Ref2VASetupStep` defaults).
MAX_IMAGES, MAX_VIDEOS, MAX_AUDIOS, MAX_REFERENCES = 9, 3, 3, 12


class ConditioningError(ValueError):
    """A keyframe or reference the model cannot condition on; `field` names the request field, `index` the
    upload's place in its list when it is about one upload (None: the list as a whole, or another field)."""

    def __init__(self, field: str, message: str, index: int | None = None):
        super().__init__(f"{field}: {message}")
        self.field, self.index = field, index


class KeyframeAnchor(str, Enum):
    """Which end of the clip a keyframe pins."""

    FIRST = "first"
    LAST = "last"

    @classmethod
    def of_frame_index(cls, frame_index: int, num_frames: int, field: str = "frame_index") -> KeyframeAnchor:
        """The frame-index form the APIs use: 0 is `first`; -1 or the clip's last frame (`num_frames - 1` of the
        snapped 17n+5 count) is `last`. MiniMax-H3 anchors nothing in between."""
        if frame_index == 0:
            return cls.FIRST
        if frame_index in (-1, num_frames - 1):
            return cls.LAST
        raise ConditioningError(field, f"{frame_index} is not a keyframe position of this clip: MiniMax-H3 pins the "
                                       f"first (0) and last (-1 or {num_frames - 1}) frames only")


@dataclass(frozen=True, eq=False)
class Keyframe:
    image: Image.Image  # RGB
    anchor: KeyframeAnchor


@dataclass(frozen=True, eq=False)
class ImageReference:
    image: Image.Image  # RGB

    kind = "image"
    has_audio = False


@dataclass(frozen=True, eq=False)
class VideoReference:
    frames: np.ndarray  # uint8 [F, H, W, 3]
    fps: float
    audio: np.ndarray | None = None  # float32 [C, S], C in (1, 2), at `sample_rate`
    sample_rate: int | None = None

    kind = "video"

    @property
    def has_audio(self) -> bool:
        return self.audio is not None


@dataclass(frozen=True, eq=False)
class AudioReference:
    audio: np.ndarray  # float32 [C, S], C in (1, 2)
    sample_rate: int

    kind = "audio"
    has_audio = True


Reference = ImageReference | VideoReference | AudioReference


@dataclass(frozen=True, eq=False)
class Conditioning:
    """One request's keyframes or references, in packed order (keyframes: first, then last)."""

    keyframes: tuple[Keyframe, ...] = ()
    references: tuple[Reference, ...] = ()
    _hash: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.keyframes and self.references:
            raise ConditioningError("references", "keyframes (fl2va) and references (ref2va) are different tasks; "
                                                  "a request carries one or the other")
        anchors = [keyframe.anchor for keyframe in self.keyframes]
        if len(anchors) != len(set(anchors)):
            raise ConditioningError("keyframes", f"one keyframe per anchor (first, last), got {[a.value for a in anchors]}")
        order = {KeyframeAnchor.FIRST: 0, KeyframeAnchor.LAST: 1}
        object.__setattr__(self, "keyframes", tuple(sorted(self.keyframes, key=lambda k: order[k.anchor])))
        if self.references:
            _check_reference_counts(self.references)

    @property
    def task(self) -> Task:
        return Task.FL2VA if self.keyframes else Task.REF2VA if self.references else Task.T2VA

    @property
    def has_reference_audio(self) -> bool:
        return any(reference.has_audio for reference in self.references)

    @property
    def content_hash(self) -> str:
        """16 hex over every pixel and sample, anchor and kind, in order (part of the prompt-embedding cache key)."""
        if not self._hash:
            digest = hashlib.sha256(self.task.value.encode())
            for keyframe in self.keyframes:
                digest.update(keyframe.anchor.value.encode())
                _update_image(digest, keyframe.image)
            for reference in self.references:
                digest.update(reference.kind.encode())
                if isinstance(reference, ImageReference):
                    _update_image(digest, reference.image)
                if isinstance(reference, VideoReference):
                    _update_array(digest, reference.frames)
                    digest.update(float(reference.fps).hex().encode())
                if reference.has_audio:
                    _update_array(digest, np.ascontiguousarray(reference.audio, dtype=np.float32))
                    digest.update(str(reference.sample_rate).encode())
            self._hash.append(digest.hexdigest()[:16])
        return self._hash[0]


def _check_reference_counts(references: tuple[Reference, ...]) -> None:
    kinds = [reference.kind for reference in references]
    for kind, limit in (("image", MAX_IMAGES), ("video", MAX_VIDEOS), ("audio", MAX_AUDIOS)):
        if kinds.count(kind) > limit:
            raise ConditioningError(f"{kind}_references", f"MiniMax-H3 takes at most {limit}, got {kinds.count(kind)}")
    if len(kinds) > MAX_REFERENCES:
        raise ConditioningError("references", f"MiniMax-H3 takes at most {MAX_REFERENCES} in all, got {len(kinds)}")
    if set(kinds) == {"audio"}:
        raise ConditioningError("audio_reference", "a soundtrack needs at least one image or video reference beside it")


def _update_image(digest, image: Image.Image) -> None:
    digest.update(f"{image.mode}:{image.size}".encode())
    digest.update(image.tobytes())


def _update_array(digest, array: np.ndarray) -> None:
    digest.update(f"{array.dtype}:{array.shape}".encode())
    digest.update(np.ascontiguousarray(array).tobytes())


# --- Normalization ---------------------------------------------------------------------------------------


def keyframe_canvas(keyframes: tuple[Keyframe, ...], rule: CanvasRule) -> tuple[int, int]:
    """(width, height) of an fl2va request without a size: the first keyframe's aspect ratio on the rule."""
    height, width = resolve_canvas(*keyframes[0].image.size, rule, field="keyframes")
    return width, height


def place_keyframes(keyframes: tuple[Keyframe, ...], width: int, height: int) -> tuple[Image.Image, ...]:
    """The keyframes on the canvas, packed order: the first stretched, a second cover-cropped."""
    placed = []
    for index, keyframe in enumerate(keyframes):
        image = keyframe.image
        if image.size == (width, height):
            placed.append(image)
        elif index == 0:
            placed.append(image.resize((width, height), Image.Resampling.LANCZOS))
        else:
            scale = max(width / image.size[0], height / image.size[1])
            size = (max(width, round(image.size[0] * scale)), max(height, round(image.size[1] * scale)))
            left, top = max(0, (size[0] - width) // 2), max(0, (size[1] - height) // 2)
            placed.append(image.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height)))
    return tuple(placed)


def normalize_references(references: tuple[Reference, ...], num_frames: int, rule: CanvasRule,
                         sample_rate: int) -> tuple[Reference, ...]:
    """The references on MiniMax-H3's rates and resolutions, packed order (diffusers' ref2va setup step).
    `num_frames`: the generated (17n+5) count; `sample_rate`: the audio VAE's."""
    normalized: list[Reference] = []
    duration = num_frames / FPS
    for index, reference in enumerate(references):
        try:
            audio = None
            if reference.has_audio:
                audio = _normalize_audio(reference.audio, reference.sample_rate, sample_rate, duration,
                                         f"references[{index}].audio")
            if isinstance(reference, ImageReference):
                image = reference.image
                width, height = image.size
                if width > 4 * height or height > 4 * width:
                    raise ConditioningError(f"references[{index}]", f"an image reference must be within 1:4 and 4:1, "
                                                                    f"got {width}x{height}")
                target = reference_image_size(width, height, rule)
                if image.size != target:
                    image = image.resize(target, Image.Resampling.LANCZOS)
                normalized.append(ImageReference(image))
            elif isinstance(reference, VideoReference):
                frames = _normalize_video(reference.frames, reference.fps, num_frames, rule, f"references[{index}]")
                normalized.append(VideoReference(frames, float(FPS), audio, None if audio is None else sample_rate))
            else:
                normalized.append(AudioReference(audio, sample_rate))
        except ConditioningError as exc:
            exc.index = index  # the upload it is about, as data beside its field's name
            raise
    return tuple(normalized)


def _normalize_video(frames: np.ndarray, fps: float, num_frames: int, rule: CanvasRule, field: str) -> np.ndarray:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise ConditioningError(field, f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
    if not fps > 0:
        raise ConditioningError(field, f"the frame rate must be positive, got {fps}")
    if fps != FPS:  # hold each frame until the next one's 24 fps slot, as ffmpeg's fps filter does
        scale = FPS / fps
        slots = np.floor(np.arange(frames.shape[0]) * scale + 0.5).astype(np.int64)
        frames = np.repeat(frames, np.diff(slots, append=math.floor(frames.shape[0] * scale + 0.5)), axis=0)
    frames = frames[:num_frames]
    try:
        height, width = resolve_canvas(frames.shape[2], frames.shape[1], rule, field=field)
    except CanvasError as e:
        raise ConditioningError(field, str(e)) from None
    if frames.shape[1:3] == (height, width):
        return frames
    return np.stack([np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.LANCZOS))
                     for frame in frames])


def _normalize_audio(audio: np.ndarray, rate: int | None, target_rate: int, duration: float, field: str) -> np.ndarray:
    audio = np.asarray(audio)
    if audio.ndim != 2 or audio.shape[0] not in (1, 2):
        raise ConditioningError(field, f"a soundtrack must be [channels, samples], mono or stereo, got "
                                       f"{tuple(audio.shape)}")
    rate = target_rate if rate is None else rate
    if rate != target_rate:
        raise ConditioningError(field, f"a soundtrack must be at the audio VAE's {target_rate} Hz (model.media "
                                       f"resamples while decoding), got {rate} Hz")
    audio = audio.astype(np.float32)[:, : int(duration * rate)]
    if audio.shape[0] != 2:
        audio = np.repeat(audio, 2, axis=0)
    return np.ascontiguousarray(audio)
