"""The Serve layer (builder, ingress, worker shim) with a fake engine: routing, status codes, handle API."""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path

import pytest
import requests
import torch
from PIL import Image

from deployments.schemas import AppConfig, GenerationResponse, decode_latents
from engine.startup import ReplicaStartup
from tests.fake_engine import FAKE_MODEL, FAKE_MP4, FakeEngine
from tests.serve_helpers import APP_NAME, serve_cluster, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.ray]  # slow: Ray + Serve: the app on a fake engine

MAX_BODY_BYTES = 8192


@pytest.fixture(scope="module")
def base_url():
    from ray import serve

    from deployments.app import build_application

    with serve_cluster() as url:
        # 8 KiB bodies: room for a number past int()'s 4300 digits (HOSTILE_BODIES), still small enough to hit.
        http = {"max_body_bytes": MAX_BODY_BYTES, "request_timeout_s": 1.0}
        app = build_application(AppConfig.model_validate({"stages": "fused", "http": http}), FakeEngine)
        serve.run(app, name=APP_NAME, route_prefix="/")
        wait_healthy(url)
        yield url


def post(base_url, body, **kw):
    return requests.post(f"{base_url}/v1/generations", json=body, timeout=60, **kw)


def test_generation_returns_the_mp4_decodable_latents_and_the_first_frame_as_png(base_url):
    body = {"prompt": "a cat", "seed": 7, "seconds": 5.0, "width": 96, "height": 64, "return_latents": True}
    r = post(base_url, body)
    assert r.status_code == 200, r.text
    response = GenerationResponse.model_validate(r.json())
    assert response.id.startswith("gen-")
    assert response.model == FAKE_MODEL and response.seed == 7
    # 5 s -> 124 frames -> 37 latent frames; 96x64 px -> 6x4 latents; 2 x 207 audio rows of 32 channels
    assert response.video_shape == [24, 37, 4, 6] and response.audio_shape == [414, 32]
    assert base64.b64decode(response.video_mp4) == FAKE_MP4 + b"7"
    latents = decode_latents(response.latents)
    generator = torch.Generator().manual_seed(7)
    assert torch.equal(latents["video"], torch.randn(24, 37, 4, 6, generator=generator))
    assert torch.equal(latents["audio"], torch.randn(414, 32, generator=generator))
    png = Image.open(io.BytesIO(base64.b64decode(response.preview_png)))
    assert png.format == "PNG" and png.size == (96, 64) and png.getpixel((0, 0)) == (7, 7, 7)  # the thumbnail


def test_latents_are_left_out_by_default_and_without_video_the_preview_is_the_latent_frame(base_url):
    r = post(base_url, {"prompt": "x", "seed": 1, "width": 96, "height": 64, "return_video": False})
    assert r.status_code == 200, r.text
    assert r.json()["latents"] is None and r.json()["video_mp4"] is None
    png = Image.open(io.BytesIO(base64.b64decode(r.json()["preview_png"])))
    assert png.size == (6 * 21, 4 * 21)  # latent channels 0-2 of frame 0, 4x6, nearest-upscaled x(128 // 6)


def test_schema_error_is_422_naming_the_field(base_url):
    r = post(base_url, {"prompt": "x", "steps": 1})
    assert r.status_code == 422
    error = r.json()["error"]
    assert error["type"] == "invalid_request" and "steps: Input should be greater than or equal to 2" in error["message"]
    assert error["errors"][0]["loc"] == ["steps"]


def test_engine_client_error_is_422_with_its_message(base_url):
    r = post(base_url, {"prompt": "x", "width": 65})
    assert r.status_code == 422
    assert r.json()["error"]["message"] == "width: 65 is out of range: must be a multiple of 32 px"
    r = post(base_url, {"prompt": "x", "guidance_scale": 2})
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("guidance_scale: 2.0 is not served")


@pytest.mark.parametrize(("stream", "status"), [("false", 200), ("0", 200), ("on", 422), ("ture", 422)])
def test_the_stream_query_flag_is_true_or_false(base_url, stream, status):
    body = {"prompt": "x", "width": 96, "height": 64, "return_video": False}
    r = requests.post(f"{base_url}/v1/generations", params={"stream": stream}, json=body, timeout=60)
    assert (r.status_code, r.headers["content-type"]) == (status, "application/json"), r.text
    if status == 422:
        assert r.json()["error"]["message"] == f"stream: {stream!r} is not true or false"


