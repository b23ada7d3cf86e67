"""Our Qwen3-VL video processing (model/qwen_video.py) == transformers' Qwen3VLVideoProcessor, bit for bit.

The oracle is tests/data/qwen3vl_video/fixture.safetensors, written by make_fixture.py beside it on a machine where
torchvision installs. Without the fixture these tests fail (they never skip): the claim is unchecked until it is there.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from model.qwen_video import VideoProcessingError, VideoProcessorConfig, process_videos, resize_bicubic, smart_resize

FIXTURE = Path(__file__).parent / "data" / "qwen3vl_video" / "fixture.safetensors"
CASE_NAMES = ["tiny_exact", "tiny_odd", "tiny_downscale", "tiny_small_frames", "tiny_batch", "defaults_small",
              "defaults_odd"]


def _fixture() -> tuple[dict, dict[str, torch.Tensor]]:
    assert FIXTURE.exists(), f"{FIXTURE} is missing: run make_fixture.py where torchvision installs"
    with safe_open(str(FIXTURE), framework="pt") as handle:
        meta = json.loads(handle.metadata()["fixture"])
        return meta, {key: handle.get_tensor(key) for key in handle.keys()}


@pytest.mark.parametrize("name", CASE_NAMES)
def test_ours_equals_transformers(name: str) -> None:
    meta, tensors = _fixture()
    case = meta["cases"][name]
    config = VideoProcessorConfig.from_dict(case["config"])
    videos = [tensors[f"{name}.input.{k}"].numpy() for k in range(case["num_videos"])]
    ours = process_videos(videos, config)
    assert torch.equal(ours.video_grid_thw, tensors[f"{name}.video_grid_thw"])
    for k, video in enumerate(videos):  # the resize alone first, so a mismatch names its op
        expected = tensors[f"{name}.resized.{k}"]
        frames = torch.from_numpy(video).permute(0, 3, 1, 2).contiguous()
        assert torch.equal(resize_bicubic(frames, *expected.shape[-2:]), expected), f"resize of video {k}"
    assert list(ours.pixel_values_videos.shape) == case["pixel_values_shape"]
    assert ours.pixel_values_videos.dtype == torch.float32
    if f"{name}.pixel_values_videos" in tensors:
        assert torch.equal(ours.pixel_values_videos, tensors[f"{name}.pixel_values_videos"])
    digest = hashlib.sha256(ours.pixel_values_videos.contiguous().numpy().tobytes()).hexdigest()
    assert digest == case["pixel_values_sha256"]


def test_fixture_covers_every_case() -> None:
    meta, _ = _fixture()
    assert sorted(meta["cases"]) == sorted(CASE_NAMES)


@pytest.mark.parametrize(("frames", "height", "width", "expected"), [
    (4, 32, 48, (32, 48)),      # on the grid
    (5, 37, 53, (40, 56)),      # rounded to the factor 8
    (3, 90, 130, (56, 88)),     # over 16384 pixels: scaled down, floored
    (2, 6, 10, (8, 16)),        # under the factor: scaled up first
])
def test_smart_resize_tiny(frames: int, height: int, width: int, expected: tuple[int, int]) -> None:
    config = VideoProcessorConfig(patch_size=4, merge_size=2, min_pixels=256, max_pixels=16384)
    assert smart_resize(frames, height, width, config) == expected


def test_too_few_frames_is_a_typed_error() -> None:
    with pytest.raises(VideoProcessingError, match="at least 2 frames"):
        process_videos([np.zeros((1, 32, 32, 3), np.uint8)], VideoProcessorConfig(patch_size=4))


def test_grid_and_patch_count_agree() -> None:
    config = VideoProcessorConfig(patch_size=4, merge_size=2, min_pixels=256, max_pixels=16384)
    video = np.random.default_rng(0).integers(0, 256, size=(5, 37, 53, 3), dtype=np.uint8)
    features = process_videos([video, video[:4]], config)
    assert features.video_grid_thw.tolist() == [[3, 10, 14], [2, 10, 14]]
    assert features.pixel_values_videos.shape == (5 * 140, 3 * 2 * 4 * 4)
