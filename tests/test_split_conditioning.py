"""fl2va and ref2va split as a split app runs them, without Ray: the prepare stage (`engine.prepare`: the prompt,
the vision tower, the keyframes' and references' VAE encodes) makes the embedding, it crosses a process boundary
(pickled, as a Serve hop does), and a denoiser that holds the transformer alone (`DenoiserEngine`) gives the
latents a fused engine gives, bit for bit. One prepare stage serves both partitions; each refuses what it does not
serve, naming the field and the served tasks; a corrupt video reference is refused naming it."""

from __future__ import annotations

import pickle

import pytest
import torch

from engine.api import GenerationRequest, KeyframeInput, ReferenceInput
from engine.config import EngineConfig
from engine.engine import DenoiserEngine, Engine
from engine.errors import ClientError, UploadField, UploadKind
from engine.prepare import prepare_stage
from engine.stage_data import Conditions
from model.tiny import make_tiny_checkpoint
from tests.conditioning_support import PROMPT, STEPS, random_image, random_video, video_file, wav
from tests.test_engine_conditioning import png

FIRST, LAST = png(random_image(96, 54, seed=1)), png(random_image(40, 40, seed=2))
#: 2 s at 12 fps (the 5 s clip holds it whole), 48x32, with a 1.5 s soundtrack.
VIDEO = video_file(random_video(24, 48, 32, seed=3), fps=12, soundtrack_seconds=1.5)



#: case -> (partition, request fields)
CASES = {
    "fl2va-first-and-last": ("fl2va", {"keyframes": (KeyframeInput(image=FIRST, anchor="first"),
                                                     KeyframeInput(image=LAST, frame_index=-1))}),
    "fl2va-last-sized": ("fl2va", {"keyframes": (KeyframeInput(image=FIRST, anchor="last"),), "width": 64,
                                   "height": 64}),
    "ref2va-images": ("ref2va", {"references": (ReferenceInput(kind="image", data=FIRST),
                                                ReferenceInput(kind="image", data=LAST))}),
    "ref2va-image-and-soundtrack": ("ref2va", {"references": (ReferenceInput(kind="image", data=FIRST),
                                                              ReferenceInput(kind="audio", data=wav(1.0)))}),
    "ref2va-image-and-video-with-soundtrack": ("ref2va", {"references": (ReferenceInput(kind="image", data=FIRST),
                                                                         ReferenceInput(kind="video", data=VIDEO))}),
}
#: the cases whose references carry a soundtrack
WITH_AUDIO = {"ref2va-image-and-soundtrack", "ref2va-image-and-video-with-soundtrack"}


def request(**fields) -> GenerationRequest:
    return GenerationRequest(**{"prompt": PROMPT, "steps": STEPS, "seconds": 5.0, "seed": 4, "return_video": False,
                                **fields})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("split-conditioning") / "tiny", "diffusers", seed=0,
                                ref2va=True)


def config(checkpoint, partition: str, **fields) -> EngineConfig:
    return EngineConfig(checkpoint=str(checkpoint), device="cpu", partition=partition,
                        adaln={"mode": "online", "host_cache_gb": 0.01}, **fields)


@pytest.fixture(scope="module")
def prepare(checkpoint):
    return prepare_stage(config(checkpoint, "fl2va"), ("fl2va", "ref2va"))


@pytest.fixture(scope="module")
def engines(checkpoint):
    """partition -> (the fused engine, the denoiser alone)."""
    return {partition: (Engine(config(checkpoint, partition)),
                        DenoiserEngine(config(checkpoint, partition)))
            for partition in ("fl2va", "ref2va")}


#: The inner loop keeps the case with the most kinds of input; the others run in the full suite.
INNER_LOOP_CASE = "ref2va-image-and-video-with-soundtrack"


@pytest.mark.parametrize("case", [case if case == INNER_LOOP_CASE else pytest.param(case, marks=pytest.mark.slow)
                                  for case in CASES])
