"""Reliability over HTTP and through the handle, with the real engine on a tiny checkpoint (CPU), one cluster.

The app runs serve_config.yaml's args with a deliberately small AdaLN plan slab (`adaln.gpu_plans: 4`,
`adaln.plan_width: 1`: only requests whose video and audio schedules coincide (`flow_shift ==
audio_flow_shift`, one distinct timestep per forward) of <= 5 steps fit) and Cache-DiT on, so the limits that
come from the server's configuration can be hit from the outside. Complements tests/test_http.py (whose bad
requests run there against the stock config; they are replayed here through the handle):

- more bad requests (config-dependent limits, cache-dit settings, hostile bodies) -> 4xx naming the field or
  setting, the replica keeps serving, and afterwards the bits equal an engine built in this process;
- the handle path: bad dicts raise ValueError with the same message;
- concurrent requests with distinct schedules overflowing the small slab all come back exact;
- a worker replica killed mid-request: the client gets a clear 5xx, the replica comes back and serves.
"""

from __future__ import annotations

import base64
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
from model.layout import H3Checkpoint
from model.weights import TransformerWeights
from tests.serve_helpers import APP_NAME, run_app, serve_cluster, serve_config_args, wait_healthy
from tests.test_http import BAD_REQUESTS, MAX_BODY_BYTES, MAX_PROMPT_TOKENS, VALID, post, raw
from tests.weights_support import finetune_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.ray]  # slow: Ray + Serve: faults under the app

GPU_PLANS = 4
#: plan_width 1 admits only one distinct timestep per forward: equal video and audio shifts.
NARROW = {**VALID, "flow_shift": 3.0, "audio_flow_shift": 3.0}
ADMIN_TOKEN = "test-admin-token-6f1d"
AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}
CHECKPOINT = "tiny-diffusers"  # the auto-made checkpoint, under engine.checkpoint_root


