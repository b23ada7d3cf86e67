"""MiniMax-H3 t2va denoising side: geometry, schedule, packed layout, and the loop against diffusers' own pipeline.

The oracle is diffusers' `MiniMaxH3CoreDenoiseStep` (the t2va denoise-side blocks of the modular pipeline: layout,
noise, timesteps, loop, unpack) fed `prompt_embeds` directly, run on the tiny random `MiniMaxH3Transformer3DModel` of
`model.tiny.tiny_transformer` (the published checkpoint's dtypes: bf16 blocks, 12 fp32 tensors). Our loop must
match it bit for bit: nothing in between is allowed to round differently, so every comparison is `torch.equal`.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    align_num_frames,
    audio_latent_num_frames,
    video_latent_num_frames,
)

from model.denoise import Denoiser, PackedLatents, denoise
from model.geometry import GeometryError, GeometryLimits, VideoGeometry, snap_num_frames
from model.packing import (
    AUDIO_TAG,
    TEXT_TAG,
    VIDEO_TAG,
    PackedLayout,
    PackingError,
    audio_rows_to_channels,
    patchify_video,
    unpatchify_video,
)
from model.schedule import H3Schedule, ScheduleError, StepPlan, euler_update, schedule_key
from model.tiny import tiny_transformer

# Tiny canvases: any short edge, small areas, the pipeline's 5-15 s.
TINY_LIMITS = GeometryLimits(short_edge=None, max_pixels=128 * 128)
ANY_CANVAS = GeometryLimits(short_edge=None)


def bits(tensor: torch.Tensor) -> list[int]:
    return tensor.to(torch.float32).contiguous().view(torch.int32).tolist()


# --------------------------------------------------------------------------------------------------- geometry


@pytest.mark.parametrize(
    "width, height, num_frames, limits, snapped, latent_frames, video_tokens, audio_rows",
    [
        # h3.md's table (section 4); 672x384 is off the released 768 short edge, so any-canvas limits.
        (1344, 768, 121, GeometryLimits(), 124, 37, 37_296, 414),
        (1344, 768, 209, GeometryLimits(), 209, 62, 62_496, 696),
        (1344, 768, 243, GeometryLimits(), 243, 72, 72_576, 810),
        (672, 384, 209, ANY_CANVAS, 209, 62, 15_624, 696),
        (768, 1344, 124, GeometryLimits(), 124, 37, 37_296, 414),  # portrait: same counts
        (64, 32, 121, TINY_LIMITS, 124, 37, 74, 414),  # the oracle's tiny canvas: 2 patches per latent frame
    ],
)
def test_geometry_table(width, height, num_frames, limits, snapped, latent_frames, video_tokens, audio_rows):
    geometry = VideoGeometry.from_frames(width, height, num_frames, limits)
    assert geometry.num_frames == snapped
    assert geometry.num_latent_frames == latent_frames
    assert (geometry.latent_height, geometry.latent_width) == (height // 16, width // 16)
    assert geometry.num_video_tokens == video_tokens
    assert geometry.num_audio_rows == audio_rows
    assert geometry.num_tokens(num_text_tokens=100) == 100 + video_tokens + audio_rows
    assert geometry.video_latent_shape == (24, latent_frames, height // 16, width // 16)


def test_five_seconds_is_121_frames_snapped_to_124():
    geometry = VideoGeometry.from_seconds(1344, 768, 5)
    assert (geometry.num_frames, geometry.num_latent_frames, geometry.num_audio_latents) == (124, 37, 207)
    assert geometry.num_tokens(0) == 37_710  # h3.md: 37,710 + L
    assert geometry.seconds == 124 / 24


def test_geometry_arithmetic_matches_the_pipeline_helpers_for_every_frame_count():
    accepted = []
    for num_frames in range(1, 400):
        snapped = snap_num_frames(num_frames)
        assert snapped == align_num_frames(num_frames, 17, 5)
        if 5 <= snapped / 24 <= 15:  # the pipeline's check, on the snapped count
            geometry = VideoGeometry.from_frames(64, 32, num_frames, TINY_LIMITS)
            assert geometry.num_frames == snapped
            assert geometry.num_latent_frames == video_latent_num_frames(snapped, 17, 5)
            assert geometry.num_audio_latents == audio_latent_num_frames(snapped)
            accepted.append(num_frames)
        else:
            with pytest.raises(GeometryError) as error:
                VideoGeometry.from_frames(64, 32, num_frames, TINY_LIMITS)
            assert error.value.field == "num_frames"
    assert (accepted[0], accepted[-1]) == (108, 345)  # 108..124 -> 124 (5.17 s); 345 = 14.375 s


@pytest.mark.parametrize(
    "width, height, seconds, limits, field, limit_text",
    [
        (1344, 760, 5, GeometryLimits(), "height", "multiple of 32"),
        (1344, 704, 5, GeometryLimits(), "height", "short edge must be 768"),
        (1376, 768, 5, GeometryLimits(), "width*height", "<= 1032192"),
        (1344, 768, 4, GeometryLimits(), "seconds", "between 5 and 15 s"),  # 97 -> 107 frames = 4.46 s
        (1344, 768, 15, GeometryLimits(), "seconds", "between 5 and 15 s"),  # 361 -> 362 frames = 15.08 s
        (1344, 768, 0, GeometryLimits(), "seconds", "> 0"),
        (0, 768, 5, GeometryLimits(), "width", ">= 32"),
    ],
)
def test_geometry_errors_name_the_field_and_the_limit(width, height, seconds, limits, field, limit_text):
    with pytest.raises(GeometryError) as error:
        VideoGeometry.from_seconds(width, height, seconds, limits)
    assert isinstance(error.value, ValueError)
    assert error.value.field == field
    assert limit_text in str(error.value)


def test_duration_limits_are_parameters():
    """4 s (vllm-omni's floor) passes once min_seconds is lowered; 14.33 s is the longest the defaults accept."""
    assert VideoGeometry.from_seconds(1344, 768, 4, GeometryLimits(min_seconds=4)).num_frames == 107
    assert VideoGeometry.from_seconds(1344, 768, 344 / 24).num_frames == 345


# --------------------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("num_steps", [2, 4, 9, 50])
def test_schedule_grid_has_n_points_and_n_minus_one_forwards(num_steps):
    schedule = H3Schedule.build(num_steps)
    for sigmas, shift in ((schedule.video_sigmas, 12.0), (schedule.audio_sigmas, 3.0)):
        assert sigmas.dtype == torch.float32 and sigmas.shape == (num_steps,)
        assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
        assert bool((sigmas[1:] < sigmas[:-1]).all())
        reference = MiniMaxH3Scheduler(shift=shift)
        reference.set_timesteps(num_steps)
        assert torch.equal(sigmas, reference.sigmas)
    reference = MiniMaxH3Scheduler(shift=12.0)
    reference.set_timesteps(num_steps)
    assert torch.equal(schedule.video_timesteps, reference.timesteps)
    assert schedule.num_forwards == num_steps - 1 == len(schedule.plans)


def test_plans_are_distinct_ascending_timesteps_and_distinct_per_forward():
    schedule = H3Schedule.build(50)
    assert bits(schedule.plans[0]) == bits(torch.tensor([0.0]))  # sigma 1 on both grids: one plan row
    assert [step.video_index for step in schedule.steps] == [0] * 49
    assert [step.audio_index for step in schedule.steps] == [0] + [1] * 48  # video t < audio t after forward 0
    for i, (plan, step) in enumerate(zip(schedule.plans, schedule.steps)):
        assert plan.dtype == torch.float32
        assert bool((plan[1:] > plan[:-1]).all())
        assert bits(plan[step.video_index]) == bits(schedule.video_timesteps[i])
        assert bits(plan[step.audio_index]) == bits(schedule.audio_timesteps[i])
    keys = {tuple(bits(plan)) for plan in schedule.plans}
    assert len(keys) == schedule.num_forwards


def test_plan_order_is_sorted_not_video_first():
    """With audio shifted harder than video, audio rows carry the smaller t and come first in the plan."""
    step = H3Schedule.build(4, video_shift=3.0, audio_shift=12.0).steps[1]
    assert (step.video_index, step.audio_index) == (1, 0)


@pytest.mark.parametrize("video_shift, audio_shift", [(12.0, 3.0), (3.0, 12.0), (5.0, 5.0)])
def test_plans_equal_the_pipelines_row_timestep_plan(video_shift, audio_shift):
    geometry = VideoGeometry.from_frames(64, 32, 124, TINY_LIMITS)
    layout = PackedLayout.build(geometry, num_text_tokens=5)
    schedule = H3Schedule.build(6, video_shift, audio_shift)
    for i, step in enumerate(schedule.steps):
        timesteps, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            layout.video_indices, layout.audio_indices, 0, 0, 5,
            float(schedule.video_timesteps[i]), float(schedule.audio_timesteps[i]), 0.999, 1.0,
        )
        assert bits(step.timesteps) == bits(timesteps)
        assert torch.equal(layout.timestep_indices(step.video_index, step.audio_index), indices)


