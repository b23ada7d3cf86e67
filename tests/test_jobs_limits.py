"""Resolving an API request into a VideoSpec against the served model's limits (the engine's `ModelLimits`, as
the full-width H3 serves them): defaults, sizes, and every refusal naming the field, the value and the limit."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.config import EngineConfig
from engine.model_limits import H3_HIDDEN_SIZE, model_limits
from engine.limits import ModelLimits
from jobs.errors import InvalidVideoRequest
from jobs.limits import resolve_spec
from jobs.schemas import VideoCreateRequest

#: What the engine serves for the released model with its default config.
RELEASED_LIMITS = model_limits(EngineConfig(), H3_HIDDEN_SIZE)


def request(**fields) -> VideoCreateRequest:
    return VideoCreateRequest.model_validate({"prompt": "a lighthouse at dusk", **fields}, strict=True)


def test_h3_defaults_fill_every_field():
    spec = resolve_spec(request(seed=3), RELEASED_LIMITS)
    assert spec.model_dump() == {
        "model": "minimax-h3", "prompt": "a lighthouse at dusk", "seconds": 5.0, "width": 1344, "height": 768,
        "num_inference_steps": 50, "seed": 3, "flow_shift": 12.0, "audio_flow_shift": 3.0, "quality": "lossless",
        "task": "t2va", "size_given": True, "lora": None,
    }


def test_a_missing_seed_is_drawn():
    assert resolve_spec(request(), RELEASED_LIMITS, seed=11).seed == 11
    drawn = {resolve_spec(request(), RELEASED_LIMITS).seed for _ in range(8)}
    assert len(drawn) == 8 and all(0 <= s < 2**63 for s in drawn)


@pytest.mark.parametrize(
    ("fields", "size"),
    [
        ({"size": "768x1344"}, (768, 1344)),
        ({"aspect_ratio": "16:9"}, (1344, 768)),  # 768 * 16/9 = 1365.3 -> 1344 (32-px multiple)
        ({"aspect_ratio": "9:16"}, (768, 1344)),
        ({"aspect_ratio": "1:1"}, (768, 768)),
        ({"aspect_ratio": "4:3"}, (1024, 768)),
    ],
)
def test_sizes_from_size_or_aspect_ratio(fields, size):
    spec = resolve_spec(request(**fields), RELEASED_LIMITS)
    assert (spec.width, spec.height) == size


def test_a_model_without_a_fixed_short_edge_takes_the_requested_one():
    any_short_edge = model_limits(EngineConfig(), 64)  # the quick-start tiny checkpoint: any 32-px multiple
    spec = resolve_spec(request(aspect_ratio="16:9", short_edge=384), any_short_edge)
    assert (spec.width, spec.height) == (672, 384)  # 682.7 -> 672
    assert resolve_spec(request(), any_short_edge).size == "1344x768"  # the same default as H3


def test_seconds_as_a_numeric_string_like_openai_clients_send():
    assert resolve_spec(request(seconds="8"), RELEASED_LIMITS).seconds == 8.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"seconds": 4}, "seconds: 4 snaps to 107 frames = 4.45833 s at 24 fps; the model's clips last "
                         "min_seconds=5 to max_seconds=15"),
        # 15 s is 361 frames, snapped up to 362 = 15.08 s: over the bound, as the engine itself refuses it.
        ({"seconds": 15}, "seconds: 15 snaps to 362 frames = 15.0833 s at 24 fps; the model's clips last "
                          "min_seconds=5 to max_seconds=15"),
        ({"size": "1000x768"}, "size: 1000x768: 1000 is not a multiple of the model's size_multiple=32"),
        ({"size": "1344x1344"}, "size: 1344x1344: the short edge 1344 is not the model's short_edge=768"),
        ({"size": "1376x768"}, "size: 1376x768: 1376 exceeds the model's max_edge=1344"),
        ({"size": "704x768"}, "size: 704x768: 704 is below the model's min_edge=768"),
        ({"aspect_ratio": "21:9"}, "aspect_ratio: 1792x768: 1792 exceeds the model's max_edge=1344"),
        ({"aspect_ratio": "0:9"}, "aspect_ratio: '0:9': both sides must be positive"),
        ({"aspect_ratio": "16:9", "short_edge": 700},
         "short_edge: 700 is not a multiple of the model's size_multiple=32"),
        ({"num_inference_steps": 1}, "num_inference_steps: 1 is below the model's min_steps=2"),
        ({"num_inference_steps": 66}, "num_inference_steps: 66 exceeds the model's max_steps=65"),
        ({"flow_shift": 101.0}, "flow_shift: 101 exceeds the model's max_flow_shift=100"),
        ({"audio_flow_shift": 1000.0}, "audio_flow_shift: 1000 exceeds the model's max_flow_shift=100"),
        ({"prompt": "x" * 20001}, "prompt: 20001 characters exceed the model's max_prompt_chars=20000"),
        ({"prompt": "  \n "}, "prompt: must not be blank"),
    ],
)
def test_out_of_limits_requests_name_field_value_and_limit(fields, message):
    with pytest.raises(InvalidVideoRequest) as refused:
        resolve_spec(request(**fields), RELEASED_LIMITS)
    assert str(refused.value) == message
    assert refused.value.field == message.split(":")[0]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"size": "1344x768", "aspect_ratio": "16:9"}, "give size or aspect_ratio (+ short_edge), not both"),
        ({"short_edge": 768}, "short_edge needs aspect_ratio"),
        ({"size": "1344*768"}, "String should match pattern"),
        ({"seconds": "eight"}, "seconds='eight' is not a number"),
        ({"seconds": float("nan")}, "Input should be a finite number"),
        ({"quality": "ultra"}, "Input should be 'lossless', 'high' or 'fp8'"),
        ({"num_inference_steps": "50"}, "Input should be a valid integer"),  # JSON is strictly typed
        ({"negative_prompt": "x"}, "Extra inputs are not permitted"),
    ],
)
def test_schema_refusals(fields, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        request(**fields)


def test_a_tiny_model_allows_what_h3_refuses():
    tiny = ModelLimits(
        name="tiny", min_seconds=0.5, max_seconds=2, default_seconds=1, size_multiple=16, min_edge=32, max_edge=128,
        max_pixels=128 * 64, default_size="64x32", default_short_edge=32, max_steps=8, default_steps=4,
    )
    spec = resolve_spec(request(seconds=0.5, aspect_ratio="2:1"), tiny)
    assert (spec.model, spec.seconds, spec.width, spec.height, spec.num_inference_steps) == ("tiny", 0.5, 64, 32, 4)


def test_limits_with_defaults_outside_their_bounds_are_refused():
    with pytest.raises(ValidationError, match="default_seconds=20 snaps to 20.0417 s, outside 5..15"):
        RELEASED_LIMITS.model_validate({**RELEASED_LIMITS.model_dump(), "default_seconds": 20})
    with pytest.raises(ValidationError, match="default_size: 100x100: 100 is not a multiple"):
        RELEASED_LIMITS.model_validate({**RELEASED_LIMITS.model_dump(), "default_size": "100x100"})
