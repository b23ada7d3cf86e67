"""Flow-matching schedule: sigmas, per-step plans and their keys."""

from __future__ import annotations

import math

import pytest
import torch

from model.sampler import FlowMatchSchedule, StepTimesteps, euler_step, guided, shifted_sigmas


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 0.5])
def test_sigmas_run_from_exactly_1_to_exactly_0_strictly_decreasing(shift):
    sigmas = shifted_sigmas(50, shift)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (51,)
    assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
    assert (sigmas[1:] < sigmas[:-1]).all()


def test_shift_formula_and_shift_1_is_linspace():
    assert torch.equal(shifted_sigmas(4, 1.0), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    # s*sigma / (1 + (s-1)*sigma) at sigma = 0.5, s = 3: 1.5 / 2 = 0.75
    assert shifted_sigmas(2, 3.0)[1].item() == 0.75


def test_video_and_audio_use_their_own_shift():
    schedule = FlowMatchSchedule(10, shift=3.0, audio_shift=5.0)
    assert torch.equal(schedule.sigmas_video, shifted_sigmas(10, 3.0))
    assert torch.equal(schedule.sigmas_audio, shifted_sigmas(10, 5.0))


def test_two_distinct_timesteps_per_step_when_shifts_differ():
    schedule = FlowMatchSchedule(10, shift=3.0, audio_shift=5.0)
    # Step 0 starts both modalities at sigma 1.0 exactly: one timestep.
    assert schedule.step_timesteps(0).tolist() == [1.0] and schedule.step_token_index(0) == (0, 0)
    for i in range(1, 10):
        t = schedule.step_timesteps(i)
        assert t.dtype == torch.float32
        assert t.tolist() == [schedule.sigmas_video[i].item(), schedule.sigmas_audio[i].item()]  # video first
        assert schedule.step_token_index(i) == (0, 1)


def test_one_timestep_per_step_when_shifts_are_equal():
    schedule = FlowMatchSchedule(10, shift=3.0, audio_shift=3.0)
    assert all(len(p) == 1 for p in schedule.plans)
    assert all(schedule.step_token_index(i) == (0, 0) for i in range(10))


def test_video_only_mode_has_plan_width_1():
    schedule = FlowMatchSchedule(5, shift=3.0, audio_shift=5.0, mode="video")
    assert all(len(p) == 1 for p in schedule.plans)


def test_timesteps_deduplicate_by_exact_fp32_bits():
    assert StepTimesteps.from_sigmas(0.5, 0.5).num_rows == 1
    # 0.1 and the next fp32 after it are distinct timesteps.
    next_up = torch.nextafter(torch.tensor(0.1), torch.tensor(1.0))
    step = StepTimesteps.from_sigmas(torch.tensor(0.1), next_up)
    assert step.num_rows == 2 and (step.video_index, step.audio_index) == (0, 1)


def test_plans_hold_one_entry_per_step_up_front():
    schedule = FlowMatchSchedule(50, shift=5.0, audio_shift=3.0)
    assert len(schedule.plans) == 50
    assert all(torch.equal(p, schedule.step_timesteps(i)) for i, p in enumerate(schedule.plans))


def test_schedule_key_is_stable_and_distinguishes_schedules():
    a = FlowMatchSchedule(20, shift=3.0, audio_shift=5.0)
    assert a.schedule_key == FlowMatchSchedule(20, shift=3.0, audio_shift=5.0).schedule_key
    assert a.schedule_key == "flow-euler/steps=20/shift=3.0/audio_shift=5.0/mode=video_audio"
    others = [FlowMatchSchedule(21, 3.0, 5.0), FlowMatchSchedule(20, 3.5, 5.0), FlowMatchSchedule(20, 3.0, 5.5),
              FlowMatchSchedule(20, 3.0, 5.0, mode="video")]
    assert len({a.schedule_key, *(o.schedule_key for o in others)}) == 5


@pytest.mark.parametrize(
    "kwargs", [dict(steps=0), dict(steps=2.5), dict(steps=True), dict(steps=4, shift=0.0), dict(steps=4, shift=-1.0),
               dict(steps=4, shift=math.inf), dict(steps=4, audio_shift=math.nan), dict(steps=4, mode="audio")]
)
def test_invalid_schedule_is_a_value_error(kwargs):
    with pytest.raises(ValueError):
        FlowMatchSchedule(**kwargs)


def test_euler_step_moves_along_velocity_by_sigma_difference():
    x, v = torch.tensor([1.0, 2.0]), torch.tensor([4.0, -2.0])
    assert torch.equal(euler_step(x, v, 1.0, 0.75), torch.tensor([0.0, 2.5]))


def test_euler_recovers_x0_for_the_exact_velocity():
    x0, noise = torch.randn(8), torch.randn(8)
    schedule = FlowMatchSchedule(7, shift=3.0)
    x = noise.clone()
    for i in range(7):
        x = euler_step(x, noise - x0, schedule.sigmas_video[i], schedule.sigmas_video[i + 1])
    torch.testing.assert_close(x, x0)


def test_guidance_is_uncond_plus_scale_times_difference():
    cond, uncond = torch.tensor([3.0]), torch.tensor([1.0])
    assert guided(cond, uncond, 1.0).item() == 3.0
    assert guided(cond, uncond, 5.0).item() == 11.0