@pytest.fixture(scope="module")
def app_args(tmp_path_factory):
    args = serve_config_args(tmp_path_factory.mktemp("checkpoints"))
    engine = args["engine"]
    engine["adaln"].update(gpu_plans=GPU_PLANS, plan_width=1, host_cache_gb=0.001)
    engine["cache_dit"] = {"enabled": True}
    engine["text_encoder"]["max_prompt_tokens"] = MAX_PROMPT_TOKENS
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
    r = post(base_url, {**NARROW, "steps": 2, "return_latents": False})
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
    ("steps-past-the-plan-slab", {"json": {**NARROW, "steps": GPU_PLANS + 2}}, 422,
     f"request needs {GPU_PLANS + 1} distinct AdaLN plans but the GPU slab holds adaln.gpu_plans={GPU_PLANS}"),
    ("plan-wider-than-plan-width", {"json": {**NARROW, "audio_flow_shift": 2.0}}, 422,
     "step 1 has 2 distinct timesteps but adaln.plan_width is 1"),
    ("default-shifts-wider-than-plan-width", {"json": {**VALID}}, 422, "but adaln.plan_width is 1"),
    ("cache-dit-fn-plus-bn-past-the-blocks", {"json": {**NARROW, "cache_dit": {"Fn_compute_blocks": 3,
                                                                                "Bn_compute_blocks": 2}}}, 422,
     "Fn_compute_blocks + Bn_compute_blocks = 3 + 2 exceeds the model's 4 blocks"),
    ("cache-dit-negative-threshold", {"json": {**NARROW, "cache_dit": {"residual_diff_threshold": -0.1}}}, 422,
     "cache_dit.residual_diff_threshold: Input should be greater than or equal to 0"),
    ("cache-dit-negative-warmup", {"json": {**NARROW, "cache_dit": {"max_warmup_steps": -1}}}, 422,
     "cache_dit.max_warmup_steps: Input should be greater than or equal to 0"),
    ("guidance-with-cache-dit-off", {"json": {**NARROW, "guidance_scale": 3.0, "cache_dit": {"enabled": False}}},
     422, "guidance_scale: 3.0 is not served: MiniMax-H3 is CFG-distilled"),
    # types, ranges, sizes
    ("prompt-as-number", {"json": {**NARROW, "prompt": 5}}, 422, "prompt: Input should be a valid string"),
    ("prompt-null", {"json": {**NARROW, "prompt": None}}, 422, "prompt: Input should be a valid string"),
    ("prompt-empty", {"json": {**NARROW, "prompt": ""}}, 422, "prompt: String should have at least 1 character"),
    ("multibyte-prompt-over-token-limit", {"json": {**NARROW, "prompt": "é" * 70}}, 422,
     f"prompt: 140 tokens exceeds this server's max_prompt_tokens={MAX_PROMPT_TOKENS}"),
    ("width-33", {"json": {**NARROW, "width": 33}}, 422, "width: 33 is out of range: must be a multiple of 32 px"),
    ("width-over-schema", {"json": {**NARROW, "width": 8193}}, 422, "width: Input should be less than or equal to 8192"),
    ("height-as-float", {"json": {**NARROW, "height": 64.5}}, 422, "height: Input should be a valid integer"),
    ("seconds-negative", {"json": {**NARROW, "seconds": -5.0}}, 422, "seconds: Input should be greater than 0"),
    ("seconds-nan", raw('{"prompt": "x", "seconds": NaN}'), 422, "seconds: Input should be a finite number"),
    ("seconds-as-string", {"json": {**NARROW, "seconds": "5"}}, 422, "seconds: Input should be a valid number"),
    ("flow-shift-huge", {"json": {**NARROW, "flow_shift": 1e300}}, 422,
     "flow_shift: Input should be less than or equal to 10000"),
    ("guidance-infinite", raw('{"prompt": "x", "guidance_scale": -Infinity}'), 422,
     "guidance_scale: Input should be a finite number"),
    ("steps-huge-integer", raw('{"prompt": "x", "steps": 100000000000000000000000000000}'), 422,
     "steps: Input should be less than or equal to 65"),
    ("latents-flag-null", {"json": {**NARROW, "return_latents": None}}, 422, "return_latents: Input should be a valid"),
    # hostile bodies
    ("body-a-json-string", raw('"generate please"'), 422, "body must be a JSON object, got str"),
    ("body-json-null", raw("null"), 422, "body must be a JSON object, got NoneType"),
    ("json-nested-past-the-parser-depth", raw("[" * 5000), 400, "body is not valid JSON"),
    ("pickled-payload", {"data": pickle.dumps({**NARROW, "prompt": object.__name__}),
                         "headers": {"content-type": "application/octet-stream"}}, 400, "body is not valid JSON"),
    ("class-key-at-top-level", {"json": {**NARROW, "__class__": "os.system"}}, 422,
     "__class__: Extra inputs are not permitted"),
    ("class-key-in-cache-dit", {"json": {**NARROW, "cache_dit": {"__reduce__": ["os.system", ["id"]]}}}, 422,
     "cache_dit.__reduce__: Extra inputs are not permitted"),
    ("body-over-limit-chunked", {"data": chunked(b'{"prompt": "' + b"a" * (2 * MAX_BODY_BYTES) + b'"}'),
                                 "headers": {"content-type": "application/json"}}, 413,
     f"exceeds http.max_body_bytes={MAX_BODY_BYTES}"),
]

#: test_http's cases that depend on its stock config (Cache-DiT off there, on here).
STOCK_CONFIG_ONLY = {"cache-dit-off-on-the-server"}


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
                if "json" in c[1] and c[2] == 422 and c[0] not in STOCK_CONFIG_ONLY]


@pytest.mark.parametrize("body, message", [c[1:] for c in HANDLE_CASES], ids=[c[0] for c in HANDLE_CASES])
def test_handle_call_with_a_bad_dict_raises_value_error_with_the_message(base_url, body, message):
    with pytest.raises(ValueError) as info:
        handle().generate.remote(body).result(timeout_s=120)
    assert message in str(info.value)