def test_split_equals_fused_bit_for_bit(prepare, engines, case):
    partition, fields = CASES[case]
    fused, denoiser = engines[partition]
    embedding = prepare.encode(request(**fields))
    assert isinstance(embedding.conditions, Conditions) and embedding.conditions.visual
    assert embedding.conditions.reference_audio == (case in WITH_AUDIO)
    received = pickle.loads(pickle.dumps(embedding, protocol=5))  # what a Serve hop delivers
    denoiser.validate(request(**fields), received)  # the Worker's check before its stream starts
    split = denoiser.denoise(request(**fields), received)
    whole = fused.generate(request(**fields))
    assert torch.equal(split.video, whole.video) and torch.equal(split.audio, whole.audio)
    assert split.stats.schedule_key == whole.stats.schedule_key == request(**fields).schedule_key
    # The canvas the prepare side resolved: 64x64 as asked, else the first image's 16:9 on the tiny canvas (64x32).
    assert split.video.shape[-2:] == ((4, 4) if "width" in fields else (2, 4))


def test_the_conditions_cross_as_arrays_and_come_back_equal(prepare):
    conditions = prepare.encode(request(**CASES["ref2va-image-and-soundtrack"][1])).conditions
    state = conditions.__getstate__()
    assert not any(isinstance(value, torch.Tensor) for value in state.values())
    assert not any(isinstance(item, torch.Tensor) for name in ("visual", "audio") for item in state[name])
    back = pickle.loads(pickle.dumps(conditions, protocol=5))
    assert torch.equal(back.text_token_tags, conditions.text_token_tags) and back.blocks == conditions.blocks
    assert all(torch.equal(a, b) for a, b in zip(back.visual + back.audio, conditions.visual + conditions.audio))


def test_a_denoiser_refuses_the_other_partitions_task(prepare, engines):
    _, fl2va_denoiser = engines["fl2va"]
    fields = CASES["ref2va-images"][1]
    with pytest.raises(ClientError, match="ref2va is not served by this model .*serves t2va, fl2va") as error:
        fl2va_denoiser.denoise(request(**fields), prepare.encode(request(**fields)))
    assert error.value.field == "references"


def test_a_denoiser_without_the_conditions_refuses_clearly(engines):
    _, denoiser = engines["fl2va"]
    with pytest.raises(ClientError, match="vision tower"):
        denoiser.validate(request(**CASES["fl2va-first-and-last"][1]))


@pytest.mark.parametrize("partitions, fields, field, served", [
    (("fl2va",), CASES["ref2va-images"][1], "references", "t2va, fl2va"),
    (("ref2va",), {}, "prompt", "ref2va"),
    (("ref2va",), CASES["fl2va-first-and-last"][1], "keyframes", "ref2va"),
])
def test_the_prepare_stage_serves_its_partitions_tasks_only(checkpoint, partitions, fields, field, served):
    stage = prepare_stage(config(checkpoint, partitions[0]), partitions)
    with pytest.raises(ClientError, match=f"is not served here \\(the served tasks are {served}\\)") as error:
        stage.check(request(**fields))
    assert error.value.field == field


def test_a_text_only_prepare_stage_loads_no_vision_tower_and_no_vaes(checkpoint):
    stage = prepare_stage(config(checkpoint, "fl2va", text_encoder={"vision": False}), ("fl2va",))
    assert stage.conditioning is None and not stage.prompt.encoder.has_vision
    assert stage.encode(request()).conditions is None
    with pytest.raises(ClientError, match="keyframes: fl2va is not served by this engine .*vision"):
        stage.check(request(**CASES["fl2va-first-and-last"][1]))


@pytest.mark.parametrize("data, message", [
    (b"not even a video file", "not a media file"),
    (VIDEO[: len(VIDEO) // 3], "decodes to no samples"),  # cut before the soundtrack's packets
])
def test_a_corrupt_video_reference_is_refused_naming_it(prepare, data, message):
    video = ReferenceInput(kind="video", data=data)
    with pytest.raises(ClientError) as error:
        prepare.check(request(references=(ReferenceInput(kind="image", data=FIRST), video)))
    assert error.value.field == "references[1]" and message in str(error.value)
    assert error.value.upload == UploadField(UploadKind.REFERENCES, 1)
