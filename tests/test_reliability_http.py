"""Reliability over HTTP and through the handle, with the real engine on a tiny checkpoint (CPU), one cluster.

The app runs serve_config.yaml's args with a deliberately small AdaLN plan slab (`adaln.gpu_plans: 4`,
`adaln.plan_width: 1`, so only video-only requests of <= 4 steps fit) and Cache-DiT on, so the limits that
come from the server's configuration can be hit from the outside. Complements tests/test_http.py (whose
27 bad requests run there against the stock config; they are replayed here through the handle):

- more bad requests (config-dependent limits, cache-dit settings, hostile bodies) -> 4xx naming the field or
  setting, the replica keeps serving, and afterwards the bits equal an engine built in this process;
- the handle path: bad dicts raise ValueError with the same message;
- concurrent requests with distinct schedules overflowing the small slab all come back exact;
- a worker replica killed mid-request: the client gets a clear 5xx, the replica comes back and serves.
"""

from __future__ import annotations

import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from deployments.schemas import GenerationResponse, decode_latents
from engine.api import GenerationRequest
from engine.config import EngineConfig
from engine.engine import Engine
from model.checkpoint import make_checkpoint, shard_name, shard_of
from tests.serve_helpers import APP_NAME, run_app, serve_cluster, serve_config_args, wait_healthy
from tests.test_http import BAD_REQUESTS, MAX_BODY_BYTES, VALID, post, raw

pytestmark = pytest.mark.timeout(300)

GPU_PLANS = 4
#: plan_width 1 admits video-only requests only (audio adds a second distinct timestep per step).
VIDEO = {**VALID, "audio_len": 0}
ADMIN_TOKEN = "test-admin-token-6f1d"
AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def app_args(tmp_path_factory):
    args = serve_config_args(tmp_path_factory.mktemp("checkpoints"))
    engine = args["engine"]
    engine["adaln"].update(gpu_plans=GPU_PLANS, plan_width=1, host_cache_gb=0.001)
    engine["cache_dit"] = {"enabled": True}
    args["http"]["max_body_bytes"] = MAX_BODY_BYTES
    args["admin"] = {"token": ADMIN_TOKEN, "weight_roots": [engine["checkpoint_root"]], "update_timeout_s": 120}
    return args


@pytest.fixture(scope="module")
def base_url(app_args):
    with serve_cluster() as url:
        run_app(url, app_args)
        yield url


@pytest.fixture(scope="module")
def local_engine(base_url, app_args):
    """The same engine config in this process (the replica made the checkpoint on first start)."""
    return Engine(EngineConfig.model_validate({**app_args["engine"], "device": "cpu"}))


def handle():
    from ray import serve

    return serve.get_app_handle(APP_NAME)


def still_serving(base_url) -> None:
    assert requests.get(f"{base_url}/healthz", timeout=30).status_code == 200
    r = post(base_url, {**VIDEO, "steps": 1, "return_latents": False})
    assert r.status_code == 200, r.text


def assert_same_bits(response: GenerationResponse, engine: Engine, body: dict) -> None:
    latents = decode_latents(response.latents)
    local = engine.generate(GenerationRequest(**body))
    assert torch.equal(latents["video"], local.video) and torch.equal(latents["audio"], local.audio)
    assert response.model == local.model


def chunked(data: bytes):
    """A body sent with Transfer-Encoding: chunked (no Content-Length the ingress could check up front)."""
    for i in range(0, len(data), 1024):
        yield data[i: i + 1024]