@pytest.mark.parametrize("payload", [[NARROW], "prompt=x", 7, None], ids=["list", "str", "int", "none"])
def test_handle_call_with_a_non_dict_raises_value_error(base_url, payload):
    with pytest.raises(ValueError, match="body must be a JSON object"):
        handle().generate.remote(payload).result(timeout_s=120)


def test_handle_call_with_an_unvalidated_request_object_is_rechecked(base_url):
    # model_construct skips pydantic validation; the ingress must not trust the object's type alone.
    forged = GenerationRequest.model_construct(**{**NARROW, "steps": -3, "prompt": 5})
    with pytest.raises(ValueError, match="steps: Input should be greater than or equal to 2"):
        handle().generate.remote(forged).result(timeout_s=120)
    still_serving(base_url)


def test_after_the_bad_requests_a_valid_one_gives_the_bits_of_a_fresh_engine(base_url, local_engine):
    # The config-dependent ones (slab, plan width) reached the worker, whose validation refused them before any
    # engine work (their 422s name its slab): no generation failed, and the engine's state is a fresh one's.
    assert requests.get(f"{base_url}/healthz", timeout=30).json()["worker"]["failed"] == 0
    body = {**NARROW, "steps": GPU_PLANS + 1}  # 4 forwards: exactly the slab
    r = post(base_url, body)
    assert r.status_code == 200, r.text
    assert_same_bits(GenerationResponse.model_validate(r.json()), local_engine, body)
    by_handle = handle().generate.remote(body).result(timeout_s=120)
    assert by_handle.latents == r.json()["latents"]


def test_concurrent_distinct_schedules_past_the_small_slab_are_all_exact(base_url, local_engine):
    bodies = [{**NARROW, "steps": steps, "flow_shift": shift, "audio_flow_shift": shift, "seed": 100 + i}
              for i, (steps, shift) in enumerate((s, sh) for s in (2, 3, 4, 5) for sh in (1.5, 4.0))]
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: post(base_url, b), bodies))
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses if r.status_code != 200]
    for body, r in zip(bodies, responses):
        assert_same_bits(GenerationResponse.model_validate(r.json()), local_engine, body)
    evicted = sum(r.json()["stats"]["adaln"]["gpu_evicted_plans"] for r in responses)
    assert evicted > 0  # 2 x (1 + 2 + 3 + 4) plans (13 distinct: forward 0's is shared) through a 4-plan slab


def test_a_response_carries_only_what_was_asked_for(base_url):
    body = {**NARROW, "steps": 2, "return_latents": False}
    bare = post(base_url, body)
    assert bare.status_code == 200, bare.text
    assert bare.json()["latents"] is None and bare.json()["video_mp4"] is None
    assert len(bare.content) < 16 * 1024  # ids, stats and a ~128 px preview of the latents
    with_latents = post(base_url, {**body, "return_latents": True}).json()
    # fp32 video [24, 37, 4, 4] and audio [414, 32] as safetensors (plus its header), base64
    raw_bytes = len(base64.b64decode(with_latents["latents"]))
    assert 4 * (24 * 37 * 4 * 4 + 414 * 32) < raw_bytes < 4 * (24 * 37 * 4 * 4 + 414 * 32) + 256
    with_video = post(base_url, {**body, "return_video": True}).json()
    assert with_video["video_mp4"] is not None and with_video["latents"] is None


