"""Uploaded media bytes -> decoded keyframes and references, with every limit checked before the full decode.

Torch-free (numpy, PIL, PyAV) and free of `model/`, so the Serve edge (`deployments/`) can call it before a request
is queued; `engine.conditioning` turns its results into `model.conditioning` inputs:

    decode_image(data, field, limits)  -> PIL RGB image      PNG, JPEG or WebP only
    decode_video(data, field, limits)  -> DecodedVideo       frames uint8 [F, H, W, 3], fps, soundtrack (32 kHz)
    decode_audio(data, field, limits)  -> DecodedAudio       float32 [C, S] resampled to 32 kHz

The order of checks is what keeps a bad upload cheap: the byte size first; then the container's header (the image
format and size, the video's frame size, duration and frame count) before any pixel is decoded, so a decompression
bomb (a small file that decodes to gigapixels) is refused by its header; then the decode itself, where a truncated or
corrupt file is a `MediaError` naming the field. Every error is a `MediaError(ValueError)` with `.field` and
`.reason` (a `MediaProblem`), which the HTTP layer turns into 413 (too large) or 422 (the rest).
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction

import av
import numpy as np
from PIL import Image

#: The audio VAE's rate: every soundtrack is resampled onto it while decoding.
AUDIO_SAMPLE_RATE = 32000
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


class MediaProblem(str, Enum):
    TOO_LARGE = "too_large"  # over a byte, pixel or duration limit (413 for bytes, 422 otherwise)
    FORMAT = "format"  # not an accepted format
    CORRUPT = "corrupt"  # truncated, corrupt, or without the stream asked for


class MediaError(ValueError):
    """An upload that cannot be used; names the request field, the problem and the limit."""

    def __init__(self, field: str, reason: MediaProblem, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class MediaLimits:
    """What the server decodes. Defaults serve the released model (768p canvases, 15 s clips)."""

    max_bytes: int = 32 * 2**20  # per file, before anything is parsed
    max_image_pixels: int = 4096 * 4096  # from the header, before the pixels are decoded
    max_video_pixels: int = 1920 * 1080  # per frame
    max_video_seconds: float = 15.0
    max_video_frames: int = 15 * 60  # a short clip at a high stated rate is as many frames as a long one
    max_audio_seconds: float = 15.0


@dataclass(frozen=True, eq=False)
class DecodedVideo:
    frames: np.ndarray  # uint8 [F, H, W, 3]
    fps: float
    audio: np.ndarray | None  # float32 [C, S] at `sample_rate`, C in (1, 2)
    sample_rate: int | None


@dataclass(frozen=True, eq=False)
class DecodedAudio:
    audio: np.ndarray  # float32 [C, S], C in (1, 2)
    sample_rate: int


def _check_bytes(data: bytes, field: str, limits: MediaLimits) -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MediaError(field, MediaProblem.FORMAT, f"expected file bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise MediaError(field, MediaProblem.CORRUPT, "the file is empty")
    if len(data) > limits.max_bytes:
        raise MediaError(field, MediaProblem.TOO_LARGE, f"{len(data)} bytes is over the limit of {limits.max_bytes}")


def decode_image(data: bytes, field: str, limits: MediaLimits = MediaLimits()) -> Image.Image:
    """An RGB image from PNG / JPEG / WebP bytes; the size is checked from the header before decoding."""
    _check_bytes(data, field, limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only
            if image.format not in IMAGE_FORMATS:
                raise MediaError(field, MediaProblem.FORMAT,
                                 f"{image.format} images are not accepted; send PNG, JPEG or WebP")
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise MediaError(field, MediaProblem.TOO_LARGE, f"{width}x{height} is over the limit of "
                                                                f"{limits.max_image_pixels} pixels")
            image.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:
        raise MediaError(field, MediaProblem.TOO_LARGE, f"refused as a decompression bomb: {e}") from None
    except Image.UnidentifiedImageError:
        raise MediaError(field, MediaProblem.FORMAT, "not an image (PNG, JPEG or WebP)") from None
    except (OSError, SyntaxError, ValueError) as e:
        if isinstance(e, MediaError):
            raise
        raise MediaError(field, MediaProblem.CORRUPT, f"truncated or corrupt image: {e}") from None
    return image.convert("RGB")


def decode_audio(data: bytes, field: str, limits: MediaLimits = MediaLimits()) -> DecodedAudio:
    """A soundtrack (any container PyAV reads) at 32 kHz, mono or stereo (more channels mixed to stereo)."""
    _check_bytes(data, field, limits)
    with _opened(data, field) as container:
        if not container.streams.audio:
            raise MediaError(field, MediaProblem.CORRUPT, "the file holds no audio stream")
        stream = container.streams.audio[0]
        _check_duration(container, stream, limits.max_audio_seconds, field)
        audio = _decode_audio_stream(container, stream, field, limits.max_audio_seconds)
    return DecodedAudio(audio, AUDIO_SAMPLE_RATE)


def decode_video(data: bytes, field: str, limits: MediaLimits = MediaLimits(),
                 keep_seconds: float | None = None) -> DecodedVideo:
    """A video's frames (RGB) and frame rate, and its soundtrack at 32 kHz if it has one.

    `keep_seconds`: the frames a caller reads (a reference is truncated to the generated clip): decoding stops
    after the first `ceil(keep_seconds * fps) + 1`, so a long 1080p upload holds a 5 s clip's frames in memory,
    not 15 s of them. The limits still apply to the whole file as its header states it."""
    _check_bytes(data, field, limits)
    with _opened(data, field) as container:
        if not container.streams.video:
            raise MediaError(field, MediaProblem.CORRUPT, "the file holds no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > limits.max_video_pixels:
            raise MediaError(field, MediaProblem.TOO_LARGE, f"{width}x{height} frames are over the limit of "
                                                            f"{limits.max_video_pixels} pixels")
        _check_duration(container, stream, limits.max_video_seconds, field)
        rate = stream.average_rate or stream.guessed_rate
        if not rate or rate <= 0:
            raise MediaError(field, MediaProblem.CORRUPT, "the video stream states no frame rate")
        max_frames = min(int(limits.max_video_seconds * float(rate)) + 1, limits.max_video_frames)
        if stream.frames and stream.frames > max_frames:  # the header's count, where the container states one
            raise MediaError(field, MediaProblem.TOO_LARGE, f"{stream.frames} frames at {float(rate):g} fps are over "
                                                            f"the limit of {max_frames}")
        kept = max_frames if keep_seconds is None else min(max_frames, math.ceil(keep_seconds * float(rate)) + 1)
        frames = []
        try:
            for frame in container.decode(stream):
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) >= kept and keep_seconds is not None:
                    break
                if len(frames) > max_frames:
                    raise MediaError(field, MediaProblem.TOO_LARGE, f"more than {max_frames} frames "
                                                                    f"({limits.max_video_seconds:g} s at most)")
        except av.FFmpegError as e:
            raise MediaError(field, MediaProblem.CORRUPT, f"truncated or corrupt video: {e}") from None
        if not frames:
            raise MediaError(field, MediaProblem.CORRUPT, "the video stream decodes to no frames")
        audio = None
        if container.streams.audio:
            container.seek(0)
            audio_stream = container.streams.audio[0]
            audio = _decode_audio_stream(container, audio_stream, field, limits.max_video_seconds)
    return DecodedVideo(np.stack(frames), float(Fraction(rate)), audio, AUDIO_SAMPLE_RATE if audio is not None else None)


def has_audio_stream(data: bytes) -> bool:
    """Whether a media file's header states an audio stream, read without decoding (a video reference's
    soundtrack, known before a worker decodes it). False for a file PyAV cannot open: its decode refuses it."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            return bool(container.streams.audio)
    except (av.FFmpegError, OSError, ValueError):
        return False


