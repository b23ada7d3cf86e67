"""bench.conditioning --smoke: every task's stages on the CPU, fl2va and ref2va beside t2va in one report.

Asserted on the JSON (and that the markdown names every task and stage): each task ran every stage it has, with
positive times; the conditioned tasks add the upload decode, the prepare step, the VAE encode and the vision tower
(the soundtrack adds the audio VAE); ref2va ran on the Ref2VA partition's transformer; the packed sequences grow with
the conditions; every scaled number says what it was scaled to and the modelled stages carry their floor.
"""

from __future__ import annotations

import json

import pytest

from bench import conditioning
from bench.conditioning import Stage, Task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EVERY_TASK = {Stage.TEXT, Stage.PLAN_MISS, Stage.PLAN_HIT, Stage.DENOISE, Stage.VIDEO_DECODE, Stage.AUDIO_DECODE,
              Stage.MUX}
CONDITIONED = EVERY_TASK | {Stage.UPLOAD, Stage.PREPARE, Stage.VIDEO_VAE, Stage.VISION, Stage.ROTARY}
EXPECTED = {Task.T2VA: EVERY_TASK, Task.FL2VA: CONDITIONED, Task.REF2VA_IMAGES: CONDITIONED,
            Task.REF2VA_MIXED: CONDITIONED | {Stage.AUDIO_VAE}}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("conditioning")
    assert conditioning.main(["--smoke", "--out", str(out), "--workdir", str(out / "w")]) == 0
    return json.loads((out / "conditioning-smoke-cpu.json").read_text()), (out / "conditioning-smoke-cpu.md").read_text()


def test_every_task_runs_its_stages_with_positive_times(smoke):
    report, _ = smoke
    assert report["skipped"] == []
    assert report["meta"]["command"].startswith("python -m bench.conditioning --smoke") and report["meta"]["commit"]
    assert report["meta"]["tasks"] == [task.value for task in Task]
    for task, stages in EXPECTED.items():
        rows = {row["stage"]: row for row in report["stages"] if row["task"] == task.value}
        assert set(rows) == {stage.value for stage in stages}, task
        for stage, row in rows.items():
            assert row["measured_s"] > 0 and row["scaled_s"] > 0 and row["scaled_to"], (task, stage)


def test_scaled_rows_say_how_and_modelled_stages_carry_their_floor(smoke):
    report, _ = smoke
    meta = report["meta"]
    for row in report["stages"]:
        if row["stage"] == Stage.DENOISE.value:
            assert row["scaled_to"] == f"50 blocks (x{50 / meta['num_blocks']:.1f})"
            assert row["scaled_s"] == pytest.approx(row["measured_s"] * 50 / meta["num_blocks"], rel=1e-3, abs=1e-4)
        if row["stage"] == Stage.TEXT.value:
            assert row["scaled_to"] == f"50 layers (x{50 / meta['text_layers']:.1f})"
        if row["stage"] in (Stage.DENOISE.value, Stage.TEXT.value, Stage.VISION.value, Stage.PLAN_MISS.value):
            assert row["floor_s"] > 0 and row["x_floor"] > 0 and row["floor"], row


def test_ref2va_runs_on_the_ref2va_transformer_and_conditions_lengthen_the_sequence(smoke):
    report, _ = smoke
    requests = {row["task"]: row for row in report["requests"]}
    assert [requests[task.value]["transformer"] for task in Task] == \
        ["transformer/", "transformer/", "transformer_ref/", "transformer_ref/"]
    t2va = requests[Task.T2VA.value]
    assert t2va["vision_rows"] == t2va["condition_video_rows"] == t2va["condition_audio_rows"] == 0
    assert t2va["packed_tokens"] == t2va["text_rows"] + t2va["generated_rows"]
    for task in (Task.FL2VA, Task.REF2VA_IMAGES, Task.REF2VA_MIXED):
        row = requests[task.value]
        assert row["vision_rows"] > 0 and row["condition_video_rows"] > 0, task
        assert row["text_rows"] > row["prompt_tokens"] == t2va["prompt_tokens"], task
        assert row["generated_rows"] == t2va["generated_rows"], task  # one canvas for every task
        assert row["packed_tokens"] == (row["text_rows"] + row["generated_rows"] + row["condition_video_rows"]
                                        + row["condition_audio_rows"]), task
    assert requests[Task.REF2VA_MIXED.value]["condition_audio_rows"] > 0  # the soundtrack
    # keyframe rows at 0.999 add a plan row, the soundtrack's t = 1 another
    assert [requests[task.value]["timesteps_per_plan"] for task in Task] == [2, 3, 3, 4]


def test_tables_set_every_task_beside_t2va(smoke):
    report, markdown = smoke
    tasks = [task.value for task in Task]
    matrix = {row["stage"]: row for row in report["seconds_per_stage"]}
    assert set(matrix) == {stage.value for stage in Stage}
    for task, stages in EXPECTED.items():
        for stage in Stage:
            assert (matrix[stage.value][task.value] is not None) == (stage in stages), (task, stage)
    end_to_end = {row["task"]: row for row in report["end_to_end"]}
    assert list(end_to_end) == tasks
    for row in end_to_end.values():
        assert row["total_s"] > row["denoise_s"] > 0 and row["x_t2va"] > 0
    assert end_to_end[Task.T2VA.value]["x_t2va"] == 1
    components = " ".join(row["component"] for row in report["memory"])
    for part in ("transformer FL2VA", "transformer Ref2VA", "language model", "vision tower", "video VAE", "audio VAE"):
        assert part in components
    for name in [*tasks, *(stage.value for stage in Stage)]:
        assert name in markdown
