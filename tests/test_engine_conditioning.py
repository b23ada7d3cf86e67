"""The engine runs keyframe (fl2va) requests end to end on the tiny model: uploads decoded with their limits,
the canvas from the first keyframe, online AdaLN == resident, the same bits as `model/`'s composition (which
tests/test_h3_fl2va.py holds equal to diffusers' pipeline), and bad inputs refused naming the field."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from engine.api import GenerationRequest, KeyframeInput, ReferenceInput
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import ClientError, UploadField, UploadKind
from model.conditioning import Conditioning, ImageReference, Keyframe, KeyframeAnchor, VideoReference
from model.layout import Partition
from model.packing import audio_rows_to_channels
from model.schedule import schedule_key
from model.tiny import make_tiny_checkpoint
from model.tiny_adapter import save_adapter, tiny_lora_factors
from tests.conditioning_support import PROMPT, STEPS, Ours, random_image, random_video, soundtrack_samples, video_file

FIRST, LAST = random_image(96, 54, seed=1), random_image(40, 40, seed=2)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def fl2va_request(**overrides) -> GenerationRequest:
    fields = dict(prompt=PROMPT, steps=STEPS, seconds=5.0, seed=4, return_video=False,
                  keyframes=(KeyframeInput(image=png(FIRST), anchor="first"),
                             KeyframeInput(image=png(LAST), frame_index=-1)))
    return GenerationRequest(**{**fields, **overrides})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("engine-fl2va") / "tiny", "diffusers", seed=0)


def make_engine(checkpoint, mode: str, **config) -> Engine:
    return Engine(EngineConfig(checkpoint=str(checkpoint), device="cpu",
                               adaln={"mode": mode, "host_cache_gb": 0.01}, **config))


@pytest.fixture(scope="module")
def online(checkpoint):
    return make_engine(checkpoint, "online")


@pytest.fixture(scope="module")
def resident(checkpoint):
    return make_engine(checkpoint, "resident")


def test_fl2va_online_equals_resident_equals_the_model_composition(checkpoint, online, resident):
    online_result = online.generate(fl2va_request())
    resident_result = resident.generate(fl2va_request())
    assert torch.equal(online_result.video, resident_result.video)
    assert torch.equal(online_result.audio, resident_result.audio)
    ours = Ours.load(checkpoint, Partition.FL2VA)
    conditioning = Conditioning(keyframes=(Keyframe(FIRST, KeyframeAnchor.FIRST), Keyframe(LAST, KeyframeAnchor.LAST)))
    video, audio, _ = ours.generate(conditioning, seed=4)
    assert torch.equal(online_result.video, video)
    assert online_result.video.shape[-2:] == (2, 4)  # the first keyframe's 16:9 on the tiny canvas: 64x32
    assert online_result.stats.schedule_key.startswith("h3-rf-euler/fl2va/")
    adaln = online_result.stats.adaln  # 2 forwards: {0, 0.999} and {t_audio, t_video, 0.999}, two distinct plans
    assert adaln.built_plans + adaln.gpu_hit_plans + adaln.host_hit_plans == 2


@pytest.mark.slow
def test_an_fl2va_request_naming_an_adapter_runs_it_and_one_naming_none_is_the_plain_engines(checkpoint, online,
                                                                                             tmp_path):
    path = save_adapter(tmp_path / "turbo.safetensors", tiny_lora_factors(1))
    engine = make_engine(checkpoint, "online", adapters={"turbo": {"path": str(path)}})
    with_adapter = engine.generate(fl2va_request(adapters=({"name": "turbo"},)))
    without = engine.generate(fl2va_request())
    assert with_adapter.stats.adapters.scales == {"turbo": 1.0} and without.stats.adapters is None
    assert with_adapter.video.shape == without.video.shape and not torch.equal(with_adapter.video, without.video)
    assert not torch.equal(with_adapter.audio, without.audio)
    plain = online.generate(fl2va_request())  # adapters off: the bits of an engine serving none
    assert torch.equal(without.video, plain.video) and torch.equal(without.audio, plain.audio)


@pytest.mark.slow
def test_fl2va_returns_an_mp4_and_repeats_from_the_prompt_cache(online):
    first = online.generate(fl2va_request(return_video=True, seed=9))
    again = online.generate(fl2va_request(return_video=True, seed=9))
    assert first.mp4 and first.mp4[4:8] == b"ftyp"
    assert torch.equal(first.video, again.video)
    assert again.stats.prompt_cache.hits > first.stats.prompt_cache.hits


@pytest.mark.parametrize("keyframe, field", [
    (KeyframeInput(image=png(FIRST)[:60], anchor="first"), "keyframes[0].image"),
    (KeyframeInput(image=b"GIF89a-not-really", anchor="first"), "keyframes[0].image"),
    (KeyframeInput(image=png(FIRST), frame_index=40), "keyframes[0].frame_index"),
])
def test_bad_keyframes_are_client_errors_naming_the_field(online, keyframe, field):
    with pytest.raises(ClientError) as error:
        online.validate(fl2va_request(keyframes=(keyframe,)))
    assert str(error.value).startswith(field)
    assert error.value.upload == UploadField(UploadKind.KEYFRAMES, 0)  # the upload, as data (the video API's name)
    online.generate(fl2va_request())  # the engine stays usable


def test_references_on_the_fl2va_partition_name_the_served_tasks(online):
    request = GenerationRequest(prompt=PROMPT, steps=STEPS, references=(ReferenceInput(kind="image",
                                                                                       data=png(FIRST)),))
    with pytest.raises(ClientError, match="t2va, fl2va"):
        online.validate(request)


def test_a_text_only_engine_refuses_keyframes(checkpoint):
    engine = make_engine(checkpoint, "resident", text_encoder={"vision": False})
    assert not engine.prompt_encoder.has_vision
    assert engine.limits.tasks == ("t2va",)  # what GET /v1/models lists: not fl2va, which it would refuse
    with pytest.raises(ClientError, match="keyframes: fl2va is not served.*text_encoder.vision: false"):
        engine.validate(fl2va_request())


# --- engine.partition: ref2va ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def both_partitions(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("engine-ref2va") / "tiny", "diffusers", seed=0, ref2va=True)


@pytest.fixture(scope="module")
def ref2va_engine(both_partitions):
    return make_engine(both_partitions, "resident", partition="ref2va")


def test_the_ref2va_partition_serves_references_with_its_own_transformer(both_partitions, ref2va_engine):
    assert ref2va_engine.limits.tasks == ("ref2va",) and ref2va_engine.describe()["limits"]["tasks"] == ["ref2va"]
    assert ref2va_engine.checkpoint.transformer_dir.name == "transformer_ref"
    request = GenerationRequest(prompt=PROMPT, steps=STEPS, seconds=5.0, seed=4, return_video=False,
                                references=(ReferenceInput(kind="image", data=png(FIRST)),))
    result = ref2va_engine.generate(request)
    video, _, _ = Ours.load(both_partitions, Partition.REF2VA).generate(Conditioning(
        references=(ImageReference(FIRST),)), seed=4)
    assert torch.equal(result.video, video)


@pytest.mark.slow
def test_a_video_reference_upload_is_the_model_composition_of_its_frames_and_soundtrack(both_partitions,
                                                                                        ref2va_engine):
    """A lossless upload (FFV1 + PCM): the engine's decode gives the file's frames and samples, so the request's
    latents are `model/`'s composition of those arrays (which tests/test_h3_ref2va.py holds equal to diffusers')."""
    frames = random_video(30, 48, 32, seed=3)  # 2.5 s at 12 fps
    request = GenerationRequest(prompt=PROMPT, steps=STEPS, seconds=5.0, seed=4, return_video=False, references=(
        ReferenceInput(kind="image", data=png(FIRST)),
        ReferenceInput(kind="video", data=video_file(frames, fps=12, soundtrack_seconds=2.0))))
    result = ref2va_engine.generate(request)
    soundtrack = soundtrack_samples(2.0, 32000).astype("float32") / 32768
    video, audio, prepared = Ours.load(both_partitions, Partition.REF2VA).generate(Conditioning(references=(
        ImageReference(FIRST), VideoReference(frames, 12.0, soundtrack, 32000))), seed=4)
    assert prepared.reference_audio  # the video's soundtrack conditions the audio
    assert torch.equal(result.video, video)
    assert torch.equal(audio_rows_to_channels(result.audio, prepared.geometry), audio)


@pytest.mark.slow
def test_a_video_references_soundtrack_is_in_the_schedule_key_as_its_audio_rows_are_in_the_plans(both_partitions):
    """A video with a soundtrack adds the reference audio rows (t = 1) to every plan, as a soundtrack reference
    does: the router's key (the request's, before any decode), the served-schedule map's and the stats' say so."""
    frames = random_video(30, 48, 32, seed=3)

    def request(soundtrack_seconds):
        return GenerationRequest(prompt=PROMPT, steps=STEPS, seconds=5.0, seed=4, return_video=False, references=(
            ReferenceInput(kind="video", data=video_file(frames, fps=12, soundtrack_seconds=soundtrack_seconds)),))

    with_sound, silent = request(2.0), request(None)
    assert with_sound.schedule_key == schedule_key(STEPS, task="ref2va", reference_audio=True)
    assert silent.schedule_key == schedule_key(STEPS, task="ref2va")
    engine = make_engine(both_partitions, "online", partition="ref2va")
    result = engine.generate(with_sound)
    assert result.stats.schedule_key == with_sound.schedule_key
    assert engine.served_schedules.slab_state(engine.plan_cache).schedule_keys == (with_sound.schedule_key,)


@pytest.mark.parametrize("request_fields, field, served", [
    ({}, "references", "t2va is not served by this model (the Ref2VA partition serves ref2va)"),
    ({"keyframes": (KeyframeInput(image=png(FIRST), anchor="first"),)}, "keyframes", "fl2va is not served"),
])
def test_the_ref2va_partition_refuses_text_only_and_keyframes(ref2va_engine, request_fields, field, served):
    with pytest.raises(ClientError) as error:
        ref2va_engine.validate(GenerationRequest(prompt=PROMPT, steps=STEPS, **request_fields))
    assert error.value.field == field and served in str(error.value)


def test_the_fl2va_partition_of_a_checkpoint_with_both_is_the_fl2va_transformer(both_partitions, online):
    engine = make_engine(both_partitions, "resident")  # engine.partition defaults to fl2va
    assert engine.limits.tasks == ("t2va", "fl2va") and engine.checkpoint.transformer_dir.name == "transformer"
    assert engine.weights.fingerprint == online.weights.fingerprint  # same seed: the FL2VA-only checkpoint's bits


# --- the caches on the conditioned tasks: each one on gives the resident bits (or Cache-DiT's own) -----------

#: tests/test_engine.py's Cache-DiT settings: Fn=1, Bn=1 of the 4 blocks, one warm-up forward.
CACHE_DIT = {"enabled": True, "Fn_compute_blocks": 1, "Bn_compute_blocks": 1, "max_warmup_steps": 1,
             "residual_diff_threshold": 0.15, "max_continuous_cached_steps": 2}


def ref2va_request() -> GenerationRequest:
    return GenerationRequest(prompt=PROMPT, steps=STEPS, seconds=5.0, seed=4, return_video=False, references=(
        ReferenceInput(kind="image", data=png(FIRST)), ReferenceInput(kind="image", data=png(LAST))))


def test_ref2va_online_adaln_gives_the_resident_bits(both_partitions, ref2va_engine):
    online = make_engine(both_partitions, "online", partition="ref2va")
    ours, theirs = online.generate(ref2va_request()), ref2va_engine.generate(ref2va_request())
    assert torch.equal(ours.video, theirs.video) and torch.equal(ours.audio, theirs.audio)
    assert ours.stats.adaln.built_plans > 0  # the plans were the cache's, not the resident projection's


def test_fl2va_layerwise_offload_gives_the_resident_bits(checkpoint, resident):
    offloaded = make_engine(checkpoint, "resident", offload={"enabled": True})
    out = offloaded.generate(fl2va_request(steps=4))
    expected = resident.generate(fl2va_request(steps=4))
    assert torch.equal(out.video, expected.video) and torch.equal(out.audio, expected.audio)
    assert out.stats.offload.steps == 3 and out.stats.offload.h2d_bytes > 0


def test_cache_dit_runs_on_fl2va_and_off_per_request_gives_the_resident_bits(checkpoint, resident):
    cached = make_engine(checkpoint, "resident", cache_dit=CACHE_DIT)
    out = cached.generate(fl2va_request(steps=9))
    assert out.stats.cache_dit.config == "F1B1 W1 R0.15 MC2" and len(out.stats.cache_dit.cached_steps) > 0
    again = cached.generate(fl2va_request(steps=9))  # nothing leaks between requests
    assert again.stats.cache_dit.cached_steps == out.stats.cache_dit.cached_steps
    assert torch.equal(again.video, out.video)
    off = cached.generate(fl2va_request(steps=9, cache_dit={"enabled": False}))
    assert off.stats.cache_dit.cached_steps == []
    assert torch.equal(off.video, resident.generate(fl2va_request(steps=9)).video)