def test_schedule_key_is_cheap_stable_and_bit_sensitive():
    assert schedule_key(50) == H3Schedule.build(50).key == schedule_key(50, 12, 3, "t2va")
    assert schedule_key(50) != schedule_key(49)
    assert schedule_key(50, 12.0) != schedule_key(50, math.nextafter(12.0, 13.0))
    assert schedule_key(50, 12.0, 3.0) != schedule_key(50, 3.0, 12.0)


@pytest.mark.parametrize(
    "args, field",
    [((1,), "num_steps"), ((True,), "num_steps"), ((50, 0.0), "video_shift"), ((50, 12.0, -3.0), "audio_shift"),
     ((50, 12.0, 3.0, "i2v"), "task"), ((50, float("nan")), "video_shift")],
)
def test_schedule_errors_name_the_field(args, field):
    with pytest.raises(ScheduleError) as error:
        schedule_key(*args)
    assert error.value.field == field
    with pytest.raises(ScheduleError):
        H3Schedule.build(*args)


@pytest.mark.parametrize("shift", [12.0, 3.0])
def test_euler_update_is_the_schedulers_step_bit_for_bit(shift):
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(37, 96, generator=generator)
    scheduler = MiniMaxH3Scheduler(shift=shift)
    scheduler.set_timesteps(50)  # reaches sigma < 0.5, where 1 - (1 - sigma) != sigma in fp32
    ours = sample.clone()
    for i, t in enumerate(scheduler.timesteps):
        velocity = torch.randn(37, 96, generator=generator)
        sample = scheduler.step(velocity, t, sample, return_dict=False)[0]
        ours = euler_update(ours, velocity, t, scheduler.sigmas[i], scheduler.sigmas[i + 1])
        assert torch.equal(ours, sample)


