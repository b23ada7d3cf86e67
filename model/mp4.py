"""Decoded frames + waveform -> one MP4 (H.264 video, AAC stereo audio), and a PNG thumbnail.

Encoder choice: libx264 (FFmpeg's H.264 encoder, shipped in PyAV's wheels) at CRF 18 with the "veryfast"
preset, pixel format yuv420p, which every browser and player decodes; CRF 18 is visually near-lossless and
"veryfast" keeps a 15 s 1344x768 clip to seconds of host CPU. yuv420p subsamples chroma 2x2, so an odd width or
height is padded to even by repeating the last column / row (the stream is then one pixel larger on that axis).
Audio: FFmpeg's native AAC encoder, stereo at the waveform's sample rate (32 kHz for MiniMax-H3); a mono
waveform is duplicated onto both channels. Muxed with PyAV. A path destination gets `+faststart` (index first,
for progressive playback); a binary stream cannot be rewritten in place, so it gets the index at the end.
The same frames and waveform give the same bytes on every call (`VIDEO_OPTIONS` says what that took).
"""

from __future__ import annotations

import io
import time
from collections import deque
from collections.abc import Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import av
import numpy as np
from PIL import Image

VIDEO_CODEC = "libx264"
VIDEO_PIXEL_FORMAT = "yuv420p"
#: `mbtree=0`: x264's macroblock-tree rate control made the same frames encode to different bytes from call to call
#: (5-19 distinct files in 30 writes of a 49-frame 64x64 clip, even with one encoder thread and with pre-converted
#: YUV input; with it off, or at constant QP, every write was identical), which broke "same seed, same MP4".
#: Measured on 121 synthetic 448x256 frames: encode time unchanged within noise (0.58 vs 0.56 s), PSNR 0.2-1.1 dB
#: higher, files 1.3-1.8x larger at the same CRF (mbtree spends fewer bits on what later frames do not reference).
VIDEO_OPTIONS = {"crf": "18", "preset": "veryfast", "x264-params": "mbtree=0"}
AUDIO_CODEC = "aac"
AUDIO_LAYOUT = "stereo"


class MediaInputError(ValueError):
    """Frames or audio that cannot be encoded; the message names the value and what is expected."""


def write_mp4(dst: Path | BinaryIO, frames: np.ndarray, fps: int, audio: np.ndarray | None,
              sample_rate: int) -> None:
    """Encode uint8 frames [F, H, W, 3] at `fps` and, if given, float32 audio [channels, samples] in [-1, 1]
    at `sample_rate` into one MP4 written to `dst` (a path, or a seekable binary stream)."""
    _check_frames(frames, fps)
    with Mp4Writer(dst, fps, audio, sample_rate) as writer:
        writer.add(frames)


@dataclass(frozen=True)
class ClipsWritten:
    """What `write_mp4_clips` wrote, and where its time went (`source_s` + `encode_wait_s` + `finish_s` is all of
    it)."""

    num_frames: int
    first_frame: np.ndarray  # uint8 [H, W, 3], unpadded: the thumbnail's
    source_s: float  # seconds spent making the clips (the decode); the earlier clips' encode ran under it
    encode_wait_s: float  # seconds the source waited for the encoder to take a clip (x264 slower than the source)
    finish_s: float  # seconds after the source ran dry until the file was done: the encode of the clips still
    # with the encoder (at most `pending`), the flush, the audio


