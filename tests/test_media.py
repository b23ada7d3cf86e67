"""Upload decoding for keyframes and references (`engine.media`): limits before decoding, typed errors naming the
field, soundtracks resampled onto the audio VAE's 32 kHz."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from PIL import Image

from engine.media import (AUDIO_SAMPLE_RATE, MediaError, MediaLimits, MediaProblem, decode_audio, decode_image,
                          decode_video)


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


IMAGE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_png_jpeg_webp_decode_to_rgb(fmt):
    image = decode_image(encoded(IMAGE, fmt), "input_reference")
    assert (image.mode, image.size) == ("RGB", (40, 24))
    if fmt == "PNG":  # lossless: the same pixels
        assert np.array_equal(np.asarray(image), np.asarray(IMAGE))


def test_other_image_formats_are_refused_by_name():
    with pytest.raises(MediaError) as error:
        decode_image(encoded(IMAGE, "GIF"), "image_reference")
    assert (error.value.field, error.value.reason) == ("image_reference", MediaProblem.FORMAT)
    with pytest.raises(MediaError) as error:
        decode_image(b"not an image at all", "image_reference")
    assert error.value.reason is MediaProblem.FORMAT


def test_size_limits_are_checked_before_decoding():
    data = encoded(IMAGE, "PNG")
    with pytest.raises(MediaError) as error:
        decode_image(data, "input_reference", MediaLimits(max_bytes=len(data) - 1))
    assert error.value.reason is MediaProblem.TOO_LARGE and "bytes" in str(error.value)
    # A bomb: a few KB of PNG that decodes to 64 M pixels is refused from its header.
    bomb = encoded(Image.new("1", (8000, 8000)), "PNG")
    assert len(bomb) < 64 * 1024
    with pytest.raises(MediaError) as error:
        decode_image(bomb, "input_reference")
    assert error.value.reason is MediaProblem.TOO_LARGE and "8000x8000" in str(error.value)


def test_truncated_image_is_corrupt_and_names_the_field():
    data = encoded(IMAGE, "PNG")
    with pytest.raises(MediaError) as error:
        decode_image(data[: len(data) // 2], "input_reference")
    assert (error.value.field, error.value.reason) == ("input_reference", MediaProblem.CORRUPT)
    with pytest.raises(MediaError) as error:
        decode_image(b"", "input_reference")
    assert error.value.reason is MediaProblem.CORRUPT


def wav(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="wav") as container:
        layout = "mono" if samples.shape[0] == 1 else "stereo"
        stream = container.add_stream("pcm_s16le", rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray((samples.T.reshape(1, -1) * 32767).astype(np.int16), format="s16",
                                           layout=layout)
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def test_audio_is_resampled_to_32k():
    tone = (0.5 * np.sin(np.linspace(0, 2000 * np.pi, 16000)))[None].repeat(2, axis=0)
    decoded = decode_audio(wav(tone, 16000), "audio_reference")
    assert decoded.sample_rate == AUDIO_SAMPLE_RATE and decoded.audio.dtype == np.float32
    assert decoded.audio.shape[0] == 2 and abs(decoded.audio.shape[1] - 32000) <= 64  # 1 s
    with pytest.raises(MediaError) as error:
        decode_audio(wav(tone, 16000), "audio_reference", MediaLimits(max_audio_seconds=0.5))
    assert error.value.reason is MediaProblem.TOO_LARGE


def h264_clip() -> io.BytesIO:
    """1 s at 12 fps, 64x32, each frame one gray level."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=12)
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        for index in range(12):
            frame = av.VideoFrame.from_ndarray(np.full((32, 64, 3), index * 20, dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer


def test_video_frames_fps_and_soundtrack():
    buffer = h264_clip()
    decoded = decode_video(buffer.getvalue(), "video_reference")
    assert decoded.frames.shape == (12, 32, 64, 3) and decoded.fps == 12.0 and decoded.audio is None
    with pytest.raises(MediaError) as error:
        decode_video(buffer.getvalue(), "video_reference", MediaLimits(max_video_pixels=64 * 31))
    assert error.value.reason is MediaProblem.TOO_LARGE
    # Refused by the container's header (its frame count, its duration) before a frame is decoded.
    for limits, message in ((MediaLimits(max_video_frames=11), "12 frames at 12 fps are over the limit of 11"),
                            (MediaLimits(max_video_seconds=0.9), "1.00 s is over the limit of 0.9 s")):
        with pytest.raises(MediaError) as error:
            decode_video(buffer.getvalue(), "video_reference", limits)
        assert error.value.reason is MediaProblem.TOO_LARGE and error.value.field == "video_reference"
        assert message in str(error.value)
    assert decode_video(buffer.getvalue(), "video_reference", MediaLimits(max_video_frames=12)).frames.shape[0] == 12
    with pytest.raises(MediaError) as error:
        decode_video(encoded(IMAGE, "PNG")[:40], "video_reference")
    assert error.value.field == "video_reference"


@pytest.mark.parametrize("keep_seconds, kept", [(0.25, 4), (0.5, 7), (1.0, 12), (5.0, 12)])
def test_a_caller_reading_the_first_seconds_gets_them_and_no_more(keep_seconds, kept):
    """A reference is cut to the generated clip: decoding stops after ceil(seconds * fps) + 1 frames."""
    data = h264_clip().getvalue()
    whole = decode_video(data, "video_reference")
    part = decode_video(data, "video_reference", keep_seconds=keep_seconds)
    assert part.frames.shape[0] == kept and part.fps == whole.fps == 12.0
    assert np.array_equal(part.frames, whole.frames[:kept])


def test_the_module_imports_no_torch():
    import subprocess
    import sys
    code = "import sys, engine.media; assert 'torch' not in sys.modules and 'model' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