def test_step_plan_of_equal_timesteps_has_one_row():
    plan = StepPlan.of(torch.tensor(0.25), torch.tensor(0.25))
    assert (bits(plan.timesteps), plan.video_index, plan.audio_index) == (bits(torch.tensor([0.25])), 0, 0)


# --------------------------------------------------------------------------------------------------- packing


@pytest.mark.parametrize(
    "width, height, num_frames, num_text_tokens",
    [(64, 32, 124, 7), (96, 64, 209, 1), (32, 128, 124, 13), (1344, 768, 124, 40)],
)
def test_layout_equals_the_pipelines_packed_sequence(width, height, num_frames, num_text_tokens):
    geometry = VideoGeometry.from_frames(width, height, num_frames, ANY_CANVAS)
    layout = PackedLayout.build(geometry, num_text_tokens)
    reference = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.full((num_text_tokens,), TEXT_TAG, dtype=torch.long),
        geometry.num_latent_frames, geometry.latent_height, geometry.latent_width, geometry.num_audio_latents,
        (1, 2, 2), 2, AUDIO_TAG, VIDEO_TAG,
    )
    position_ids, token_tags, video_indices, audio_indices, text_indices, num_condition_video, num_condition_audio = (
        reference
    )
    assert (num_condition_video, num_condition_audio) == (0, 0)
    assert layout.position_ids.dtype == torch.float64
    assert torch.equal(layout.position_ids.view(torch.int64), position_ids.view(torch.int64))  # bitwise
    for ours, theirs in ((layout.token_tags, token_tags), (layout.video_indices, video_indices),
                         (layout.audio_indices, audio_indices), (layout.text_indices, text_indices)):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("num_text_tokens", [1, 9])