def test_a_method_a_route_does_not_take_is_405_in_the_error_shape_through_serve(base_url):
    r = requests.get(f"{base_url}/v1/generations", timeout=30)
    assert (r.status_code, r.headers["allow"]) == (405, "POST")
    assert r.json()["error"]["type"] == "method_not_allowed"


def test_body_over_limit_is_413(base_url):
    r = requests.post(f"{base_url}/v1/generations", data=b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 10) + b'"}',
                      timeout=30)
    assert r.status_code == 413
    assert f"max_body_bytes={MAX_BODY_BYTES}" in r.json()["error"]["message"]


def test_malformed_json_is_400(base_url):
    r = requests.post(f"{base_url}/v1/generations", data=b'{"prompt": ', timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_json"


HOSTILE = {"prompt": "a cat", "seed": 3, "width": 96, "height": 64, "return_video": False}

# (id, body bytes, expected status, error type, a piece of the message): what a careless or hostile client sends
HOSTILE_BODIES = [
    ("int-past-4300-digits", b'{"prompt": "x", "steps": ' + b"9" * 5000 + b"}", 400, "invalid_json",
     "body is not valid JSON: a number has too many digits"),
    ("nested-int-past-4300-digits", b'{"prompt": "x", "cache_dit": {"Fn_compute_blocks": ' + b"1" * 4400 + b"}}",
     400, "invalid_json", "a number has too many digits"),
    ("duplicate-key", b'{"prompt": "a cat", "prompt": "a dog"}', 422, "invalid_request", "prompt: given more than once"),
    ("duplicate-nested-key", b'{"prompt": "x", "cache_dit": {"enabled": false, "enabled": true}}', 422,
     "invalid_request", "enabled: given more than once"),
    ("prompt-blank", b'{"prompt": "   "}', 422, "invalid_request", "prompt: Value error, must not be blank"),
    ("prompt-whitespace-escapes", b'{"prompt": "\\n\\t\\u3000"}', 422, "invalid_request", "must not be blank"),
    ("cache-dit-threshold-infinity", b'{"prompt": "x", "cache_dit": {"residual_diff_threshold": Infinity}}', 422,
     "invalid_request", "cache_dit.residual_diff_threshold: Input should be a finite number"),
]


@pytest.mark.parametrize(("body", "status", "kind", "message"), [c[1:] for c in HOSTILE_BODIES],
                         ids=[c[0] for c in HOSTILE_BODIES])
@pytest.mark.parametrize("path", ["/v1/generations", "/v1/generations:stream"])
def test_hostile_bodies_are_4xx_with_a_message_and_the_replica_keeps_serving(base_url, path, body, status, kind,
                                                                             message):
    r = requests.post(f"{base_url}{path}", data=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == kind and message in error["message"], error
    assert "Traceback" not in r.text and "/site-packages/" not in r.text
    assert requests.get(f"{base_url}/healthz", timeout=30).status_code == 200
    assert post(base_url, HOSTILE).status_code == 200


def test_models_healthz_and_docs(base_url):
    models = requests.get(f"{base_url}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == FAKE_MODEL
    health = requests.get(f"{base_url}/healthz", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert requests.get(f"{base_url}/docs", timeout=30).status_code == 200
    schema = requests.get(f"{base_url}/openapi.json", timeout=30).json()
    body_schema = schema["paths"]["/v1/generations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "prompt" in body_schema["properties"] and body_schema["properties"]["steps"]["description"]


def test_worker_describe_reports_its_replica_and_start_up(base_url):
    card = requests.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]
    startup = card["startup"]
    assert card["replica"] and startup["role"] == "worker" and startup["engine"] is None  # a fake measures nothing
    timeline = ReplicaStartup.from_dict(startup).timeline()
    assert list(timeline) == sorted(timeline)  # import, imported, constructor, build start, build end, ready
    assert startup["imports_s"] == 0.0  # a fake factory imports no model stack


def test_handle_generate_matches_http(base_url):
    from ray import serve

    handle = serve.get_app_handle(APP_NAME)
    request = {"prompt": "same", "seed": 3, "width": 32, "height": 32, "return_latents": True}
    by_handle = handle.generate.remote(request).result(timeout_s=60)
    by_http = GenerationResponse.model_validate(post(base_url, request).json())
    assert isinstance(by_handle, GenerationResponse)
    assert by_handle.latents == by_http.latents and by_handle.video_mp4 == by_http.video_mp4


def test_handle_generate_raises_value_error_on_bad_input(base_url):
    from ray import serve

    handle = serve.get_app_handle(APP_NAME)
    with pytest.raises(ValueError, match="steps"):
        handle.generate.remote({"prompt": "x", "steps": 100}).result(timeout_s=60)
    with pytest.raises(ValueError, match="height: 48 is out of range: must be a multiple of 32 px"):
        handle.generate.remote({"prompt": "x", "height": 48}).result(timeout_s=60)


def wait_for_cancellations(base_url, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if requests.get(f"{base_url}/healthz", timeout=30).json()["worker"]["cancelled"] >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"the engine saw fewer than {count} cancellations")


def test_timeout_is_504_and_stops_the_engine_between_steps(base_url):
    from ray import serve

    r = post(base_url, {"prompt": "slow", "steps": 60})  # 59 forwards of 0.1 s, request_timeout_s=1
    assert r.status_code == 504 and "request_timeout_s=1.0" in r.json()["error"]["message"]
    wait_for_cancellations(base_url, 1)
    worker = serve.get_deployment_handle("Worker", APP_NAME)
    last = worker.debug_stats.remote().result(timeout_s=30)["last_request"]
    assert last["outcome"] == "cancelled" and last["step"] < last["steps"]  # cut between steps, not run out
    assert post(base_url, {"prompt": "x"}).status_code == 200


def test_client_disconnect_cancels_the_generation(base_url):
    before = requests.get(f"{base_url}/healthz", timeout=30).json()["worker"]["cancelled"]
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{base_url}/v1/generations", json={"prompt": "slow", "steps": 8}, timeout=0.4)
    wait_for_cancellations(base_url, before + 1)


def replica_logs() -> list[Path]:
    """This cluster's replica log files of the app (Serve writes them under the session dir)."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return sorted(logs.glob(f"replica_{APP_NAME}_*.log"))


def replica_log_lines(deployment: str, needle: str, since: dict[Path, int]) -> list[str]:
    """Lines with `needle` that `deployment`'s replicas logged after `since` (file sizes then): the session's
    cluster is shared, so earlier modules' replicas of the same app name wrote to the same directory."""
    lines = []
    for path in replica_logs():
        if path.name.startswith(f"replica_{APP_NAME}_{deployment}_"):
            with path.open("rb") as log:
                log.seek(since.get(path, 0))
                lines += [line for line in log.read().decode(errors="replace").splitlines() if needle in line]
    return lines


def test_a_client_error_through_the_handle_is_one_info_line_not_an_error_traceback(base_url):
    from ray import serve

    marker = f"marker-{time.monotonic_ns()}"
    since = {path: path.stat().st_size for path in replica_logs()}
    with pytest.raises(ValueError, match="steps: Input should be a valid integer"):
        serve.get_app_handle(APP_NAME).generate.remote({"prompt": marker, "steps": "8"}).result(timeout_s=60)
    with pytest.raises(ValueError, match="between 5 and 15 s"):  # refused by the engine, on the worker replica
        serve.get_app_handle(APP_NAME).generate.remote({"prompt": marker, "seconds": 16.0}).result(timeout_s=60)
    deadline = time.monotonic() + 30
    while len(replica_log_lines("Ingress", "request refused (client error)", since)) < 2:  # logs are flushed async
        assert time.monotonic() < deadline, "the ingress never logged the refusals"
        time.sleep(0.2)
    refused = replica_log_lines("Ingress", "request refused (client error)", since)
    assert any("steps: Input should be a valid integer" in line for line in refused)
    assert all(line.startswith("INFO") for line in refused)
    for deployment in ("Ingress", "Worker"):
        assert replica_log_lines(deployment, "Request failed", since) == []  # Serve's ERROR line, demoted
        assert replica_log_lines(deployment, "Traceback", since) == []
