"""End to end over HTTP and through a handle, with the real engine on the tiny MiniMax-H3 checkpoint (CPU).

The app is built from serve_config.yaml's own args, fused (the checkpoint is made on first start under a temp
dir; a smaller prompt-token limit and a larger body limit, so both can be hit). Every bad request must come back
4xx with a message naming the field and the limit, and leave a healthy replica that still serves.
"""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import av
import numpy as np
import pytest
import requests
import torch
from PIL import Image

from deployments.schemas import GenerationResponse, decode_latents
from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from engine.limits import ModelLimits
from tests.serve_helpers import APP_NAME, run_app, serve_cluster, serve_config_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.ray]  # slow: Ray + Serve: the app over HTTP

MAX_BODY_BYTES = 32 * 1024  # above the schema's 20000-character prompt, so both limits can be hit
MAX_PROMPT_TOKENS = 64
#: 64x64 px for 5 s: 124 frames -> video latents [24, 37, 4, 4], audio rows [414, 32]; 2 forwards.
VALID = {"prompt": "a lighthouse at dusk", "steps": 3, "seconds": 5.0, "width": 64, "height": 64, "seed": 5,
         "return_video": False, "return_latents": True}
VIDEO_LATENTS, AUDIO_ROWS = [24, 37, 4, 4], [414, 32]


@pytest.fixture(scope="module")
def app_args(tmp_path_factory):
    args = serve_config_args(tmp_path_factory.mktemp("checkpoints"))
    args["stages"] = "fused"  # one Worker: the edge is the subject (split as shipped: test_reliability_http)
    args["http"]["max_body_bytes"] = MAX_BODY_BYTES
    args["engine"]["text_encoder"]["max_prompt_tokens"] = MAX_PROMPT_TOKENS
    return args


@pytest.fixture(scope="module")
def base_url(app_args):
    with serve_cluster() as url:
        run_app(url, app_args)
        yield url


@pytest.fixture(scope="module")
def local_engine(base_url, app_args) -> Engine:
    """The same engine config in this process (the replica made the checkpoint on first start)."""
    return Engine(EngineConfig.model_validate({**app_args["engine"], "device": "cpu"}))


def post(base_url, body=None, *, data=None, headers=None):
    return requests.post(f"{base_url}/v1/generations", json=body, data=data, headers=headers, timeout=120)


def still_serving(base_url) -> None:
    assert requests.get(f"{base_url}/healthz", timeout=30).status_code == 200
    r = post(base_url, {**VALID, "steps": 2, "return_latents": False})
    assert r.status_code == 200, r.text


def raw(text: str) -> dict:
    return {"data": text.encode(), "headers": {"content-type": "application/json"}}


