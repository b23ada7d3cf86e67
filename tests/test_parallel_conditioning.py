"""A sequence-parallel engine serves t2va alone: keyframes (fl2va) and references (ref2va) are refused alike on
every rank, before any collective, and its limits do not list them.

Why: every rank runs every stage of a request, but only rank 0 holds the VAEs (their encoder halves make the
keyframe and reference latents), and with `text_encoder_tp` the ranks' split Qwen3-VL has no vision tower. Before
this refusal, with `text_encoder_tp: false` rank 0 accepted a fl2va request its peers refused: rank 0 then waited
in the loop's collectives for ranks that had left. Two gloo ranks (`parallel.launch`, no Ray) on the tiny
checkpoint, for both encoder settings; after the refusal a t2va request still runs and the ranks agree.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from engine.api import GenerationRequest, KeyframeInput
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ClientError
from model.tiny import make_tiny_checkpoint
from tests.conditioning_support import random_image
from tests.ranks_support import rank_reports

pytestmark = pytest.mark.timeout(600)

WORLD_SIZE = 2
TIMEOUT_S = 30.0


def t2va() -> GenerationRequest:
    return GenerationRequest(prompt="a red fox", steps=3, seconds=0.5, width=64, height=64, seed=11,
                             return_video=False)


def fl2va() -> GenerationRequest:
    buffer = io.BytesIO()
    random_image(64, 64, seed=1).save(buffer, format="PNG")
    return t2va().model_copy(update={"keyframes": (KeyframeInput(image=buffer.getvalue(), anchor="first"),)})


def engine_config(checkpoint: Path, *, sp: int, text_encoder_tp: bool) -> EngineConfig:
    return EngineConfig(
        checkpoint=str(checkpoint), device="cpu", geometry={"short_edge": None, "min_seconds": 0.1},
        adaln={"mode": "resident"}, pool={"enabled": False},
        parallel={"sp": sp, "timeout_s": TIMEOUT_S, "text_encoder_tp": text_encoder_tp},
    )


def _rank_program(rank: int, world_size: int, init_method: str, checkpoint: Path, out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    from parallel.group import init_group

    group = init_group(rank, world_size, init_method, "cpu", timeout_s=TIMEOUT_S)
    report: dict = {}
    for tp in (False, True):
        engine = Engine(engine_config(checkpoint, sp=world_size, text_encoder_tp=tp), group=group)
        try:
            engine.generate(fl2va())
            refusal = None
        except ClientError as exc:
            refusal = (exc.field, str(exc))
        result = engine.generate(t2va())  # the group is intact: no rank is left in a collective
        report[tp] = {"tasks": engine.limits.tasks, "refusal": refusal, "video": result.video}
    torch.save(report, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sp-conditioning") / "tiny", "diffusers", seed=0)


def test_a_sequence_parallel_engine_refuses_keyframes_on_every_rank_and_lists_t2va_alone(checkpoint, tmp_path):
    reports = rank_reports(_rank_program, WORLD_SIZE, tmp_path, (checkpoint, tmp_path), deadline_s=480)
    for tp in (False, True):
        for report in reports:
            assert report[tp]["tasks"] == ("t2va",)
            field, message = report[tp]["refusal"]
            assert field == "keyframes" and "engine.parallel.sp=2" in message and "serves t2va" in message
        assert torch.equal(reports[0][tp]["video"], reports[1][tp]["video"])


def test_the_served_tasks_follow_the_config():
    assert EngineConfig().served_tasks() == ("t2va", "fl2va")
    assert EngineConfig(text_encoder={"vision": False}).served_tasks() == ("t2va",)
    assert EngineConfig(parallel={"sp": 2}).served_tasks() == ("t2va",)
    assert EngineConfig(parallel={"sp": 2}).served_tasks("ref2va") == ()
    for refused in ({"parallel": {"sp": 2}}, {"text_encoder": {"vision": False}}):
        with pytest.raises(ValidationError, match="partition: ref2va serves ref2va only, which this config cannot"):
            EngineConfig(partition="ref2va", **refused)
