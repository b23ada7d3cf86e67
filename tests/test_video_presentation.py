"""ref2va video references reach Qwen3-VL as diffusers presents them: `model.presentation.reference_presentation`
and `PromptEncoder.encode_presentation` against diffusers' `MiniMaxH3Ref2VATextEncoderStep`, on the same normalized
references (ours, handed to diffusers as its reference objects) and our video processor in the stand-in processor.

Equal: the token ids, their row tags (`<Video k>: `, one `<t seconds>` label and `<|video_pad|>` block per merged
frame pair, a video's soundtrack labelled before it) and the embedding, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VATextEncoderStep
from diffusers.modular_pipelines.minimax_h3.references import (MiniMaxH3AudioReference, MiniMaxH3ImageReference,
                                                               MiniMaxH3VideoReference)
from transformers import Qwen2TokenizerFast, Qwen2VLImageProcessorPil, Qwen3VLForConditionalGeneration

from model.canvas import CanvasRule
from model.conditioning import (FPS, AudioReference, ConditioningError, ImageReference, VideoReference,
                                normalize_references)
from model.layout import H3Checkpoint, Partition
from model.packing import TEXT_TAG, VIDEO_TAG
from model.presentation import VIDEO_SAMPLE_FPS, reference_presentation, sample_video_frames
from model.qwen_video import QwenVideoProcessor
from model.text_encoder import PromptEncoder
from tests.conditioning_support import NUM_FRAMES, PROMPT, StandInProcessor, random_image, random_video

SAMPLE_RATE = 32000


def stereo(seconds: float) -> np.ndarray:
    t = np.linspace(0, seconds, int(seconds * SAMPLE_RATE), endpoint=False)
    return (0.3 * np.sin(2 * np.pi * 220 * t) * np.array([[1.0], [0.5]])).astype(np.float32)


CASES = {
    # 30 frames at 24 fps: frames 0, 12, 24 sampled, the last repeated -> 2 blocks at 0.2 s and 1.0 s.
    "video": (VideoReference(random_video(30, 64, 32, seed=1), 24.0),),
    "image+video": (ImageReference(random_image(48, 64, seed=2)),
                    VideoReference(random_video(50, 40, 56, seed=3), 12.0)),
    "images+video with sound+audio": (
        ImageReference(random_image(90, 40, seed=4)),
        VideoReference(random_video(80, 64, 48, seed=5), 30.0, stereo(2.0), SAMPLE_RATE),
        AudioReference(stereo(1.5), SAMPLE_RATE),
        ImageReference(random_image(40, 40, seed=6)),
    ),
    "two videos": (VideoReference(random_video(124, 48, 80, seed=7), 24.0),
                   VideoReference(random_video(37, 80, 32, seed=8), 24.0)),
}


@pytest.fixture(scope="module")
def checkpoint(two_partition_roots) -> H3Checkpoint:
    return H3Checkpoint.open(two_partition_roots["diffusers"], Partition.REF2VA, require_components=True)


@pytest.fixture(scope="module")
def encoder(checkpoint) -> PromptEncoder:
    return PromptEncoder(checkpoint.text_encoder_dir, checkpoint.tokenizer_dir, "cpu", vision=True,
                         processor_dir=checkpoint.processor_dir)


@pytest.fixture(scope="module")
def diffusers_step(two_partition_roots):
    root = two_partition_roots["diffusers"]
    tokenizer = Qwen2TokenizerFast.from_pretrained(root / "tokenizer")
    pipeline = MiniMaxH3Ref2VATextEncoderStep().init_pipeline()
    pipeline.update_components(
        text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(root / "text_encoder", dtype=torch.bfloat16),
        tokenizer=tokenizer,
        processor=StandInProcessor(Qwen2VLImageProcessorPil.from_pretrained(root / "processor"),
                                   QwenVideoProcessor.from_pretrained(root / "processor"), tokenizer))
    return pipeline


def normalized(checkpoint, references):
    return normalize_references(references, NUM_FRAMES, CanvasRule.of(checkpoint), SAMPLE_RATE)


def as_diffusers(reference):
    if isinstance(reference, ImageReference):
        return MiniMaxH3ImageReference(image=reference.image)
    audio = None if reference.audio is None else torch.from_numpy(reference.audio)
    if isinstance(reference, VideoReference):
        return MiniMaxH3VideoReference(frames=reference.frames, fps=reference.fps, audio=audio,
                                       sample_rate=reference.sample_rate)
    return MiniMaxH3AudioReference(audio=audio, sample_rate=reference.sample_rate)


@pytest.mark.parametrize("case", sorted(CASES))
def test_video_presentation_and_embedding_equal_the_diffusers_text_encoder_step(checkpoint, encoder,
                                                                                 diffusers_step, case):
    references = normalized(checkpoint, CASES[case])
    presentation = reference_presentation(encoder.tokenizer, encoder.image_processor, encoder.video_processor,
                                          PROMPT, references)
    theirs = [as_diffusers(r) for r in references]
    out = diffusers_step(prompt=PROMPT, normalized_references=theirs, output=["prompt_embeds", "text_token_tags"])
    expected_embeds = out["prompt_embeds"]
    assert torch.equal(presentation.token_tags, out["text_token_tags"])
    # The token ids are the step's own, built by its presentation method over its vision features.
    step = MiniMaxH3Ref2VATextEncoderStep()
    vision, image_counts, video_counts, timestamps = step._gather_vision_features(
        diffusers_step.processor, theirs, float(FPS))
    expected_ids, _ = step._build_presentation(diffusers_step.tokenizer, PROMPT, theirs, image_counts, video_counts,
                                               timestamps, text_tag=TEXT_TAG, video_tag=VIDEO_TAG)
    assert list(presentation.token_ids) == expected_ids
    assert torch.equal(presentation.pixel_values_videos, vision["pixel_values_videos"])
    assert torch.equal(presentation.video_grid_thw, vision["video_grid_thw"])
    embedding = encoder.encode_presentation(presentation)
    assert embedding.shape == expected_embeds.shape[1:] == (presentation.num_tokens, encoder.text_dim)
    assert torch.equal(embedding, expected_embeds[0])


def test_a_video_is_labelled_with_timestamped_video_pad_blocks(checkpoint, encoder):
    references = normalized(checkpoint, CASES["images+video with sound+audio"])
    presentation = reference_presentation(encoder.tokenizer, encoder.image_processor, encoder.video_processor,
                                          PROMPT, references)
    tokenizer = encoder.tokenizer
    text = tokenizer.decode(list(presentation.token_ids))
    pad = "<|video_pad|>"
    # 80 frames at 30 fps -> 64 at 24 fps: frames 0, 12, ..., 60 sampled (6) -> 3 blocks at 0.2, 1.2, 2.2 s.
    labels = ["<Picture 1>: ", "<Audio 1>: ", "<Video 1>: ", "<0.2 seconds>", "<1.2 seconds>", "<2.2 seconds>",
              "<Audio 2>: ", "<Picture 2>: ", PROMPT]
    positions = [text.index(label) for label in labels]
    assert positions == sorted(positions)
    grid = presentation.video_grid_thw
    assert grid.shape == (1, 3) and int(grid[0, 0]) == 3
    per_block = int(grid[0, 1] * grid[0, 2]) // encoder.video_processor.merge_size ** 2
    assert text.count(pad) == 3 * per_block
    ids = torch.tensor(presentation.token_ids)
    video_pad = tokenizer.convert_tokens_to_ids(pad)
    assert (presentation.token_tags[ids == video_pad] == VIDEO_TAG).all()
    assert set(presentation.token_tags.tolist()) == {TEXT_TAG, VIDEO_TAG}
    assert presentation.pixel_values_videos.shape[0] == int(grid.prod())


@pytest.mark.parametrize("num_frames, indices, blocks", [
    (13, [0, 12], [0.25]),                    # the shortest a video may be
    (25, [0, 12, 24], [0.25, 1.0]),           # odd count: the last sampled frame repeats
    (48, [0, 12, 24, 36], [0.25, 1.25]),
])
def test_frames_are_sampled_at_2_fps_and_blocks_timestamped_by_their_mean(num_frames, indices, blocks):
    assert VIDEO_SAMPLE_FPS == 2.0 and FPS == 24
    assert sample_video_frames(num_frames, 2, "references[0]") == (indices, blocks)
    expected = MiniMaxH3Ref2VATextEncoderStep._sample_video_condition_frames(
        np.arange(num_frames)[:, None, None, None], float(FPS), VIDEO_SAMPLE_FPS, 2)
    assert [int(frame[0, 0, 0]) for frame in expected[0]] == indices and expected[1] == blocks


def test_a_video_too_short_to_sample_names_the_reference(checkpoint, encoder):
    references = normalized(checkpoint, (ImageReference(random_image(40, 40, seed=9)),
                                         VideoReference(random_video(12, 32, 32, seed=9), 24.0)))
    with pytest.raises(ConditioningError) as error:
        reference_presentation(encoder.tokenizer, encoder.image_processor, encoder.video_processor, PROMPT,
                               references)
    assert error.value.field == "references[1]" and error.value.index == 1


def test_the_media_hash_covers_the_video_pixels(checkpoint, encoder):
    video = random_video(30, 64, 32, seed=1)
    touched = video.copy()
    touched[12, :8, :8] ^= 64  # in a sampled frame (12 at 24 fps)

    def media_hash(frames):
        references = normalized(checkpoint, (VideoReference(frames, 24.0),))
        return reference_presentation(encoder.tokenizer, encoder.image_processor, encoder.video_processor, PROMPT,
                                      references).media_hash
    assert media_hash(video) == media_hash(video.copy())
    assert media_hash(video) != media_hash(touched)


def test_a_processor_without_a_video_config_refuses_video_references(checkpoint, encoder):
    references = normalized(checkpoint, CASES["video"])
    with pytest.raises(ConditioningError) as error:
        reference_presentation(encoder.tokenizer, encoder.image_processor, None, PROMPT, references)
    assert error.value.field == "references[0]" and error.value.index == 0


@pytest.mark.parametrize("references, field, index", [
    ((ImageReference(random_image(40, 40, seed=1)), ImageReference(random_image(200, 40, seed=2))),
     "references[1]", 1),  # 5:1
    ((ImageReference(random_image(40, 40, seed=1)), AudioReference(stereo(1.0)[0], SAMPLE_RATE)),
     "references[1].audio", 1),  # [samples], not [channels, samples]
])
def test_a_reference_normalization_refuses_names_its_place_as_data(checkpoint, references, field, index):
    with pytest.raises(ConditioningError) as error:
        normalized(checkpoint, references)
    assert error.value.field == field and error.value.index == index
