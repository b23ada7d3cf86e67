"""model.mp4's clip by clip writing: an MP4 written as a decoder's clips arrive, each encoded on a worker thread
while the next decodes, holds `write_mp4`'s bytes for the same frames however they are split; the decoder never
runs more than `pending` clips ahead of the encoder; an error on either side is raised and stops both."""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest

from model.mp4 import MediaInputError, Mp4Writer, write_mp4, write_mp4_clips

FPS, SAMPLE_RATE = 24, 32000


def frames(num_frames: int, height: int = 32, width: int = 48, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)


def soundtrack(num_frames: int) -> np.ndarray:
    seconds = np.arange(num_frames * SAMPLE_RATE // FPS) / SAMPLE_RATE
    return np.stack([0.3 * np.sin(2 * np.pi * 220 * seconds), 0.2 * np.sin(2 * np.pi * 330 * seconds)]).astype(
        np.float32)


def split(clip: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    assert sum(sizes) == len(clip)
    return np.split(clip, np.cumsum(sizes)[:-1])


def encoder_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("mp4-encode")]


@pytest.mark.parametrize("sizes", [[40], [17, 17, 6], [1, 1, 1, 37], [5] * 8])
@pytest.mark.parametrize("height,width,audio", [(32, 48, True), (33, 47, True), (32, 48, False)])
def test_clips_give_the_bytes_of_the_whole_clip(sizes, height, width, audio):
    video = frames(40, height, width)
    sound = soundtrack(40) if audio else None
    whole, streamed = io.BytesIO(), io.BytesIO()
    write_mp4(whole, video, FPS, sound, SAMPLE_RATE)
    written = write_mp4_clips(streamed, split(video, sizes), FPS, sound, SAMPLE_RATE)
    assert streamed.getvalue() == whole.getvalue()
    assert written.num_frames == 40 and np.array_equal(written.first_frame, video[0])
    assert written.source_s >= 0 and written.finish_s >= 0
    assert not encoder_threads()


def test_a_path_destination_gets_the_same_file_as_write_mp4(tmp_path):
    video = frames(30)
    write_mp4(tmp_path / "whole.mp4", video, FPS, soundtrack(30), SAMPLE_RATE)
    write_mp4_clips(tmp_path / "clips.mp4", split(video, [17, 13]), FPS, soundtrack(30), SAMPLE_RATE)
    assert (tmp_path / "clips.mp4").read_bytes() == (tmp_path / "whole.mp4").read_bytes()


def test_the_writer_alone_is_write_mp4_and_closes_once():
    video = frames(20)
    whole, pieces = io.BytesIO(), io.BytesIO()
    write_mp4(whole, video, FPS, soundtrack(20), SAMPLE_RATE)
    writer = Mp4Writer(pieces, FPS, soundtrack(20), SAMPLE_RATE)
    for clip in split(video, [3, 17]):
        writer.add(clip)
    writer.close()
    writer.close()  # a second close (leaving a `with` after an explicit one) does nothing
    assert pieces.getvalue() == whole.getvalue() and writer.num_frames == 20
    with pytest.raises(MediaInputError, match="after the MP4 was closed"):
        writer.add(video[:1])


@pytest.mark.parametrize("pending", [1, 2, 3])
def test_the_decoder_runs_at_most_pending_clips_ahead_of_a_slow_encoder(monkeypatch, pending):
    yielded, lead = [0], []
    add = Mp4Writer.add

    def slow_add(self, clip):  # clip k's encode starts: how many clips has the source made by then?
        lead.append(yielded[0] - self.num_frames)  # 1 frame per clip: num_frames is the clip's index
        time.sleep(0.02)
        add(self, clip)

    def source():
        for clip in split(frames(12), [1] * 12):
            yielded[0] += 1
            yield clip

    monkeypatch.setattr(Mp4Writer, "add", slow_add)
    write_mp4_clips(io.BytesIO(), source(), FPS, None, SAMPLE_RATE, pending=pending)
    assert max(lead) <= pending + 1  # queued: `pending`; one more just made, waiting for room
    assert max(lead) >= 2  # and the source does run ahead of the clip being encoded


def test_the_encode_runs_while_the_source_makes_the_next_clip(monkeypatch):
    asked_for_the_second = threading.Event()
    add = Mp4Writer.add

    def blocking_add(self, clip):
        assert threading.current_thread().name.startswith("mp4-encode")  # what `encoder_threads` looks for
        # The first clip's encode finishes only once the source has been asked for the second: done one after
        # the other, this would wait out its timeout.
        assert asked_for_the_second.wait(timeout=5)
        add(self, clip)

    def source():
        yield frames(2)
        asked_for_the_second.set()
        yield frames(2, seed=1)

    monkeypatch.setattr(Mp4Writer, "add", blocking_add)
    assert write_mp4_clips(io.BytesIO(), source(), FPS, None, SAMPLE_RATE).num_frames == 4


def test_a_source_error_is_raised_and_stops_the_encoder():
    def source():
        yield frames(3)
        raise RuntimeError("the VAE ran out of memory")

    with pytest.raises(RuntimeError, match="ran out of memory"):
        write_mp4_clips(io.BytesIO(), source(), FPS, soundtrack(3), SAMPLE_RATE)
    assert not encoder_threads()


@pytest.mark.parametrize("clips,message", [
    ([frames(3), frames(3, height=16)], "one clip has one size"),
    ([frames(3), np.zeros((2, 32, 48, 3), np.float32)], "frames must be uint8"),
    ([np.zeros((0, 32, 48, 3), np.uint8)], "every size >= 1"),
    ([], "at least one frame"),
])
def test_bad_clips_are_a_media_input_error_naming_what_is_wrong(clips, message):
    with pytest.raises(MediaInputError, match=message):
        write_mp4_clips(io.BytesIO(), clips, FPS, None, SAMPLE_RATE)
    assert not encoder_threads()


def test_bad_audio_is_refused_before_any_frame_is_decoded():
    def source():
        raise AssertionError("decoded although the audio was refused")
        yield  # pragma: no cover

    with pytest.raises(MediaInputError, match="audio holds NaN"):
        write_mp4_clips(io.BytesIO(), source(), FPS, np.full((2, 100), np.nan, np.float32), SAMPLE_RATE)



def failing_add(monkeypatch, on_clip: int, failed: threading.Event) -> None:
    """Mp4Writer.add raising on clip `on_clip` (0-based), `failed` set once it has."""
    add = Mp4Writer.add
    seen = [0]

    def patched(self, clip):
        index, seen[0] = seen[0], seen[0] + 1
        try:
            if index == on_clip:
                raise MediaInputError(f"the encoder refused clip {index}")
            add(self, clip)
        finally:
            if index == on_clip:
                failed.set()

    monkeypatch.setattr(Mp4Writer, "add", patched)


def test_after_an_encoder_error_no_further_clip_is_asked_for_and_the_source_is_closed(monkeypatch):
    failed = threading.Event()
    failing_add(monkeypatch, 0, failed)
    asked, closed = [0], threading.Event()

    def source():
        try:
            for i in range(6):
                asked[0] += 1
                yield frames(2, seed=i)
                assert failed.wait(timeout=5)  # the first clip's encode has failed by the time the next is asked
        finally:
            closed.set()

    with pytest.raises(MediaInputError, match="refused clip 0"):
        write_mp4_clips(io.BytesIO(), source(), FPS, None, SAMPLE_RATE)
    assert asked[0] == 2  # the clip made while the first encoded; none after the error was seen
    assert closed.is_set() and not encoder_threads()


def test_the_encoders_error_is_raised_when_the_source_fails_after_it(monkeypatch):
    failed = threading.Event()
    failing_add(monkeypatch, 1, failed)

    def source():
        yield frames(2)
        yield frames(2, seed=1)
        assert failed.wait(timeout=5)
        raise RuntimeError("the VAE ran out of memory")

    with pytest.raises(MediaInputError, match="refused clip 1") as raised:
        write_mp4_clips(io.BytesIO(), source(), FPS, None, SAMPLE_RATE)
    assert isinstance(raised.value.__context__, RuntimeError)  # the later error is kept beside it


def test_a_failed_write_to_a_path_leaves_no_file(tmp_path):
    def source():
        yield frames(17)
        raise RuntimeError("the VAE ran out of memory")

    target = tmp_path / "out.mp4"
    with pytest.raises(RuntimeError):
        write_mp4_clips(target, source(), FPS, soundtrack(17), SAMPLE_RATE)
    assert not target.exists()


def test_a_bad_later_clip_is_refused_before_it_reaches_the_encoder(monkeypatch):
    handed: list[int] = []
    add = Mp4Writer.add

    def counted(self, clip):
        handed.append(len(clip))
        add(self, clip)

    monkeypatch.setattr(Mp4Writer, "add", counted)
    with pytest.raises(MediaInputError, match="one clip has one size"):
        write_mp4_clips(io.BytesIO(), [frames(3), frames(4, height=16), frames(5)], FPS, None, SAMPLE_RATE)
    assert handed in ([], [3])  # the first clip, maybe; never the bad one or any after it


def test_time_waiting_for_a_slow_encoder_is_counted_as_such_not_as_the_sources(monkeypatch):
    add = Mp4Writer.add

    def slow(self, clip):
        time.sleep(0.05)
        add(self, clip)

    monkeypatch.setattr(Mp4Writer, "add", slow)
    written = write_mp4_clips(io.BytesIO(), split(frames(6), [1] * 6), FPS, None, SAMPLE_RATE, pending=1)
    # 6 encodes of >= 50 ms behind a source that makes its clips at once: it waits for all but the last
    assert written.encode_wait_s >= 0.2 and written.source_s < written.encode_wait_s
    assert written.finish_s >= 0.05


def test_the_sources_error_is_raised_when_the_encoder_fails_after_it(monkeypatch):
    source_failed = threading.Event()

    def late_failure(self, clip):
        assert source_failed.wait(timeout=5)
        time.sleep(0.05)  # the source's error is in hand by now
        raise MediaInputError("the encoder refused the clip")

    def source():
        try:
            yield frames(2)
            raise RuntimeError("the VAE ran out of memory")
        finally:
            source_failed.set()

    monkeypatch.setattr(Mp4Writer, "add", late_failure)
    with pytest.raises(RuntimeError, match="ran out of memory"):
        write_mp4_clips(io.BytesIO(), source(), FPS, None, SAMPLE_RATE)


def test_an_interrupt_from_the_source_is_raised_as_it_is(monkeypatch):
    failed = threading.Event()
    failing_add(monkeypatch, 0, failed)

    def source():
        yield frames(2)
        assert failed.wait(timeout=5)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_mp4_clips(io.BytesIO(), source(), FPS, None, SAMPLE_RATE)


@pytest.mark.parametrize("clips,audio", [([], None), ([frames(2)], np.full((2, 100), np.nan, np.float32))],
                         ids=["no-clip", "bad-audio"])
def test_a_file_already_at_the_path_is_left_alone_when_nothing_was_written(tmp_path, clips, audio):
    target = tmp_path / "keep.mp4"
    target.write_bytes(b"an earlier clip")
    with pytest.raises(MediaInputError):
        write_mp4_clips(target, clips, FPS, audio, SAMPLE_RATE)
    assert target.read_bytes() == b"an earlier clip"