# (id, how to send it, expected status, a piece of the message)
BAD_REQUESTS = [
    # the schema (the ingress)
    ("steps-as-string", {"json": {**VALID, "steps": "8"}}, 422, "steps: Input should be a valid integer"),
    ("steps-as-float", {"json": {**VALID, "steps": 2.5}}, 422, "steps: Input should be a valid integer"),
    ("missing-prompt", {"json": {"steps": 2}}, 422, "prompt: Field required"),
    ("unknown-field", {"json": {**VALID, "negative": "x"}}, 422, "negative: Extra inputs are not permitted"),
    ("old-latent-unit-field", {"json": {**VALID, "frames": 2}}, 422, "frames: Extra inputs are not permitted"),
    ("steps-one", {"json": {**VALID, "steps": 1}}, 422, "steps: Input should be greater than or equal to 2"),
    ("steps-too-many", {"json": {**VALID, "steps": 66}}, 422, "steps: Input should be less than or equal to 65"),
    ("flow-shift-nan", raw('{"prompt": "x", "flow_shift": NaN}'), 422, "flow_shift: Input should be a finite number"),
    ("audio-flow-shift-inf", raw('{"prompt": "x", "audio_flow_shift": Infinity}'), 422,
     "audio_flow_shift: Input should be a finite number"),
    ("flow-shift-negative", {"json": {**VALID, "flow_shift": -1.0}}, 422, "flow_shift: Input should be greater than 0"),
    ("seed-negative", {"json": {**VALID, "seed": -1}}, 422, "seed: Input should be greater than or equal to 0"),
    ("seed-too-big", {"json": {**VALID, "seed": 2**63}}, 422, "seed: Input should be less than or equal to"),
    ("seed-as-string", {"json": {**VALID, "seed": "abc"}}, 422, "seed: Input should be a valid integer"),
    ("seconds-zero", {"json": {**VALID, "seconds": 0}}, 422, "seconds: Input should be greater than 0"),
    ("seconds-over-schema", {"json": {**VALID, "seconds": 61}}, 422, "seconds: Input should be less than or equal to 60"),
    ("width-below-32", {"json": {**VALID, "width": 16}}, 422, "width: Input should be greater than or equal to 32"),
    ("prompt-over-schema-limit", {"json": {**VALID, "prompt": "a" * 20001}}, 422,
     "prompt: String should have at most 20000 characters"),
    ("latents-flag-as-string", {"json": {**VALID, "return_latents": "yes"}}, 422,
     "return_latents: Input should be a valid boolean"),
    ("video-flag-as-number", {"json": {**VALID, "return_video": 1}}, 422, "return_video: Input should be a valid boolean"),
    ("cache-dit-unknown-knob", {"json": {**VALID, "cache_dit": {"bogus": 1}}}, 422, "cache_dit.bogus: Extra inputs"),
    ("body-not-an-object", {"json": [VALID]}, 422, "body must be a JSON object, got list"),
    ("malformed-json", raw('{"prompt": "x", '), 400, "body is not valid JSON"),
    ("empty-body", raw(""), 400, "body is not valid JSON"),
    ("body-over-limit", {"json": {**VALID, "prompt": "a" * (MAX_BODY_BYTES + 10)}}, 413,
     f"exceeds http.max_body_bytes={MAX_BODY_BYTES}"),
    # the loaded model and the server's limits (the engine, on the worker replica)
    ("guidance-two", {"json": {**VALID, "guidance_scale": 2}}, 422,
     "guidance_scale: 2.0 is not served: MiniMax-H3 is CFG-distilled, guidance is fixed at 1"),
    ("guidance-below-one", {"json": {**VALID, "guidance_scale": 0.5}}, 422, "guidance_scale: 0.5 is not served"),
    ("seconds-too-short", {"json": {**VALID, "seconds": 4.0}}, 422,
     "snaps to 107 frames = 4.45833 s at 24 fps; must be between 5 and 15 s"),
    ("seconds-too-long", {"json": {**VALID, "seconds": 16.0}}, 422,
     "snaps to 396 frames = 16.5 s at 24 fps; must be between 5 and 15 s"),
    ("width-not-a-multiple-of-32", {"json": {**VALID, "width": 65}}, 422,
     "width: 65 is out of range: must be a multiple of 32 px"),
    ("height-not-a-multiple-of-32", {"json": {**VALID, "height": 48}}, 422,
     "height: 48 is out of range: must be a multiple of 32 px"),
    ("too-many-pixels", {"json": {**VALID, "width": 2048, "height": 1024}}, 422,
     "width: 2048x1024 = 2097152 px is out of range: must be <= 1032192 px"),
    ("prompt-over-token-limit", {"json": {**VALID, "prompt": "a lighthouse at dusk " * 5}}, 422,
     f"prompt: 71 tokens exceeds this server's max_prompt_tokens={MAX_PROMPT_TOKENS}"),
    ("cache-dit-off-on-the-server", {"json": {**VALID, "cache_dit": {"enabled": True}}}, 422,
     "cache_dit: Cache-DiT is off on this server"),
]


@pytest.mark.parametrize("how, status, message", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_a_4xx_with_a_message_and_the_replica_keeps_serving(base_url, how, status, message):
    r = requests.post(f"{base_url}/v1/generations", timeout=120, **how)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    still_serving(base_url)


def test_a_generation_is_a_playable_mp4_of_the_requested_size_and_duration(base_url, local_engine):
    r = post(base_url, {**VALID, "return_video": True, "return_latents": False})
    assert r.status_code == 200, r.text
    response = GenerationResponse.model_validate(r.json())
    assert response.latents is None and response.timings.decode_s > 0 and response.timings.mux_s > 0
    with av.open(io.BytesIO(base64.b64decode(response.video_mp4))) as container:
        (video,) = container.streams.video
        (sound,) = container.streams.audio
        assert (video.codec_context.name, video.width, video.height, video.average_rate) == ("h264", 64, 64, 24)
        assert (sound.codec_context.name, sound.channels, sound.sample_rate) == ("aac", 2, 32000)
        assert abs(float(video.duration * video.time_base) - 124 / 24) <= 1 / 24
        assert sum(1 for _ in container.decode(video=0)) == 124
    # The preview is the first decoded frame, as the engine in this process decodes it.
    local = local_engine.generate(GenerationRequest(**{**VALID, "return_video": True}))
    preview = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.preview_png))))
    assert preview.shape == (64, 64, 3) and base64.b64decode(response.preview_png) == local.thumbnail_png