def test_checkpoint_shard_broken_at_rebuild_is_a_5xx_then_the_same_request_succeeds(base_url, app_args,
                                                                                    local_engine):
    checkpoint = H3Checkpoint.open(Path(app_args["engine"]["checkpoint_root"]) / CHECKPOINT)
    location = TransformerWeights(checkpoint.transformer_dir, checkpoint.layout).location(
        "transformer_blocks.2.adaln_proj.linear.weight")
    saved = location.path.read_bytes()
    still_serving(base_url)  # steps=2: warms the plan of timestep 0.0, forward 0 of every schedule
    # a schedule no tier holds: its plans must be rebuilt from the checkpoint
    body = {**NARROW, "steps": 4, "flow_shift": 2.75, "audio_flow_shift": 2.75, "seed": 9}
    try:
        location.path.write_bytes(saved[: location.offset + location.nbytes // 2])
        r = post(base_url, body)
        # The checkpoint broke, not the request: a 5xx that names the cause, not a 422.
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "server_error"
        assert "checkpoint_unreadable (the server could not read its checkpoint" in r.json()["error"]["message"]
    finally:
        location.path.write_bytes(saved)
    r = post(base_url, body)
    assert r.status_code == 200, r.text
    # The failed build left no plan behind: both new plans are built now (forward 0's timestep 0.0 is every
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
    target = str(Path(app_args["engine"]["checkpoint_root"]) / CHECKPOINT)
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
        ("nul-byte", {"json": {"path": f"{root}/{CHECKPOINT}\x00"}}, 400, "NUL"),
        ("empty-path", {"json": {"path": ""}}, 400, "non-empty string"),
        ("path-as-number", {"json": {"path": 5}}, 422, "path: Input should be a valid string"),
        ("unknown-field", {"json": {"path": str(root / CHECKPOINT), "force": True}}, 422, "force: Extra inputs"),
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
    body = {**NARROW, "seed": 31}
    r = post(base_url, body)
    assert r.status_code == 200, r.text
    assert_same_bits(GenerationResponse.model_validate(r.json()), local_engine, body)


def test_admin_weight_update_under_traffic_gives_all_old_or_all_new(base_url, app_args, local_engine):
    root = Path(app_args["engine"]["checkpoint_root"])
    new_dir = finetune_of(root / CHECKPOINT, root / "tiny-seed1")
    # No adapters: the shipped config's auto-made one needs an auto-made checkpoint; these requests run none.
    new_engine = Engine(EngineConfig.model_validate({**app_args["engine"], "device": "cpu", "adapters": {},
                                                     "checkpoint": str(new_dir)}))
    bodies = [{**NARROW, "seed": 40 + i, "steps": 2 + i % 3} for i in range(8)]
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        pending = [pool.submit(post, base_url, b) for b in bodies[:4]]
        update = pool.submit(admin_post, base_url, {"path": str(new_dir)})
        time.sleep(0.2)
        pending += [pool.submit(post, base_url, b) for b in bodies[4:]]
        responses = [f.result(timeout=180) for f in pending]
        r = update.result(timeout=180)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    for body, response in zip(bodies, responses):
        assert response.status_code == 200, response.text
        got = GenerationResponse.model_validate(response.json())
        engine = new_engine if got.model == new_engine.model_name else local_engine
        assert_same_bits(got, engine, body)  # the label says which weights; the bits agree, all of them
    after = GenerationResponse.model_validate(post(base_url, bodies[0]).json())
    assert after.model == new_engine.model_name != local_engine.model_name
    assert_same_bits(after, new_engine, bodies[0])
    # Back to the original weights (the later tests compare against them).
    r = admin_post(base_url, {"path": str(root / CHECKPOINT)})
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text


def worker_replica_actors():
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and "#Worker#" in a["name"]]


def test_worker_replica_killed_mid_request_gives_a_clear_5xx_then_serves_again(base_url, local_engine):
    import ray

    (replica,) = worker_replica_actors()
    # A few seconds on one CPU core: 4 forwards over 2368 video tokens, then the VAE decode and the MP4.
    slow = {**NARROW, "steps": GPU_PLANS + 1, "width": 256, "height": 256, "return_video": True,
            "return_latents": False}
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
    body = {**NARROW, "seed": 77}
    r = post(base_url, body)
    assert r.status_code == 200, r.text
    assert_same_bits(GenerationResponse.model_validate(r.json()), local_engine, body)