# (id, how to send it, expected status, a piece of the message)
MORE_BAD_REQUESTS = [
    # limits that come from the server's configuration
    ("steps-past-the-plan-slab", {"json": {**VIDEO, "steps": GPU_PLANS + 1}}, 422,
     f"GPU slab holds adaln.gpu_plans={GPU_PLANS}"),
    ("plan-wider-than-plan-width", {"json": {**VIDEO, "audio_len": 4, "audio_shift": 2.0}}, 422,
     "adaln.plan_width is 1"),
    ("cache-dit-fn-plus-bn-past-the-blocks", {"json": {**VIDEO, "cache_dit": {"Fn_compute_blocks": 3,
                                                                               "Bn_compute_blocks": 2}}}, 422,
     "Fn_compute_blocks + Bn_compute_blocks = 3 + 2 exceeds the model's 4 blocks"),
    ("cache-dit-negative-threshold", {"json": {**VIDEO, "cache_dit": {"residual_diff_threshold": -0.1}}}, 422,
     "cache_dit.residual_diff_threshold: Input should be greater than or equal to 0"),
    ("cache-dit-negative-warmup", {"json": {**VIDEO, "cache_dit": {"max_warmup_steps": -1}}}, 422,
     "cache_dit.max_warmup_steps: Input should be greater than or equal to 0"),
    ("guidance-with-cache-dit-on", {"json": {**VIDEO, "guidance_scale": 2.0}}, 422,
     "guidance_scale: classifier-free guidance (> 1) cannot be combined with Cache-DiT"),
    # types, ranges, sizes
    ("prompt-as-number", {"json": {**VIDEO, "prompt": 5}}, 422, "prompt: Input should be a valid string"),
    ("prompt-null", {"json": {**VIDEO, "prompt": None}}, 422, "prompt: Input should be a valid string"),
    ("multibyte-prompt-over-model-limit", {"json": {**VIDEO, "prompt": "é" * 65}}, 422,
     "prompt: 130 UTF-8 bytes exceeds the model's max_text_tokens=128"),
    ("width-not-multiple-of-patch", {"json": {**VIDEO, "width": 9}}, 422,
     "width: 9 is not a multiple of the model's patch size 2"),
    ("audio-len-negative", {"json": {**VIDEO, "audio_len": -1}}, 422, "audio_len: Input should be greater than"),
    ("shift-huge", {"json": {**VIDEO, "shift": 1e300}}, 422, "shift: Input should be less than or equal to 10000"),
    ("guidance-infinite", raw('{"prompt": "x", "guidance_scale": -Infinity}'), 422,
     "guidance_scale: Input should be a finite number"),
    ("steps-huge-integer", raw('{"prompt": "x", "steps": 100000000000000000000000000000}'), 422,
     "steps: Input should be less than or equal to 65"),
    ("latents-flag-null", {"json": {**VIDEO, "return_latents": None}}, 422, "return_latents: Input should be a valid"),
    # hostile bodies
    ("body-a-json-string", raw('"generate please"'), 422, "body must be a JSON object, got str"),
    ("body-json-null", raw("null"), 422, "body must be a JSON object, got NoneType"),
    ("json-nested-past-the-parser-depth", raw("[" * 5000), 400, "body is not valid JSON"),
    ("pickled-payload", {"data": pickle.dumps({**VIDEO, "prompt": object.__name__}),
                         "headers": {"content-type": "application/octet-stream"}}, 400, "body is not valid JSON"),
    ("class-key-at-top-level", {"json": {**VIDEO, "__class__": "os.system"}}, 422,
     "__class__: Extra inputs are not permitted"),
    ("class-key-in-cache-dit", {"json": {**VIDEO, "cache_dit": {"__reduce__": ["os.system", ["id"]]}}}, 422,
     "cache_dit.__reduce__: Extra inputs are not permitted"),
    ("body-over-limit-chunked", {"data": chunked(b'{"prompt": "' + b"a" * (2 * MAX_BODY_BYTES) + b'"}'),
                                 "headers": {"content-type": "application/json"}}, 413,
     f"exceeds http.max_body_bytes={MAX_BODY_BYTES}"),
]


def test_http_bad_requests_total_at_least_30():
    assert len(BAD_REQUESTS) + len(MORE_BAD_REQUESTS) >= 30