def test_http_and_handle_give_the_same_latents_as_the_engine_itself(base_url, local_engine):
    from ray import serve

    r = post(base_url, VALID)
    assert r.status_code == 200, r.text
    by_http = GenerationResponse.model_validate(r.json())
    by_handle = serve.get_app_handle(APP_NAME).generate.remote(VALID).result(timeout_s=120)
    assert by_http.latents == by_handle.latents and by_http.model == by_handle.model
    assert by_http.video_mp4 is None and by_http.video_shape == VIDEO_LATENTS and by_http.audio_shape == AUDIO_ROWS
    latents = decode_latents(by_http.latents)
    assert list(latents["video"].shape) == VIDEO_LATENTS and list(latents["audio"].shape) == AUDIO_ROWS

    # The same checkpoint in this process (the replica made it on first start) gives the same bits.
    local = local_engine.generate(GenerationRequest(**VALID))
    assert torch.equal(latents["video"], local.video) and torch.equal(latents["audio"], local.audio)
    assert by_http.model == local.model and by_http.stats["adaln"]["requests"] == 1


def test_latents_are_left_out_unless_asked_for(base_url):
    body = {key: value for key, value in VALID.items() if key != "return_latents"}
    response = post(base_url, body).json()
    assert response["latents"] is None and response["video_shape"] == VIDEO_LATENTS


def test_a_bare_prompt_gets_the_tiny_checkpoints_canvas(base_url):
    # width/height null: the checkpoint's default canvas (its model index: 64x32 for the tiny model), not 1344x768.
    response = post(base_url, {"prompt": "a lighthouse at dusk", "steps": 3, "seed": 5, "return_video": False})
    assert response.status_code == 200, response.text
    assert response.json()["video_shape"] == [24, 37, 2, 4]


def test_models_lists_the_loaded_checkpoint(base_url, local_engine):
    body = requests.get(f"{base_url}/v1/models", timeout=30).json()
    (card,) = body["data"]
    assert card["id"] == local_engine.model_name and card["id"].startswith("minimax-h3@") and card["device"] == "cpu"
    # The engine's own ModelLimits, what both APIs check requests against (fl2va too: the Worker holds the
    # vision tower and the VAEs' encoders).
    assert ModelLimits.model_validate(card["limits"]) == local_engine.limits
    assert card["tasks"] == ["t2va", "fl2va"] and local_engine.limits.tasks == ("t2va", "fl2va")
    assert {k: card["limits"][k] for k in ("max_steps", "short_edge", "max_pixels", "min_seconds", "max_seconds",
                                           "size_multiple", "fps", "max_prompt_tokens", "default_size")} == {
        "max_steps": 65, "short_edge": None, "max_pixels": 768 * 1344, "min_seconds": 5.0, "max_seconds": 15.0,
        "size_multiple": 32, "fps": 24, "max_prompt_tokens": MAX_PROMPT_TOKENS, "default_size": "64x32"}
    assert card["layout"] == "diffusers" and card["engine_config"]["adaln"]["mode"] == "online"


def test_concurrent_requests_all_succeed_with_their_own_seed(base_url):
    bodies = [{**VALID, "seed": seed} for seed in (1, 2, 1)]
    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(lambda b: post(base_url, b), bodies))
    assert [r.status_code for r in responses] == [200, 200, 200]
    latents = [r.json()["latents"] for r in responses]
    assert latents[0] == latents[2] != latents[1]


def test_raw_json_integers_are_accepted_for_float_fields(base_url):
    r = post(base_url, data=json.dumps({**VALID, "seconds": 5, "flow_shift": 12, "guidance_scale": 1}).encode(),
             headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["stats"]["forwards"] == VALID["steps"] - 1
    assert r.json()["latents"] == post(base_url, VALID).json()["latents"]  # 12 is the default flow_shift
