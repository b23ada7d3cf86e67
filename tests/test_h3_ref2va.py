"""ref2va on the Ref2VA partition against diffusers' `MiniMaxH3ModularPipeline` with `workflow="ref2va"`.

The oracle is diffusers' own `MiniMaxH3Blocks` running `transformer_ref` over the tiny checkpoint's components;
ditserve's side is `model/` only (references normalized, Qwen3-VL's presentation, VAE and audio-VAE encoders, the
ref2va packed layout, the loop). Image references alone, with a soundtrack, with a video, and with a video that
carries its own soundtrack beside an audio reference: the latents, decoded frames and waveform are equal bit for bit. The
video references' presentation and embedding alone are checked in tests/test_video_presentation.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.references import (MiniMaxH3AudioReference, MiniMaxH3ImageReference,
                                                               MiniMaxH3VideoReference)

from model.conditioning import AudioReference, Conditioning, ConditioningError, ImageReference, VideoReference
from model.layout import Partition
from model.packing import AUDIO_TAG, VIDEO_TAG
from model.schedule import H3Schedule, Task
from tests.conditioning_support import (Ours, bits_equal, channels_to_rows, generated_once, oracle_pipeline,
                                      random_image, random_video, run_oracle)

SAMPLE_RATE = 32000
IMAGES = (random_image(48, 64, seed=11), random_image(90, 40, seed=12))  # portrait, landscape
WAVEFORM = (0.3 * np.sin(np.linspace(0, 400 * np.pi, 2 * SAMPLE_RATE)) *
            np.array([[1.0], [0.5]])).astype(np.float32)  # 2 s stereo at the VAE's rate
VIDEO = random_video(40, 64, 48, seed=13)  # at 30 fps: 32 frames at 24 fps, 3 sampled -> 2 vision blocks


@pytest.fixture(scope="module")
def oracle(two_partition_roots):
    return oracle_pipeline(two_partition_roots["diffusers"], "transformer_ref")


@pytest.fixture(scope="module")
def ours(two_partition_roots):
    return {layout: Ours.load(two_partition_roots[layout], Partition.REF2VA) for layout in two_partition_roots}


SEED = 5


@pytest.fixture(scope="module")
def generated(ours):
    return generated_once(ours, CASES, SEED)


CASES = {
    "images": (
        Conditioning(references=tuple(ImageReference(image) for image in IMAGES)),
        [MiniMaxH3ImageReference(image=image) for image in IMAGES],
    ),
    "images+audio": (
        Conditioning(references=(ImageReference(IMAGES[0]), AudioReference(WAVEFORM, SAMPLE_RATE),
                                 ImageReference(IMAGES[1]))),
        [MiniMaxH3ImageReference(image=IMAGES[0]),
         MiniMaxH3AudioReference(audio=torch.from_numpy(WAVEFORM), sample_rate=SAMPLE_RATE),
         MiniMaxH3ImageReference(image=IMAGES[1])],
    ),
    "images+video": (
        Conditioning(references=(ImageReference(IMAGES[0]), VideoReference(VIDEO, 30.0), ImageReference(IMAGES[1]))),
        [MiniMaxH3ImageReference(image=IMAGES[0]), MiniMaxH3VideoReference(frames=VIDEO, fps=30.0),
         MiniMaxH3ImageReference(image=IMAGES[1])],
    ),
    "image+video with sound+audio": (
        Conditioning(references=(ImageReference(IMAGES[1]), VideoReference(VIDEO, 30.0, WAVEFORM[:, :SAMPLE_RATE],
                                                                           SAMPLE_RATE),
                                 AudioReference(WAVEFORM, SAMPLE_RATE))),
        [MiniMaxH3ImageReference(image=IMAGES[1]),
         MiniMaxH3VideoReference(frames=VIDEO, fps=30.0, audio=torch.from_numpy(WAVEFORM[:, :SAMPLE_RATE].copy()),
                                 sample_rate=SAMPLE_RATE),
         MiniMaxH3AudioReference(audio=torch.from_numpy(WAVEFORM), sample_rate=SAMPLE_RATE)],
    ),
}


#: The inner loop keeps the case with every kind of reference; the others run in the full suite.
INNER_LOOP_CASE = "image+video with sound+audio"


@pytest.mark.parametrize("case", [case if case == INNER_LOOP_CASE else pytest.param(case, marks=pytest.mark.slow)
                                  for case in sorted(CASES)])
def test_ref2va_latents_frames_and_waveform_equal_the_diffusers_pipeline(oracle, ours, generated, case):
    video, audio, _ = generated("diffusers", case)
    expected = run_oracle(oracle, seed=SEED, references=CASES[case][1])
    assert bits_equal(video, expected.video)
    assert bits_equal(audio, expected.audio)
    frames = ours["diffusers"].video_decoder.decode(video)
    assert frames.shape == expected.frames.shape and (frames == expected.frames).all()
    waveform = ours["diffusers"].audio_decoder.decode(channels_to_rows(audio))
    assert waveform.shape == expected.waveform.shape and np.array_equal(waveform, expected.waveform)


def test_ref2va_runs_the_ref2va_partition_and_both_layouts_agree(ours, generated):
    assert ours["diffusers"].checkpoint.transformer_dir.name == "transformer_ref"
    assert ours["native"].checkpoint.transformer_dir.parent.name == "Ref2VA"
    diffusers_video, diffusers_audio, _ = generated("diffusers", "images+audio")
    native_video, native_audio, _ = generated("native", "images+audio")
    assert bits_equal(diffusers_video, native_video) and bits_equal(diffusers_audio, native_audio)


def test_one_block_per_reference_in_packed_order(ours):
    prepared = ours["diffusers"].prepare(CASES["images+audio"][0])
    kinds = [type(block).__name__ for block in prepared.conditions.blocks]
    assert kinds == ["ImageBlock", "AudioBlock", "ImageBlock"]
    # Image references at their own 32-px short edge: 48x64 -> 32x43 -> 32x32 (rounded), 90x40 -> 64x32 (72 -> 64).
    assert [tuple(latents.shape[2:]) for latents in prepared.conditions.visual] == [(2, 2), (2, 4)]
    assert prepared.conditions.audio[0].shape == (2 * 80, 32)  # 2 s at 40 latents/s, stereo channel-major
    tokenizer = ours["diffusers"].encoders.tokenizer
    ids = list(prepared.presentation.token_ids)
    labels = [tokenizer(label, add_special_tokens=False)["input_ids"]
              for label in ("<Picture 1>: ", "<Audio 1>: ", "<Picture 2>: ")]
    starts = [next(i for i in range(len(ids)) if ids[i:i + len(label)] == label) for label in labels]
    assert starts == sorted(starts)
    tags = prepared.presentation.token_tags
    assert (tags == VIDEO_TAG).any() and not (tags == AUDIO_TAG).any()  # a waveform never reaches Qwen3-VL


def test_reference_soundtrack_rows_join_the_plans_at_1():
    with_audio = H3Schedule.build(10, task=Task.REF2VA, reference_audio=True)
    images_only = H3Schedule.build(10, task=Task.REF2VA)
    for plan, plain in zip(with_audio.steps, images_only.steps):
        assert float(plan.timesteps[plan.condition_audio_index]) == 1.0
        assert set(plain.timesteps.tolist()) | {1.0} == set(plan.timesteps.tolist())
    assert max(p.timesteps.numel() for p in with_audio.steps) == 4
    assert with_audio.key != images_only.key


def test_reference_limits_name_the_field():
    with pytest.raises(ConditioningError) as error:
        Conditioning(references=(AudioReference(WAVEFORM, SAMPLE_RATE),))
    assert error.value.field == "audio_reference"
    with pytest.raises(ConditioningError) as error:
        Conditioning(references=tuple(ImageReference(IMAGES[0]) for _ in range(10)))
    assert error.value.field == "image_references"
