"""fl2va (first keyframe, last keyframe, both) against diffusers' `MiniMaxH3ModularPipeline` with that workflow.

The oracle is diffusers' own `MiniMaxH3Blocks` over the tiny checkpoint's components, loaded by the libraries
(`from_pretrained`); ditserve's side is `model/` only: the canvas rule from the model index, the keyframes placed,
Qwen3-VL's presentation with its vision tower (`PromptEncoder(vision=True)`), the VAE encoder, the packed layout and
the loop (`model.denoise`). Same prompt, keyframes, seed and steps: the latents are equal bit for bit, and the
decoded frames and the stereo waveform (the audio VAE decode) too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.canvas import CanvasRule, resolve_canvas
from model.conditioning import Conditioning, ConditioningError, Keyframe, KeyframeAnchor
from model.layout import Partition
from model.packing import TEXT_TAG, VIDEO_TAG
from model.schedule import KEYFRAME_NOISE_AUG, H3Schedule, Task
from model.prompts import PromptEmbeddingCache
from model.text_encoder import PromptEncoder
from model.tiny import TINY_CANVAS
from tests.conditioning_support import (NUM_FRAMES, PROMPT, Ours, bits_equal,
                                        channels_to_rows, generated_once, oracle_pipeline, random_image, run_oracle)

FIRST = random_image(96, 54, seed=1)  # 16:9 -> the tiny rule's 64x32 canvas
LAST = random_image(40, 40, seed=2)  # square: cover-cropped onto the first one's canvas


@pytest.fixture(scope="module")
def oracle(two_partition_roots):
    return oracle_pipeline(two_partition_roots["diffusers"], "transformer")


@pytest.fixture(scope="module")
def ours(two_partition_roots):
    return {layout: Ours.load(two_partition_roots[layout], Partition.FL2VA) for layout in two_partition_roots}


SEED = 7


@pytest.fixture(scope="module")
def generated(ours):
    return generated_once(ours, CASES, SEED)


CASES = {
    "first": (Conditioning(keyframes=(Keyframe(FIRST, KeyframeAnchor.FIRST),)), {"image": FIRST}),
    "last": (Conditioning(keyframes=(Keyframe(LAST, KeyframeAnchor.LAST),)), {"last_image": LAST}),
    "both": (Conditioning(keyframes=(Keyframe(LAST, KeyframeAnchor.LAST), Keyframe(FIRST, KeyframeAnchor.FIRST))),
             {"image": FIRST, "last_image": LAST}),
}


#: The inner loop keeps the case with both keyframes; the single-keyframe cases run in the full suite.
INNER_LOOP_CASE = "both"


@pytest.mark.parametrize("case", [case if case == INNER_LOOP_CASE else pytest.param(case, marks=pytest.mark.slow)
                                  for case in sorted(CASES)])
def test_fl2va_latents_frames_and_waveform_equal_the_diffusers_pipeline(oracle, ours, generated, case):
    video, audio, _ = generated("diffusers", case)
    expected = run_oracle(oracle, seed=SEED, **CASES[case][1])
    assert bits_equal(video, expected.video)
    assert bits_equal(audio, expected.audio)
    frames = ours["diffusers"].video_decoder.decode(video)
    assert frames.shape == expected.frames.shape and (frames == expected.frames).all()
    waveform = ours["diffusers"].audio_decoder.decode(channels_to_rows(audio))
    assert waveform.shape == expected.waveform.shape and np.array_equal(waveform, expected.waveform)


def test_both_layouts_generate_the_same_bits(generated):
    diffusers_video, diffusers_audio, _ = generated("diffusers", "both")
    native_video, native_audio, _ = generated("native", "both")
    assert bits_equal(diffusers_video, native_video) and bits_equal(diffusers_audio, native_audio)


def test_canvas_comes_from_the_first_keyframe_and_the_model_index(ours):
    rule = CanvasRule.of(ours["diffusers"].checkpoint)
    assert (rule.short_edge, rule.max_pixels, rule.reference_image_short_edge) == tuple(TINY_CANVAS.values())
    assert CanvasRule.of(ours["native"].checkpoint) == rule
    first_only = ours["diffusers"].prepare(CASES["first"][0]).geometry
    assert (first_only.width, first_only.height) == (64, 32)
    last_only = ours["diffusers"].prepare(CASES["last"][0]).geometry  # a square keyframe: a square canvas
    assert (last_only.width, last_only.height) == (32, 32)
    portrait = Conditioning(keyframes=(Keyframe(random_image(30, 90, 3), KeyframeAnchor.FIRST),))
    assert (ours["diffusers"].prepare(portrait).geometry.height, 32) == (64, 32)  # 32x96 is over the area cap
    assert resolve_canvas(16, 9, CanvasRule()) == (768, 1344)  # the released rule


def test_presentation_tags_vision_blocks_as_video_rows(ours):
    prepared = ours["diffusers"].prepare(CASES["both"][0])
    tokenizer = ours["diffusers"].encoders.tokenizer
    ids, tags = list(prepared.presentation.token_ids), prepared.presentation.token_tags.tolist()
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    assert ids.count(start) == ids.count(end) == 2
    in_block = False
    for token, tag in zip(ids, tags):
        in_block = in_block or token == start
        assert tag == (VIDEO_TAG if in_block else TEXT_TAG)
        in_block = in_block and token != end
    label = tokenizer("<Picture 2>: ", add_special_tokens=False)["input_ids"]
    assert any(ids[i:i + len(label)] == label for i in range(len(ids)))
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert ids[-len(prompt):] == prompt


def test_keyframe_rows_are_plans_at_0999_with_the_other_rows():
    schedule = H3Schedule.build(50, task=Task.FL2VA)
    t2va = H3Schedule.build(50)
    for plan, plain in zip(schedule.steps, t2va.steps):
        video_t = float(plain.timesteps[plain.video_index])
        expected = sorted({video_t, float(plain.timesteps[plain.audio_index]),
                           float(torch.tensor(max(video_t, KEYFRAME_NOISE_AUG)))})
        assert plan.timesteps.tolist() == expected
        assert float(plan.timesteps[plan.condition_video_index]) == float(torch.tensor(max(video_t, 0.999)))
    assert {p.timesteps.numel() for p in schedule.steps} == {2, 3}
    assert schedule.key != t2va.key and "fl2va" in schedule.key


def test_frame_index_form_maps_to_anchors():
    assert KeyframeAnchor.of_frame_index(0, NUM_FRAMES) is KeyframeAnchor.FIRST
    assert KeyframeAnchor.of_frame_index(-1, NUM_FRAMES) is KeyframeAnchor.LAST
    assert KeyframeAnchor.of_frame_index(NUM_FRAMES - 1, NUM_FRAMES) is KeyframeAnchor.LAST
    with pytest.raises(ConditioningError) as error:
        KeyframeAnchor.of_frame_index(40, NUM_FRAMES, field="frame_indices[1]")
    assert error.value.field == "frame_indices[1]"
    with pytest.raises(ConditioningError, match="one keyframe per anchor"):
        Conditioning(keyframes=(Keyframe(FIRST, KeyframeAnchor.FIRST), Keyframe(LAST, KeyframeAnchor.FIRST)))


def test_prompt_cache_key_holds_the_images_content_hash(ours):
    encoder = ours["diffusers"].prompt_encoder
    cache = PromptEmbeddingCache(capacity_bytes=2**20)
    one = ours["diffusers"].prepare(CASES["first"][0]).presentation
    other = ours["diffusers"].prepare(
        Conditioning(keyframes=(Keyframe(random_image(96, 54, seed=9), KeyframeAnchor.FIRST),))).presentation
    assert one.token_ids == other.token_ids and one.media_hash != other.media_hash
    first = cache.get_or_encode_presentation(encoder, one)
    second = cache.get_or_encode_presentation(encoder, other)
    again = cache.get_or_encode_presentation(encoder, one)
    assert (cache.stats().misses, cache.stats().hits) == (2, 1)
    assert again is first and not torch.equal(first, second)


def test_a_text_only_encoder_loads_no_vision_tower(ours):
    checkpoint = ours["diffusers"].checkpoint
    text_only = PromptEncoder(checkpoint.text_encoder_dir, checkpoint.tokenizer_dir, "cpu")
    assert not text_only.has_vision and ours["diffusers"].prompt_encoder.has_vision
    with_vision = sum(p.numel() for p in ours["diffusers"].prompt_encoder._multimodal.parameters())
    assert sum(p.numel() for p in text_only._model.parameters()) < with_vision
    assert torch.equal(text_only.encode(PROMPT), ours["diffusers"].prompt_encoder.encode(PROMPT))