@pytest.mark.parametrize("how, status, message", [c[1:] for c in MORE_BAD_REQUESTS],
                         ids=[c[0] for c in MORE_BAD_REQUESTS])
def test_bad_request_is_a_4xx_naming_the_field_or_setting(base_url, how, status, message):
    r = requests.post(f"{base_url}/v1/generations", timeout=120, **how)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] in ("invalid_request", "invalid_json", "payload_too_large")
    still_serving(base_url)


HANDLE_CASES = [(c[0], c[1]["json"], c[3]) for c in BAD_REQUESTS + MORE_BAD_REQUESTS
                if "json" in c[1] and c[2] == 422]


@pytest.mark.parametrize("body, message", [c[1:] for c in HANDLE_CASES], ids=[c[0] for c in HANDLE_CASES])
def test_handle_call_with_a_bad_dict_raises_value_error_with_the_message(base_url, body, message):
    with pytest.raises(ValueError) as info:
        handle().generate.remote(body).result(timeout_s=120)
    assert message in str(info.value)


@pytest.mark.parametrize("payload", [[VIDEO], "prompt=x", 7, None], ids=["list", "str", "int", "none"])
def test_handle_call_with_a_non_dict_raises_value_error(base_url, payload):
    with pytest.raises(ValueError, match="body must be a JSON object"):
        handle().generate.remote(payload).result(timeout_s=120)


def test_handle_call_with_an_unvalidated_request_object_is_rechecked(base_url):
    # model_construct skips pydantic validation; the ingress must not trust the object's type alone.
    forged = GenerationRequest.model_construct(**{**VIDEO, "steps": -3, "prompt": 5})
    with pytest.raises(ValueError, match="steps: Input should be greater than or equal to 1"):
        handle().generate.remote(forged).result(timeout_s=120)
    still_serving(base_url)


def test_after_the_bad_requests_a_valid_one_gives_the_bits_of_a_fresh_engine(base_url, local_engine):
    assert requests.get(f"{base_url}/healthz", timeout=30).json()["worker"]["failed"] > 0  # they did reach it
    body = {**VIDEO, "steps": GPU_PLANS}
    r = post(base_url, body)
    assert r.status_code == 200, r.text
    assert_same_bits(GenerationResponse.model_validate(r.json()), local_engine, body)
    by_handle = handle().generate.remote(body).result(timeout_s=120)
    assert by_handle.latents == r.json()["latents"]


def test_concurrent_distinct_schedules_past_the_small_slab_are_all_exact(base_url, local_engine):
    bodies = [{**VIDEO, "steps": steps, "shift": shift, "seed": 100 + i}
              for i, (steps, shift) in enumerate((s, sh) for s in (1, 2, 3, 4) for sh in (1.5, 4.0))]
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: post(base_url, b), bodies))
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses if r.status_code != 200]
    for body, r in zip(bodies, responses):
        assert_same_bits(GenerationResponse.model_validate(r.json()), local_engine, body)
    evicted = sum(r.json()["stats"]["adaln"]["gpu_evicted_plans"] for r in responses)
    assert evicted > 0  # 20 distinct plans through a 4-plan slab


def test_largest_allowed_request_has_a_bounded_response(base_url):
    body = {**VIDEO, "steps": 1, "frames": 8, "height": 32, "width": 32}
    r = post(base_url, body)
    assert r.status_code == 200, r.text
    # 4 x 8 x 32 x 32 fp32 latents (128 KiB) in base64 plus a ~128 px preview: well under 1 MiB.
    assert len(r.content) < 1 << 20
    assert post(base_url, {**body, "return_latents": False}).json()["latents"] is None