def write_mp4_clips(dst: Path | BinaryIO, clips: Iterable[np.ndarray], fps: int, audio: np.ndarray | None,
                    sample_rate: int, *, pending: int = 2) -> ClipsWritten:
    """`write_mp4` of the clips' frames in order (the same bytes), each clip encoded on a worker thread while the
    caller's `clips` makes the next (a GPU decodes it; PyAV releases the GIL while x264 encodes). At most `pending`
    clips are with the encoder (the one it encodes included) and one more waits for room, so a slow encoder holds
    the decode back instead of piling up frames. Each clip is checked as it comes (MediaInputError). An error on
    either side stops both: the source is closed, no further clip is asked for, the first error is raised here (a
    later one rides along as its `__context__`), and a path destination the writer had begun is removed (a stream's
    bytes are a partial file)."""
    if pending < 1:
        raise ValueError(f"pending must be >= 1 (clips with the encoder), got {pending}")
    start = time.perf_counter()
    queued: deque[Future] = deque()
    first_frame: np.ndarray | None = None
    waited = 0.0

    encoder_failed = False  # the error being raised is the encoder's (a clip's `add`), not the source's
    writer: Mp4Writer | None = None

    def wait_for(future: Future, timed: bool = True) -> None:
        nonlocal waited, encoder_failed
        began = time.perf_counter()
        try:
            future.result()
        except BaseException:
            encoder_failed = True
            raise
        finally:
            waited += (time.perf_counter() - began) if timed else 0.0

    try:
        writer = Mp4Writer(dst, fps, audio, sample_rate)
        with writer, ThreadPoolExecutor(max_workers=1, thread_name_prefix="mp4-encode") as encoder:
            try:
                for clip in clips:
                    _check_clip(clip, fps, None if first_frame is None else first_frame.shape[:2])
                    if first_frame is None:
                        first_frame = clip[0].copy()
                    while queued and (len(queued) >= pending or queued[0].done()):
                        wait_for(queued.popleft())  # an encoder error surfaces before the next clip is asked for
                    queued.append(encoder.submit(writer.add, clip))
                source_done = time.perf_counter()
                while queued:
                    wait_for(queued.popleft(), timed=False)
            except BaseException as exc:
                # The source failed (or the caller's check of a clip): an encoder error already in by then came
                # first and is raised instead, with this one as its __context__. Not over an interrupt or an exit.
                earlier = None
                if not encoder_failed and isinstance(exc, Exception):
                    earlier = next((f.exception() for f in queued
                                    if f.done() and not f.cancelled() and f.exception() is not None), None)
                encoder.shutdown(wait=True, cancel_futures=True)
                if earlier is not None:
                    raise earlier
                raise
            if first_frame is None:
                raise MediaInputError("an MP4 needs at least one frame; the clips held none")
    except BaseException:
        try:
            if isinstance(clips, Generator):  # a decoder's: its frames and device tensors go now, not with the
                clips.close()                 # traceback
        finally:
            if isinstance(dst, (str, Path)) and writer is not None and writer.opened:  # what it started writing
                Path(dst).unlink(missing_ok=True)
        raise
    finished = time.perf_counter()
    source_s = source_done - start - waited
    return ClipsWritten(writer.num_frames, first_frame, source_s, waited, finished - source_done)


