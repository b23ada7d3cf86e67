"""bench.quality's fp8 rows: the FP8 engine's clips against the bf16 lossless ones (PSNR of frames and latents,
SSIM of frames), and the SSIM it reports. The rows run on CPU here with the float8 device checks faked away
(torchao's float8 linears compute on a CPU too: tests/test_forward_kernels.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import quality


def frames(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(3, 16, 24, 3), dtype=np.uint8)


def test_ssim_is_one_for_identical_frames_lower_for_noise_and_refuses_other_shapes():
    reference = frames(0)
    assert quality.ssim(reference, reference.copy()) == pytest.approx(1.0)
    noisy = np.clip(reference.astype(int) + np.random.default_rng(1).integers(-20, 21, reference.shape), 0, 255)
    assert 0.5 < quality.ssim(reference, noisy.astype(np.uint8)) < 1.0
    assert quality.ssim(reference, frames(2)) < 0.1  # unrelated frames
    with pytest.raises(ValueError, match="shapes differ"):
        quality.ssim(reference, reference[:2])


@pytest.mark.slow  # two engines generate every clip on CPU (about a minute)
def test_quality_quick_has_fp8_rows_beside_high_on_the_same_clips(tmp_path, monkeypatch):
    monkeypatch.setattr("engine.fp8.check_fp8_device", lambda device: None)
    monkeypatch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda granularity: None)
    assert quality.main(["--quick", "--prompts", "1", "--seeds", "5", "--steps", "6", "--fp8", "on",
                         "--checkpoint", str(tmp_path / "tiny"), "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "quality-cpu.json").read_text())
    high, high_all, fp8, fp8_all = report["rows"]
    assert [row["tier"] for row in report["rows"]] == ["high", "high", "fp8", "fp8"]
    assert (fp8["prompt"], fp8["seed"], fp8["forwards"]) == (high["prompt"], high["seed"], high["forwards"])
    for key in ("psnr_frames_db", "psnr_video_latents_db", "psnr_audio_latents_db"):
        assert fp8[key] is not None and 0 < fp8[key] < 200, key  # quantized: not identical to bf16, still close
        assert fp8_all[key] == fp8[key]  # one clip: the worst is that clip
    assert 0 < fp8["ssim_frames"] <= 1 and fp8["step_ms_fp8"] > 0 and fp8["speedup"] > 0
    assert any(note.startswith("fp8: engine.quantization fp8 (24 block linears") for note in report["notes"])


@pytest.mark.slow
def test_quality_fp8_on_where_the_device_cannot_fails_naming_the_field(tmp_path):
    with pytest.raises(Exception, match="engine.quantization: fp8 needs a CUDA GPU"):
        quality.main(["--quick", "--prompts", "1", "--seeds", "5", "--steps", "3", "--fp8", "on",
                      "--checkpoint", str(tmp_path / "tiny"), "--out", str(tmp_path)])