def test_checkpoint_shard_broken_at_rebuild_is_a_5xx_then_the_same_request_succeeds(base_url, app_args,
                                                                                    local_engine):
    checkpoint = Path(app_args["engine"]["checkpoint_root"]) / "tiny"
    shard = checkpoint / shard_name(shard_of("blocks.2.norm1.weight"), local_engine.dit_config.num_blocks + 1)
    saved = shard.read_bytes()
    body = {**VIDEO, "steps": 3, "shift": 2.75, "seed": 9}  # a schedule no tier holds: it must be rebuilt
    try:
        shard.write_bytes(saved[: len(saved) // 2])
        r = post(base_url, body)
        # The checkpoint broke, not the request: a 5xx that names the error type, not a 422.
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "server_error" and "RebuildError" in r.json()["error"]["message"]
    finally:
        shard.write_bytes(saved)
    r = post(base_url, body)
    assert r.status_code == 200, r.text
    # The failed build left no plan behind: both new plans are built now (step 0's sigma 1.0 is every
    # schedule's, already warm); a half-built plan counted as a hit would also break the bits below.
    assert r.json()["stats"]["adaln"]["built_plans"] == 2
    assert_same_bits(GenerationResponse.model_validate(r.json()), local_engine, body)


# --- admin weight updates: token, confined paths, updates under traffic --------------------------


def admin_post(base_url, body=None, *, headers=AUTH, **kwargs):
    return requests.post(f"{base_url}/admin/weights", json=body, headers=headers, timeout=180, **kwargs)


@pytest.fixture(scope="module")
def outside_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("outside-the-roots")


BAD_ADMIN_AUTH = [
    ("no-token", {}),
    ("wrong-token", {"authorization": "Bearer not-the-token"}),
    ("token-without-scheme", {"authorization": ADMIN_TOKEN}),
    ("basic-scheme", {"authorization": f"Basic {ADMIN_TOKEN}"}),
    ("token-prefix", {"authorization": f"Bearer {ADMIN_TOKEN[:-1]}"}),
]


@pytest.mark.parametrize("headers", [c[1] for c in BAD_ADMIN_AUTH], ids=[c[0] for c in BAD_ADMIN_AUTH])
def test_admin_routes_need_the_bearer_token(base_url, app_args, headers):
    target = str(Path(app_args["engine"]["checkpoint_root"]) / "tiny")
    r = admin_post(base_url, {"path": target}, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized", r.text
    assert requests.get(f"{base_url}/admin/weights", headers=headers, timeout=30).status_code == 401


def bad_admin_bodies(root: Path, outside: Path):
    (root / "escape-link").unlink(missing_ok=True)
    (root / "escape-link").symlink_to(outside, target_is_directory=True)
    (root / "not-a-checkpoint").mkdir(exist_ok=True)
    return [
        ("outside-the-roots", {"json": {"path": str(outside)}}, 400, "outside admin.weight_roots"),
        ("system-directory", {"json": {"path": "/etc"}}, 400, "outside admin.weight_roots"),
        ("dot-dot-traversal", {"json": {"path": f"{root}/../{outside.name}"}}, 400, "path traversal"),
        ("relative-dot-dot", {"json": {"path": "../../etc"}}, 400, "path traversal"),
        ("symlink-out-of-the-root", {"json": {"path": str(root / "escape-link")}}, 400, "outside admin.weight_roots"),
        ("nul-byte", {"json": {"path": f"{root}/tiny\x00"}}, 400, "NUL"),
        ("empty-path", {"json": {"path": ""}}, 400, "non-empty string"),
        ("path-as-number", {"json": {"path": 5}}, 422, "path: Input should be a valid string"),
        ("unknown-field", {"json": {"path": str(root / "tiny"), "force": True}}, 422, "force: Extra inputs"),
        ("missing-path", {"json": {}}, 422, "path: Field required"),
        ("malformed-json", raw('{"path": '), 400, "body is not valid JSON"),
        ("body-over-limit", {"json": {"path": "a" * (MAX_BODY_BYTES + 1)}}, 413, "http.max_body_bytes"),
        ("not-a-checkpoint", {"json": {"path": str(root / "not-a-checkpoint")}}, 422, "not-a-checkpoint"),
    ]


def test_bad_admin_requests_are_refused_and_change_nothing(base_url, app_args, outside_dir, local_engine):
    root = Path(app_args["engine"]["checkpoint_root"])
    status_before = requests.get(f"{base_url}/admin/weights", headers=AUTH, timeout=30).json()
    for name, how, status, message in bad_admin_bodies(root, outside_dir):
        headers = {**AUTH, **how.pop("headers", {})}
        r = requests.post(f"{base_url}/admin/weights", headers=headers, timeout=120, **how)
        assert r.status_code == status, f"{name}: {r.text}"
        assert message in r.json()["error"]["message"], f"{name}: {r.text}"
    status_after = requests.get(f"{base_url}/admin/weights", headers=AUTH, timeout=30).json()
    assert (status_after["version"], status_after["path"]) == (status_before["version"], status_before["path"])
    body = {**VIDEO, "seed": 31}
    r = post(base_url, body)
    assert r.status_code == 200, r.text
    assert_same_bits(GenerationResponse.model_validate(r.json()), local_engine, body)


def test_admin_weight_update_under_traffic_gives_all_old_or_all_new(base_url, app_args, local_engine):
    root = Path(app_args["engine"]["checkpoint_root"])
    new_dir = make_checkpoint(root / "tiny-seed1", local_engine.dit_config, seed=1)
    new_engine = Engine(EngineConfig.model_validate({**app_args["engine"], "device": "cpu",
                                                        "checkpoint": str(new_dir)}))
    bodies = [{**VIDEO, "seed": 40 + i, "steps": 1 + i % 3} for i in range(8)]
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        pending = [pool.submit(post, base_url, b) for b in bodies[:4]]
        update = pool.submit(admin_post, base_url, {"path": str(new_dir)})
        time.sleep(0.2)
        pending += [pool.submit(post, base_url, b) for b in bodies[4:]]
        responses = [f.result(timeout=180) for f in pending]
        r = update.result(timeout=180)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    labels = set()
    for body, response in zip(bodies, responses):
        assert response.status_code == 200, response.text
        got = GenerationResponse.model_validate(response.json())
        engine = new_engine if got.model == new_engine.model_name else local_engine
        assert_same_bits(got, engine, body)  # the label says which weights; the bits agree, all of them
        labels.add(got.model)
    after = GenerationResponse.model_validate(post(base_url, bodies[0]).json())
    assert after.model == new_engine.model_name
    assert_same_bits(after, new_engine, bodies[0])
    # Back to the original weights (the later tests compare against them).
    r = admin_post(base_url, {"path": str(root / "tiny")})
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text


def worker_replica_actors():
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and "#Worker#" in a["name"]]


def test_worker_replica_killed_mid_request_gives_a_clear_5xx_then_serves_again(base_url, local_engine):
    import ray

    (replica,) = worker_replica_actors()
    slow = {**VIDEO, "steps": GPU_PLANS, "frames": 8, "height": 32, "width": 32, "return_latents": False}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, base_url, slow)
        time.sleep(1.0)  # the request is on the replica's engine thread now
        ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
        r = pending.result(timeout=120)
    # Either Serve retried it transparently on a new replica (200), or the client hears a clear 5xx.
    if r.status_code != 200:
        assert r.status_code in (500, 503), r.text
        assert r.json()["error"]["type"] in ("unavailable", "server_error")
    wait_healthy(base_url)
    deadline = time.monotonic() + 120
    while True:  # the controller replaces the dead replica
        replicas = worker_replica_actors()
        if replicas and replicas[0]["name"] != replica["name"]:
            break
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(0.5)
    body = {**VIDEO, "seed": 77}
    r = post(base_url, body)
    assert r.status_code == 200, r.text
    assert_same_bits(GenerationResponse.model_validate(r.json()), local_engine, body)
