"""End to end over HTTP and through a handle, with the real engine on a tiny checkpoint (CPU).

The app is built from serve_config.yaml's own args (checkpoint made on first start under a temp dir).
Every bad request must come back 4xx with a message, and leave a healthy replica that still serves.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from deployments.schemas import GenerationResponse, decode_latents
from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from tests.serve_helpers import APP_NAME, run_app, serve_cluster, serve_config_args

pytestmark = pytest.mark.timeout(300)

MAX_BODY_BYTES = 8192
VALID = {"prompt": "a lighthouse at dusk", "steps": 2, "frames": 2, "height": 8, "width": 8, "audio_len": 4, "seed": 5}


@pytest.fixture(scope="module")
def app_args(tmp_path_factory):
    args = serve_config_args(tmp_path_factory.mktemp("checkpoints"))
    args["http"]["max_body_bytes"] = MAX_BODY_BYTES
    return args


@pytest.fixture(scope="module")
def base_url(app_args):
    with serve_cluster() as url:
        run_app(url, app_args)
        yield url


def post(base_url, body=None, *, data=None, headers=None):
    return requests.post(f"{base_url}/v1/generations", json=body, data=data, headers=headers, timeout=120)


def still_serving(base_url) -> None:
    assert requests.get(f"{base_url}/healthz", timeout=30).status_code == 200
    r = post(base_url, {**VALID, "steps": 1, "return_latents": False})
    assert r.status_code == 200, r.text


def raw(text: str) -> dict:
    return {"data": text.encode(), "headers": {"content-type": "application/json"}}


# (id, how to send it, expected status, a piece of the message)
BAD_REQUESTS = [
    ("steps-as-string", {"json": {**VALID, "steps": "8"}}, 422, "steps: Input should be a valid integer"),
    ("steps-as-float", {"json": {**VALID, "steps": 2.5}}, 422, "steps: Input should be a valid integer"),
    ("missing-prompt", {"json": {"steps": 2}}, 422, "prompt: Field required"),
    ("unknown-field", {"json": {**VALID, "negative": "x"}}, 422, "negative: Extra inputs are not permitted"),
    ("steps-zero", {"json": {**VALID, "steps": 0}}, 422, "steps: Input should be greater than or equal to 1"),
    ("steps-too-many", {"json": {**VALID, "steps": 66}}, 422, "steps: Input should be less than or equal to 65"),
    ("guidance-below-one", {"json": {**VALID, "guidance_scale": 0.5}}, 422, "guidance_scale: Input should be greater"),
    ("shift-nan", raw('{"prompt": "x", "shift": NaN}'), 422, "shift: Input should be a finite number"),
    ("audio-shift-inf", raw('{"prompt": "x", "audio_shift": Infinity}'), 422, "audio_shift: Input should be a finite"),
    ("shift-negative", {"json": {**VALID, "shift": -1.0}}, 422, "shift: Input should be greater than 0"),
    ("seed-negative", {"json": {**VALID, "seed": -1}}, 422, "seed: Input should be greater than or equal to 0"),
    ("seed-too-big", {"json": {**VALID, "seed": 2**63}}, 422, "seed: Input should be less than or equal to"),
    ("seed-as-string", {"json": {**VALID, "seed": "abc"}}, 422, "seed: Input should be a valid integer"),
    ("prompt-over-model-limit", {"json": {**VALID, "prompt": "a" * 129}}, 422,
     "prompt: 129 UTF-8 bytes exceeds the model's max_text_tokens=128"),
    ("prompt-over-schema-limit", {"json": {**VALID, "prompt": "a" * 4097}}, 422, "prompt: String should have at most 4096"),
    ("frames-too-many", {"json": {**VALID, "frames": 9}}, 422, "frames: 9 exceeds the model's max_frames=8"),
    ("frames-zero", {"json": {**VALID, "frames": 0}}, 422, "frames: Input should be greater than or equal to 1"),
    ("height-too-large", {"json": {**VALID, "height": 64}}, 422, "height: 64 exceeds the model's max_height=32"),
    ("width-too-large", {"json": {**VALID, "width": 34}}, 422, "width: 34 exceeds the model's max_width=32"),
    ("height-not-multiple-of-patch", {"json": {**VALID, "height": 7}}, 422,
     "height: 7 is not a multiple of the model's patch size 2"),
    ("audio-too-long", {"json": {**VALID, "audio_len": 65}}, 422, "audio_len: 65 exceeds the model's max_audio_len=64"),
    ("latents-flag-as-string", {"json": {**VALID, "return_latents": "yes"}}, 422, "return_latents: Input should be a valid boolean"),
    ("cache-dit-unknown-knob", {"json": {**VALID, "cache_dit": {"bogus": 1}}}, 422, "cache_dit.bogus: Extra inputs"),
    ("body-not-an-object", {"json": [VALID]}, 422, "body must be a JSON object, got list"),
    ("malformed-json", raw('{"prompt": "x", '), 400, "body is not valid JSON"),
    ("empty-body", raw(""), 400, "body is not valid JSON"),
    ("body-over-limit", {"json": {**VALID, "prompt": "a" * (MAX_BODY_BYTES + 10)}}, 413,
     f"exceeds http.max_body_bytes={MAX_BODY_BYTES}"),
]


@pytest.mark.parametrize("how, status, message", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_a_4xx_with_a_message_and_the_replica_keeps_serving(base_url, how, status, message):
    r = requests.post(f"{base_url}/v1/generations", timeout=120, **how)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]
    still_serving(base_url)


def test_http_and_handle_give_the_same_latents_as_the_engine_itself(base_url, app_args):
    from ray import serve

    r = post(base_url, VALID)
    assert r.status_code == 200, r.text
    by_http = GenerationResponse.model_validate(r.json())
    by_handle = serve.get_app_handle(APP_NAME).generate.remote(VALID).result(timeout_s=120)
    assert by_http.latents == by_handle.latents and by_http.model == by_handle.model
    latents = decode_latents(by_http.latents)
    assert latents["video"].shape == (4, 2, 8, 8) and latents["audio"].shape == (4, 8)

    # The same checkpoint in this process (the replica made it on first start) gives the same bits.
    engine = Engine(EngineConfig.model_validate({**app_args["engine"], "device": "cpu"}))
    local = engine.generate(GenerationRequest(**VALID))
    assert torch.equal(latents["video"], local.video) and torch.equal(latents["audio"], local.audio)
    assert by_http.model == local.model and by_http.stats["adaln"]["requests"] == 1


def test_models_lists_the_loaded_checkpoint(base_url):
    body = requests.get(f"{base_url}/v1/models", timeout=30).json()
    (card,) = body["data"]
    assert card["id"].startswith("tiny@") and card["device"] == "cpu"
    assert card["limits"]["max_frames"] == 8 and card["engine_config"]["adaln"]["mode"] == "online"


def test_concurrent_requests_all_succeed_with_their_own_seed(base_url):
    bodies = [{**VALID, "seed": seed} for seed in (1, 2, 1)]
    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(lambda b: post(base_url, b), bodies))
    assert [r.status_code for r in responses] == [200, 200, 200]
    latents = [r.json()["latents"] for r in responses]
    assert latents[0] == latents[2] != latents[1]


def test_raw_json_numbers_accept_integral_floats_fields(base_url):
    r = post(base_url, data=json.dumps({**VALID, "shift": 3, "guidance_scale": 2}).encode(),
             headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["stats"]["model_calls"] == 2 * VALID["steps"]
