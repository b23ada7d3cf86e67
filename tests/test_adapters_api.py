"""Adapters at the two APIs: `/v1/generations` field `adapters`, `/v1/videos` field `lora` (vllm-omni's name), each
resolved against the served `ModelLimits.adapters` by the edges' own code (no engine, no Ray)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.errors import http_error, job_error
from deployments.video_backend import generation_request, invalid_request
from engine.api import AdapterChoice, CacheDitOverrides, GenerationRequest, with_adapter_defaults
from engine.errors import ClientError
from engine.limits import ServedAdapter, served_limits
from jobs.errors import InvalidVideoRequest
from jobs.limits import resolve_spec
from jobs.schemas import VideoCreateRequest

TURBO = ServedAdapter(name="turbo", steps=9, flow_shift=6.0, audio_flow_shift=3.0)
STYLE = ServedAdapter(name="style", scale=0.5)
LIMITS = served_limits("minimax-h3", max_steps=65, short_edge=768, max_pixels=768 * 1344, size_multiple=32,
                       min_seconds=5.0, max_seconds=15.0, fps=24, frames_per_chunk=17, frame_offset=5,
                       max_prompt_tokens=2048, default_flow_shift=12.0, default_audio_flow_shift=3.0,
                       adapters=(TURBO, STYLE))


@pytest.mark.parametrize("lora", ["turbo", {"name": "turbo"}, {"name": "turbo", "scale": 0.5}])
def test_a_video_naming_an_adapter_gets_its_steps_and_shift_when_it_leaves_them_out(lora):
    spec = resolve_spec(VideoCreateRequest.model_validate({"prompt": "a fox", "lora": lora}), LIMITS, seed=1)
    assert (spec.num_inference_steps, spec.flow_shift, spec.audio_flow_shift) == (9, 6.0, 3.0)
    assert spec.lora.name == "turbo" and spec.lora.scale == (lora.get("scale") if isinstance(lora, dict) else None)
    request = generation_request(spec, CacheDitOverrides(enabled=False))
    assert request.adapters == (AdapterChoice(name="turbo", scale=spec.lora.scale),) and request.steps == 9


def test_a_video_setting_steps_or_shift_keeps_them_and_one_without_lora_gets_the_models():
    spec = resolve_spec(VideoCreateRequest(prompt="a fox", lora="turbo", num_inference_steps=5, flow_shift=7.0),
                        LIMITS, seed=1)
    assert (spec.num_inference_steps, spec.flow_shift) == (5, 7.0)
    plain = resolve_spec(VideoCreateRequest(prompt="a fox"), LIMITS, seed=1)
    assert (plain.num_inference_steps, plain.flow_shift, plain.lora) == (50, 12.0, None)
    assert generation_request(plain, CacheDitOverrides(enabled=False)).adapters == ()


def test_a_video_naming_an_unknown_adapter_is_a_422_on_lora_listing_the_served_ones():
    with pytest.raises(InvalidVideoRequest) as info:
        resolve_spec(VideoCreateRequest(prompt="a fox", lora="nope"), LIMITS, seed=1)
    assert info.value.field == "lora"
    assert str(info.value) == "lora: 'nope' is not an adapter of this server (served: 'turbo', 'style')"
    error = job_error(info.value)
    assert error.status == 422 and "lora" in str(error.response_body())


def test_a_lora_name_that_is_no_adapter_name_is_refused_by_the_schema():
    with pytest.raises(ValidationError, match="lora.name"):
        VideoCreateRequest(prompt="a fox", lora="../../etc/passwd")


def test_a_generation_naming_an_unknown_adapter_is_a_422_on_adapters():
    request = GenerationRequest(prompt="a fox", adapters=({"name": "nope"},))
    with pytest.raises(ClientError) as info:
        with_adapter_defaults(request, LIMITS)
    error = http_error(info.value)
    assert error.status == 422 and info.value.field == "adapters"
    assert "served: 'turbo', 'style'" in str(error.response_body())


def test_composed_adapters_take_each_default_from_the_first_adapter_naming_it():
    request = GenerationRequest(prompt="a fox", adapters=({"name": "style"}, {"name": "turbo", "scale": 1.0}))
    resolved = with_adapter_defaults(request, LIMITS)
    assert (resolved.steps, resolved.flow_shift) == (9, 6.0)
    assert with_adapter_defaults(resolved, LIMITS) == resolved  # idempotent: the engine resolves again


def test_the_models_card_lists_the_adapters_with_their_defaults():
    card = LIMITS.model_dump(mode="json")
    assert [a["name"] for a in card["adapters"]] == ["turbo", "style"]
    assert card["adapters"][0]["steps"] == 9 and card["adapters"][1]["scale"] == 0.5


def test_an_engine_refusal_of_a_videos_adapter_is_a_422_on_lora():
    # e.g. a replica whose config lost the adapter after the job was admitted against another's limits
    with pytest.raises(ClientError) as info:
        with_adapter_defaults(GenerationRequest(prompt="a fox", adapters=({"name": "gone"},)), LIMITS)
    refusal = invalid_request(info.value)
    assert refusal.field == "lora" and "'gone' is not an adapter of this server" in str(refusal)


def test_the_ingress_routes_an_adapter_generation_by_the_schedule_it_runs():
    """`/v1/generations` resolves the adapter's defaults before the runner sends it: the router's schedule key
    (and the progress the caller sees) are those of the adapter's 9-point schedule, not the 50-step default."""
    import asyncio
    from types import SimpleNamespace

    from deployments.ingress import Ingress
    from deployments.partitions import ServedModels, ServedPartition

    asked = []

    async def describe() -> dict:
        asked.append(1)
        return {"limits": LIMITS.model_dump(mode="json")}

    worker = SimpleNamespace(describe=SimpleNamespace(remote=describe))
    models = ServedModels([ServedPartition("fl2va", worker, runner="the fl2va runner")], describe_timeout_s=5.0)
    stand_in = SimpleNamespace(_models=models)

    def resolve(request):
        return Ingress.func_or_class._routed(stand_in, request)

    request = GenerationRequest(prompt="a fox", adapters=({"name": "turbo"},))
    runner, resolved = asyncio.run(resolve(request))
    assert runner == "the fl2va runner"
    assert resolved.steps == 9 and resolved.schedule_key == with_adapter_defaults(request, LIMITS).schedule_key
    assert resolved.schedule_key != request.schedule_key
    plain = GenerationRequest(prompt="a fox")
    assert asyncio.run(resolve(plain))[1] is plain  # no adapter: the request as sent
    assert len(asked) == 1  # the worker's card, asked once (for the adapter's defaults)
    with pytest.raises(ClientError, match="adapters"):
        asyncio.run(resolve(GenerationRequest(prompt="a fox", adapters=({"name": "nope"},))))