def test_layout_covers_every_row_once_with_consistent_tags(num_text_tokens):
    geometry = VideoGeometry.from_frames(96, 64, 124, TINY_LIMITS)
    layout = PackedLayout.build(geometry, num_text_tokens)
    covered = torch.cat([layout.text_indices, layout.audio_indices, layout.video_indices])
    assert torch.equal(covered.sort().values, torch.arange(layout.num_tokens))
    assert layout.num_tokens == geometry.num_tokens(num_text_tokens)
    assert layout.video_indices.numel() == geometry.num_video_tokens == 37 * 6
    assert layout.audio_indices.numel() == geometry.num_audio_rows == 414
    for indices, tag in ((layout.text_indices, TEXT_TAG), (layout.audio_indices, AUDIO_TAG),
                         (layout.video_indices, VIDEO_TAG)):
        assert bool((layout.token_tags[indices] == tag).all())
    assert torch.equal(layout.timestep_indices(0, 1)[layout.audio_indices], torch.ones(414, dtype=torch.long))
    assert int(layout.timestep_indices(0, 1).sum()) == 414


def test_patchify_matches_the_pipeline_and_round_trips():
    geometry = VideoGeometry.from_frames(96, 64, 124, TINY_LIMITS)
    latents = torch.randn(geometry.video_latent_shape, generator=torch.Generator().manual_seed(1))
    rows = patchify_video(latents, geometry)
    assert rows.shape == (geometry.num_video_tokens, 96)
    assert torch.equal(rows, patchify_video_latents(latents[None], (1, 2, 2)))
    assert torch.equal(unpatchify_video(rows, geometry), latents)
    audio = torch.arange(414 * 32, dtype=torch.float32).reshape(414, 32)
    channels = audio_rows_to_channels(audio, geometry)
    assert channels.shape == (2, 32, 207)
    assert torch.equal(channels[1, :, 0], audio[207])  # the right channel starts at row A


def test_wrong_shapes_are_named():
    geometry = VideoGeometry.from_frames(64, 32, 124, TINY_LIMITS)
    with pytest.raises(PackingError, match=r"\(24, 37, 2, 4\)"):
        patchify_video(torch.zeros(24, 36, 2, 4), geometry)
    with pytest.raises(PackingError, match="num_text_tokens"):
        PackedLayout.build(geometry, 0)


# --------------------------------------------------------------------------------------------------- the oracle


@pytest.fixture(scope="module")
def transformer() -> MiniMaxH3Transformer3DModel:
    """helper A's seeded tiny H3 transformer, in the published dtypes: bf16 everywhere but 12 fp32 tensors."""
    model = tiny_transformer(seed=0)
    assert sum(p.dtype == torch.float32 for p in model.parameters()) == 12
    assert sum(p.dtype == torch.bfloat16 for p in model.parameters()) > 12
    return model


def run_pipeline(transformer, prompt_embeds, geometry, num_steps, video_shift, audio_shift, seed):
    """diffusers' t2va denoise side; returns its outputs and the kwargs of every transformer call it made."""
    pipe = MiniMaxH3CoreDenoiseStep().init_pipeline()
    pipe.update_components(
        transformer=transformer,
        scheduler=MiniMaxH3Scheduler(shift=video_shift),
        audio_scheduler=MiniMaxH3Scheduler(shift=audio_shift),
    )
    calls = []

    def record(_module, _args, kwargs):  # clone: the pipeline steps its latents in place after the call
        calls.append({name: value.clone() for name, value in kwargs.items() if isinstance(value, torch.Tensor)})

    handle = transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = pipe(
            prompt_embeds=prompt_embeds[None],
            text_token_tags=torch.full((prompt_embeds.shape[0],), TEXT_TAG, dtype=torch.long),
            height=geometry.height,
            width=geometry.width,
            num_frames=geometry.num_frames,
            num_inference_steps=num_steps,
            generator=torch.Generator("cpu").manual_seed(seed),
            output=["latents", "audio_latents"],
        )
    finally:
        handle.remove()
    return out["latents"], out["audio_latents"], calls


ORACLE_CASES = [
    # (width, height, frames, text tokens, steps, video shift, audio shift, seed)
    (64, 32, 124, 7, 4, 12.0, 3.0, 0),
    (96, 64, 141, 3, 8, 3.0, 12.0, 1234),  # audio shifted harder: plan order (audio, video); sigmas < 0.5
]


