"""The output store: put / ranged read / delete under a directory, a file:// URL and memory://."""

from __future__ import annotations

import secrets

import pytest

from jobs.outputs import OutputMissing, OutputStore, VideoVariant

DATA = bytes(range(256)) * 40  # 10240 bytes, byte i == i % 256


@pytest.fixture(params=["path", "file-url", "memory"])
def outputs(request, tmp_path) -> OutputStore:
    if request.param == "path":
        return OutputStore(str(tmp_path / "outputs"))
    if request.param == "file-url":
        return OutputStore(f"file://{tmp_path}/outputs")
    return OutputStore(f"memory://test-outputs-{secrets.token_hex(4)}")


def test_put_then_ranged_reads(outputs):
    outputs.put("video_a", VideoVariant.VIDEO, DATA)
    blob = outputs.open("video_a", VideoVariant.VIDEO)
    assert blob.size == 10240
    assert blob.read(0, 4) == b"\x00\x01\x02\x03"
    assert blob.read(300, 3) == bytes([44, 45, 46])  # 300 % 256 == 44
    assert blob.read(10238, 100) == bytes([254, 255])  # clipped at the end
    assert blob.read(10240, 10) == b""


def test_variants_are_separate_files(outputs):
    outputs.put("video_a", VideoVariant.VIDEO, b"mp4")
    outputs.put("video_a", VideoVariant.THUMBNAIL, b"png")
    assert outputs.open("video_a", VideoVariant.THUMBNAIL).read(0, 10) == b"png"
    assert outputs.open("video_a", VideoVariant.VIDEO).read(0, 10) == b"mp4"


def test_put_replaces_and_leaves_no_partial_files(outputs, tmp_path):
    outputs.put("video_a", VideoVariant.VIDEO, b"first")
    outputs.put("video_a", VideoVariant.VIDEO, b"second")
    assert outputs.open("video_a", VideoVariant.VIDEO).read(0, 100) == b"second"
    names = outputs._fs.ls(outputs._root, detail=False)
    assert sorted(n.rsplit("/", 1)[-1] for n in names) == ["video_a.mp4"]


def test_delete_removes_every_variant_and_is_idempotent(outputs):
    outputs.put("video_a", VideoVariant.VIDEO, b"mp4")
    outputs.put("video_a", VideoVariant.THUMBNAIL, b"png")
    outputs.delete("video_a")
    outputs.delete("video_a")
    for variant in VideoVariant:
        with pytest.raises(OutputMissing):
            outputs.open("video_a", variant)


def test_a_read_after_deletion_is_output_missing(outputs):
    outputs.put("video_a", VideoVariant.VIDEO, DATA)
    blob = outputs.open("video_a", VideoVariant.VIDEO)
    outputs.delete("video_a")
    with pytest.raises(OutputMissing):
        blob.read(0, 10)


@pytest.mark.parametrize("key", ["../etc/passwd", "a/b", "", "video a", "x" * 129])
def test_keys_never_become_paths_outside_the_store(outputs, key):
    with pytest.raises(ValueError, match="output key"):
        outputs.put(key, VideoVariant.VIDEO, b"x")


def test_outputs_survive_a_new_store_on_the_same_directory(tmp_path):
    OutputStore(str(tmp_path / "out")).put("video_a", VideoVariant.VIDEO, DATA)
    assert OutputStore(str(tmp_path / "out")).open("video_a", VideoVariant.VIDEO).read(0, 10240) == DATA
