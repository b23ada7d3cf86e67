"""A sequence-parallel engine serves keyframes (fl2va) and references (ref2va) with the one-device engine's bits.

How: every rank runs every stage of a request, but only rank 0 holds the VAEs (their encoder halves make the
keyframe and reference latents) and the vision tower, so rank 0 checks and prepares the request and hands its
embedding (with its `Conditions`) to the other ranks (`engine.conditioning.prepared_on_rank_0`); every rank then
plans and denoises from it, as a split app's denoiser does. A request rank 0 refuses (a corrupt upload) is refused
on every rank, the group intact. With `text_encoder_tp` the ranks' split Qwen3-VL has no vision tower: that
combination serves t2va alone, refused alike on every rank before any collective. Two gloo ranks
(`parallel.launch`, no Ray) on the tiny checkpoint with both partitions; SP2 == SP1 bit for bit.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from engine.api import GenerationRequest, KeyframeInput, ReferenceInput
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ClientError
from model.tiny import make_tiny_checkpoint
from tests.conditioning_support import random_image
from tests.ranks_support import rank_reports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # slow: spawns gloo rank processes (each imports torch + diffusers) for whole engines

WORLD_SIZE = 2
TIMEOUT_S = 30.0


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    random_image(64, 64, seed=seed).save(buffer, format="PNG")
    return buffer.getvalue()


def t2va() -> GenerationRequest:
    return GenerationRequest(prompt="a red fox", steps=3, seconds=0.5, width=64, height=64, seed=11,
                             return_video=False)


def fl2va(image: bytes | None = None) -> GenerationRequest:
    keyframe = KeyframeInput(image=image if image is not None else png(1), anchor="first")
    return t2va().model_copy(update={"keyframes": (keyframe,)})


def ref2va() -> GenerationRequest:
    return t2va().model_copy(update={"references": (ReferenceInput(kind="image", data=png(2)),)})


def engine_config(checkpoint: Path, *, sp: int, text_encoder_tp: bool = False,
                  partition: str = "fl2va") -> EngineConfig:
    return EngineConfig(
        checkpoint=str(checkpoint), device="cpu", geometry={"short_edge": None, "min_seconds": 0.1},
        adaln={"mode": "resident"}, pool={"enabled": False}, partition=partition,
        parallel={"sp": sp, "timeout_s": TIMEOUT_S, "text_encoder_tp": text_encoder_tp},
    )


def latents(engine: Engine, request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor]:
    result = engine.generate(request)
    return result.video, result.audio


def refusal(engine: Engine, request: GenerationRequest) -> tuple[str, str] | None:
    try:
        engine.generate(request)
    except ClientError as exc:
        return exc.field, str(exc)
    return None


def _rank_program(rank: int, world_size: int, init_method: str, checkpoint: Path, out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on two cores
    from parallel.group import init_group

    group = init_group(rank, world_size, init_method, "cpu", timeout_s=TIMEOUT_S)
    report: dict = {}
    engine = Engine(engine_config(checkpoint, sp=world_size), group=group)
    report["fl2va_tasks"] = engine.limits.tasks
    report["vision"] = engine.prompt_stage.encoder.has_vision
    report["fl2va"] = latents(engine, fl2va())
    # A corrupt keyframe: refused by rank 0's decode, on every rank; the group is intact afterwards.
    report["corrupt"] = refusal(engine, fl2va(b"\x89PNG not an image"))
    report["t2va"] = latents(engine, t2va())
    engine = Engine(engine_config(checkpoint, sp=world_size, partition="ref2va"), group=group)
    report["ref2va"] = latents(engine, ref2va())
    engine = Engine(engine_config(checkpoint, sp=world_size, text_encoder_tp=True), group=group)
    report["tp_tasks"] = engine.limits.tasks
    report["tp_refusal"] = refusal(engine, fl2va())
    report["tp_t2va"] = latents(engine, t2va())  # no rank is left in a collective
    torch.save(report, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sp-conditioning") / "tiny", "diffusers", seed=0,
                                ref2va=True)


@pytest.fixture(scope="module")
def one_device(checkpoint) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The one-device engine's latents of each request (the reference every rank must equal)."""
    fl2va_engine = Engine(engine_config(checkpoint, sp=1))
    ref2va_engine = Engine(engine_config(checkpoint, sp=1, partition="ref2va"))
    return {"fl2va": latents(fl2va_engine, fl2va()), "t2va": latents(fl2va_engine, t2va()),
            "ref2va": latents(ref2va_engine, ref2va())}


@pytest.fixture(scope="module")
def reports(checkpoint, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("sp-conditioning-ranks")
    return rank_reports(_rank_program, WORLD_SIZE, out_dir, (checkpoint, out_dir), deadline_s=480)


def test_a_sequence_parallel_engine_generates_keyframes_and_references_as_one_device_does(reports, one_device):
    for report in reports:
        assert report["fl2va_tasks"] == ("t2va", "fl2va")
        for case in ("fl2va", "ref2va", "t2va"):
            video, audio = report[case]
            assert torch.equal(video, one_device[case][0]) and torch.equal(audio, one_device[case][1]), case
    # Rank 0 alone holds the vision tower (it prepares for every rank).
    assert [report["vision"] for report in reports] == [True, False]


def test_an_upload_rank_0_refuses_is_refused_on_every_rank_and_the_group_lives_on(reports, one_device):
    for report in reports:
        field, message = report["corrupt"]
        assert field == "keyframes[0].image", message
    assert reports[0]["corrupt"] == reports[1]["corrupt"]  # rank 1 raised rank 0's refusal
    # ... and the next request ran on both ranks (report["t2va"], compared above).


def test_a_tensor_parallel_text_encoder_refuses_keyframes_on_every_rank_and_lists_t2va_alone(reports):
    for report in reports:
        assert report["tp_tasks"] == ("t2va",)
        field, message = report["tp_refusal"]
        assert field == "keyframes"
        assert "engine.parallel.sp=2" in message and "engine.parallel.text_encoder_tp: true" in message
    assert torch.equal(reports[0]["tp_t2va"][0], reports[1]["tp_t2va"][0])


def test_the_served_tasks_follow_the_config():
    assert EngineConfig().served_tasks() == ("t2va", "fl2va")
    assert EngineConfig(text_encoder={"vision": False}).served_tasks() == ("t2va",)
    assert EngineConfig(parallel={"sp": 2, "text_encoder_tp": False}).served_tasks() == ("t2va", "fl2va")
    assert EngineConfig(parallel={"sp": 2, "text_encoder_tp": False}).served_tasks("ref2va") == ("ref2va",)
    assert EngineConfig(parallel={"sp": 2}).served_tasks() == ("t2va",)  # text_encoder_tp defaults to true
    assert EngineConfig(parallel={"sp": 2}).served_tasks("ref2va") == ()
    for refused in ({"parallel": {"sp": 2}}, {"text_encoder": {"vision": False}}):
        with pytest.raises(ValidationError, match="partition: ref2va serves ref2va only, which this config cannot"):
            EngineConfig(partition="ref2va", **refused)