@pytest.mark.parametrize("width, height, num_frames, num_text, num_steps, video_shift, audio_shift, seed", ORACLE_CASES)
def test_denoise_is_bit_identical_to_the_diffusers_pipeline(
    transformer, width, height, num_frames, num_text, num_steps, video_shift, audio_shift, seed
):
    geometry = VideoGeometry.from_frames(width, height, num_frames, TINY_LIMITS)
    schedule = H3Schedule.build(num_steps, video_shift, audio_shift)
    prompt_embeds = torch.randn(num_text, 32, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16)

    video, audio = denoise(transformer, prompt_embeds, geometry, schedule, seed)
    ref_video, ref_audio, calls = run_pipeline(
        transformer, prompt_embeds, geometry, num_steps, video_shift, audio_shift, seed
    )

    assert video.dtype == audio.dtype == torch.float32
    assert video.shape == geometry.video_latent_shape and torch.equal(video, ref_video[0])
    assert audio.shape == (geometry.num_audio_rows, 32)
    assert torch.equal(audio_rows_to_channels(audio, geometry), ref_audio)

    # The pipeline's transformer saw our plans, in order, bit for bit (the AdaLN plan keys).
    assert len(calls) == schedule.num_forwards
    assert [bits(call["timestep"]) for call in calls] == [bits(plan) for plan in schedule.plans]


def test_transformer_inputs_are_the_tensors_the_pipeline_passes(transformer):
    geometry = VideoGeometry.from_frames(64, 32, 124, TINY_LIMITS)
    schedule = H3Schedule.build(4)
    prompt_embeds = torch.randn(5, 32, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    _, _, calls = run_pipeline(transformer, prompt_embeds, geometry, 4, 12.0, 3.0, seed=7)

    denoiser = Denoiser(geometry, schedule, num_text_tokens=5)
    latents = denoiser.initial_latents(seed=7)
    for i, call in enumerate(calls):
        inputs = denoiser.transformer_inputs(i, latents, prompt_embeds)
        for name in ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "timestep_indices",
                     "token_tags", "position_ids", "video_indices", "audio_indices", "text_indices"):
            ours, theirs = getattr(inputs, name), call[name]
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
            assert torch.equal(ours, theirs), name
        with torch.no_grad():
            velocity_video, velocity_audio = inputs.run(transformer)
        assert velocity_video.abs().sum() > 0 and velocity_audio.abs().sum() > 0  # a real model, not a zero map
        latents = denoiser.step(i, latents, velocity_video, velocity_audio)


def test_initial_latents_follow_the_seed_and_differ_between_seeds():
    geometry = VideoGeometry.from_frames(64, 32, 124, TINY_LIMITS)
    denoiser = Denoiser(geometry, H3Schedule.build(4), num_text_tokens=3)
    first, again, other = (denoiser.initial_latents(seed) for seed in (5, 5, 6))
    assert torch.equal(first.video, again.video) and torch.equal(first.audio, again.audio)
    assert not torch.equal(first.video, other.video)
    generator = torch.Generator("cpu").manual_seed(5)  # video [C, F, H, W] first, then the audio rows
    video = torch.randn(geometry.video_latent_shape, generator=generator)
    audio = torch.randn(geometry.num_audio_rows, 32, generator=generator)
    assert torch.equal(unpatchify_video(first.video, geometry), video) and torch.equal(first.audio, audio)


def test_denoiser_rejects_out_of_range_steps_and_shapes():
    geometry = VideoGeometry.from_frames(64, 32, 124, TINY_LIMITS)
    denoiser = Denoiser(geometry, H3Schedule.build(4), num_text_tokens=3)
    latents = denoiser.initial_latents(0)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        denoiser.step(3, latents, latents.video, latents.audio)
    with pytest.raises(PackingError, match="velocity_audio"):
        denoiser.step(0, latents, latents.video, latents.audio[:-1])
    with pytest.raises(PackingError, match="3 text rows"):
        denoiser.transformer_inputs(0, latents, torch.zeros(4, 32))
    with pytest.raises(ValueError, match="seed"):
        denoiser.initial_latents(-1)
    assert isinstance(denoiser.step(2, latents, latents.video, latents.audio), PackedLatents)