class Mp4Writer:
    """One MP4 written as its frames arrive (a decoder's clips, in order), so the encode of a clip can run while
    the next one decodes; `close` (or leaving the `with`) flushes the video and muxes the audio after it. The bytes
    are `write_mp4`'s for the same frames, however they are split. The soundtrack is whole from the start: its
    stream must be in the header, which the first frames write."""

    def __init__(self, dst: Path | BinaryIO, fps: int, audio: np.ndarray | None, sample_rate: int) -> None:
        if not isinstance(fps, int) or fps <= 0:
            raise MediaInputError(f"fps must be a positive integer, got {fps!r}")
        self._stereo = None if audio is None else _stereo(audio, sample_rate)
        self._dst, self._fps, self._sample_rate = dst, fps, sample_rate
        self._container: av.container.OutputContainer | None = None
        self._video: av.VideoStream | None = None
        self._sound: av.AudioStream | None = None
        self._size: tuple[int, int] | None = None  # (height, width) of the first frames, before padding
        self._closed = False
        self._began = False  # the destination was opened for writing
        self.num_frames = 0

    @property
    def opened(self) -> bool:
        """Whether the destination was opened (the first frames came): from then on it holds this writer's bytes."""
        return self._began

    def add(self, frames: np.ndarray) -> None:
        """Encode uint8 frames [F, H, W, 3], the next of the clip; every call's H and W are the first one's."""
        if self._closed:
            raise MediaInputError("frames added after the MP4 was closed")
        _check_clip(frames, self._fps, self._size)
        if self._size is None:
            self._open(frames.shape[1], frames.shape[2])
        for frame in _pad_to_even(frames):
            self._container.mux(self._video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        self.num_frames += frames.shape[0]

    def close(self) -> None:
        """Flush the video encoder, mux the soundtrack and finish the file (once: a second call does nothing).
        MediaInputError if no frame came."""
        if self._closed:
            return
        self._closed = True
        if self._container is None:
            raise MediaInputError("an MP4 needs at least one frame; none was added")
        try:
            self._container.mux(self._video.encode())
            if self._sound is not None:
                # One planar float frame; the encoder context re-chunks it into AAC's 1024-sample frames.
                chunk = av.AudioFrame.from_ndarray(self._stereo, format="fltp", layout=AUDIO_LAYOUT)
                chunk.sample_rate, chunk.pts = self._sample_rate, 0
                self._container.mux(self._sound.encode(chunk))
                self._container.mux(self._sound.encode())
        finally:
            self._discard()

    def __enter__(self) -> "Mp4Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # a failed clip leaves no file to finish: release the encoder and the destination (PyAV still
            self._discard()  # writes what it has; `write_mp4_clips` removes a path)

    def _open(self, height: int, width: int) -> None:
        is_path = isinstance(self._dst, (str, Path))
        options = {"movflags": "+faststart"} if is_path else {}
        self._container = av.open(str(self._dst) if is_path else self._dst, mode="w", format="mp4", options=options)
        self._began = True
        self._video = self._container.add_stream(VIDEO_CODEC, rate=self._fps, options=VIDEO_OPTIONS)
        self._video.width, self._video.height = width + width % 2, height + height % 2
        self._video.pix_fmt = VIDEO_PIXEL_FORMAT
        if self._stereo is not None:
            self._sound = self._container.add_stream(AUDIO_CODEC, rate=self._sample_rate, layout=AUDIO_LAYOUT)
        self._size = (height, width)

    def _discard(self) -> None:
        self._closed = True
        if self._container is not None:
            container, self._container = self._container, None
            container.close()


def thumbnail_png(frame: np.ndarray) -> bytes:
    """A uint8 RGB frame [H, W, 3] as PNG bytes (full size, lossless)."""
    if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
        raise MediaInputError(f"thumbnail frame must be uint8 [height, width, 3], got {frame.dtype} "
                              f"{tuple(frame.shape)}")
    buffer = io.BytesIO()
    Image.fromarray(frame, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def _check_frames(frames: np.ndarray, fps: int) -> None:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3 or 0 in frames.shape:
        raise MediaInputError(f"frames must be uint8 [frames, height, width, 3] with every size >= 1, got "
                              f"{frames.dtype} {tuple(frames.shape)}")
    if not isinstance(fps, int) or fps <= 0:
        raise MediaInputError(f"fps must be a positive integer, got {fps!r}")


def _check_clip(frames: np.ndarray, fps: int, size: tuple[int, int] | None) -> None:
    """`_check_frames`, and the frames' (height, width) is `size`, the first clip's (None: these are the first)."""
    _check_frames(frames, fps)
    if size is not None and frames.shape[1:3] != tuple(size):
        raise MediaInputError(f"frames are {frames.shape[1]}x{frames.shape[2]} (height x width) after "
                              f"{size[0]}x{size[1]} ones: one clip has one size")


def _stereo(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """float32 [2, samples], C-contiguous, clipped to [-1, 1]."""
    if audio.ndim != 2 or audio.shape[0] not in (1, 2) or audio.shape[1] == 0 or audio.dtype != np.float32:
        raise MediaInputError(f"audio must be float32 [1 or 2 channels, samples >= 1], got {audio.dtype} "
                              f"{tuple(audio.shape)}")
    if not np.isfinite(audio).all():  # FFmpeg's AAC encoder refuses them with a bare EINVAL
        raise MediaInputError("audio holds NaN or inf samples")
    if not isinstance(sample_rate, int) or sample_rate <= 0:
        raise MediaInputError(f"sample_rate must be a positive integer, got {sample_rate!r}")
    if audio.shape[0] == 1:
        audio = np.repeat(audio, 2, axis=0)
    return np.ascontiguousarray(np.clip(audio, -1.0, 1.0))


def _pad_to_even(frames: np.ndarray) -> np.ndarray:
    pad_height, pad_width = frames.shape[1] % 2, frames.shape[2] % 2
    if not (pad_height or pad_width):
        return frames
    return np.pad(frames, ((0, 0), (0, pad_height), (0, pad_width), (0, 0)), mode="edge")