class _opened:
    """`av.open` on bytes, its errors as MediaError naming the field; closes the container."""

    def __init__(self, data: bytes, field: str):
        self.data, self.field = data, field

    def __enter__(self):
        try:
            self.container = av.open(io.BytesIO(bytes(self.data)), mode="r")
        except (av.FFmpegError, OSError, ValueError) as e:
            raise MediaError(self.field, MediaProblem.FORMAT, f"not a media file PyAV can read: {e}") from None
        return self.container

    def __exit__(self, *exc) -> None:
        self.container.close()


def _check_duration(container, stream, max_seconds: float, field: str) -> None:
    seconds = None
    if stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        seconds = container.duration / av.time_base
    if seconds is not None and seconds > max_seconds:
        raise MediaError(field, MediaProblem.TOO_LARGE, f"{seconds:.2f} s is over the limit of {max_seconds:g} s")


def _decode_audio_stream(container, stream, field: str, max_seconds: float) -> np.ndarray:
    channels = 1 if stream.codec_context.channels == 1 else 2
    resampler = av.AudioResampler(format="fltp", layout="mono" if channels == 1 else "stereo",
                                  rate=AUDIO_SAMPLE_RATE)
    max_samples = int(max_seconds * AUDIO_SAMPLE_RATE) + AUDIO_SAMPLE_RATE  # a second of slack for the last frame
    chunks, total = [], 0
    try:
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray())
                total += chunks[-1].shape[1]
            if total > max_samples:
                raise MediaError(field, MediaProblem.TOO_LARGE, f"more than {max_seconds:g} s of audio")
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray())
    except av.FFmpegError as e:
        raise MediaError(field, MediaProblem.CORRUPT, f"truncated or corrupt audio: {e}") from None
    if not chunks:
        raise MediaError(field, MediaProblem.CORRUPT, "the audio stream decodes to no samples")
    return np.ascontiguousarray(np.concatenate(chunks, axis=1), dtype=np.float32)
