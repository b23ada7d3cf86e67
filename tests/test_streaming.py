"""Per-step progress over the handle and over HTTP (server-sent events), cancellation, and the worker's
Prometheus metrics, with the real engine on a tiny checkpoint (CPU) and one worker replica.

A caller that cancels (handle) or closes the stream (HTTP) must stop the engine at its next step and
leave no AdaLN plan reference held; the replica keeps serving.
"""

from __future__ import annotations

import re
import time

import pytest
import requests

from deployments.schemas import GenerationResponse, ProgressEvent
from tests.serve_helpers import APP_NAME, free_port, run_app, serve_cluster, serve_config_args, sse_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.ray(own_cluster=True)]  # slow: Ray + Serve (its own cluster: a metrics port)

#: 64x64 px for 5 s; 3 grid points: 2 transformer forwards, so 2 progress events after the "accepted" one.
SMALL = {"prompt": "a lighthouse at dusk", "steps": 3, "seconds": 5.0, "width": 64, "height": 64, "seed": 5,
         "return_video": False, "return_latents": True}
FORWARDS = SMALL["steps"] - 1
# 256x256 px (2368 video tokens): ~0.1 s per forward on one CPU core, long enough to cancel in the middle.
LONG = {"prompt": "a long walk", "steps": 60, "seconds": 5.0, "width": 256, "height": 256, "seed": 9,
        "return_video": False}


@pytest.fixture(scope="module")
def metrics_port() -> int:
    """Ray's metrics export port, picked as the module's cluster starts (a port picked early can be taken by
    then: every Ray process binds ephemeral ports of its own)."""
    return free_port()


@pytest.fixture(scope="module")
def base_url(tmp_path_factory, metrics_port):
    args = serve_config_args(tmp_path_factory.mktemp("checkpoints"))
    args["worker"]["num_replicas"] = 1
    args["stages"] = "fused"  # the Worker streams and exports either way; one replica process fewer than split
    with serve_cluster(_metrics_export_port=metrics_port) as url:
        run_app(url, args)
        yield url


def app_handle():
    from ray import serve

    return serve.get_app_handle(APP_NAME)


def worker_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Worker", app_name=APP_NAME).debug_stats.remote().result(timeout_s=30)


def wait_idle(outcome: str, timeout_s: float = 60.0) -> dict:
    """The worker's stats once its last request ended with `outcome` and nothing runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker_stats()
        if stats["last_request"].get("outcome") == outcome and not stats["busy"]:
            return stats
        assert time.monotonic() < deadline, f"worker never became idle with outcome {outcome}: {stats}"
        time.sleep(0.2)


def assert_replica_still_serves() -> None:
    response = app_handle().generate.remote({**SMALL, "steps": 2}).result(timeout_s=120)
    assert response.video_shape == [24, 37, 4, 4] and response.audio_shape == [414, 32]


def test_handle_stream_yields_one_progress_event_per_forward_then_the_same_result(base_url):
    items = list(app_handle().options(stream=True).generate_stream.remote(SMALL))
    *progress, result = items
    assert all(isinstance(p, ProgressEvent) for p in progress)
    assert [p.step for p in progress] == [0, 1, 2]  # accepted, then after each of the 2 forwards
    assert [p.steps for p in progress[1:]] == [FORWARDS, FORWARDS]
    assert [p.elapsed_s for p in progress] == sorted(p.elapsed_s for p in progress)
    assert isinstance(result, GenerationResponse)
    plain = app_handle().generate.remote(SMALL).result(timeout_s=120)
    assert result.latents == plain.latents and result.model == plain.model


def test_every_progress_event_counts_the_same_forwards(base_url):
    *progress, _ = list(app_handle().options(stream=True).generate_stream.remote(SMALL))
    assert [(p.step, p.steps) for p in progress] == [(0, FORWARDS), (1, FORWARDS), (2, FORWARDS)]


@pytest.mark.parametrize("url", ["/v1/generations?stream=true", "/v1/generations:stream"])
def test_http_stream_is_server_sent_progress_then_result(base_url, url):
    with requests.post(f"{base_url}{url}", json=SMALL, stream=True, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    names = [name for name, _ in events]
    assert names == ["progress"] * (1 + FORWARDS) + ["result"]
    assert [data["step"] for _, data in events[:-1]] == [0, 1, 2]
    assert all(data["steps"] >= FORWARDS and data["elapsed_s"] >= 0 for _, data in events[:-1])
    result = GenerationResponse.model_validate(events[-1][1])
    plain = requests.post(f"{base_url}/v1/generations", json=SMALL, timeout=120).json()
    assert result.latents == plain["latents"]


def test_http_stream_refused_before_it_starts_is_a_plain_json_4xx(base_url):
    r = requests.post(f"{base_url}/v1/generations:stream", json={**SMALL, "width": 65}, timeout=60)
    assert r.status_code == 422 and "width: 65 is out of range: must be a multiple of 32 px" in r.json()["error"]["message"]
    r = requests.post(f"{base_url}/v1/generations?stream=true", json={**SMALL, "steps": "2"}, timeout=60)
    assert r.status_code == 422 and "steps" in r.json()["error"]["message"]


def test_cancelling_the_handle_stream_stops_the_engine_and_releases_its_plans(base_url):
    stream = app_handle().options(stream=True).generate_stream.remote(LONG)
    for event in stream:
        if event.step >= 2:
            break
    stream.cancel()
    stats = wait_idle("cancelled")
    assert stats["held_plan_refs"] == 0
    assert 2 <= stats["last_request"]["step"] < LONG["steps"]  # stopped at a step boundary, not at the end
    assert_replica_still_serves()
    assert worker_stats()["held_plan_refs"] == 0


def test_closing_the_http_stream_stops_the_engine_and_releases_its_plans(base_url):
    before = worker_stats()["outcomes"]["cancelled"]
    with requests.post(f"{base_url}/v1/generations:stream", json={**LONG, "seed": 10}, stream=True, timeout=120) as r:
        assert r.status_code == 200
        for name, data in sse_events(r):
            if name == "progress" and data["step"] >= 2:
                break
    # the connection is closed here, mid-stream
    stats = wait_idle("cancelled")
    assert stats["outcomes"]["cancelled"] == before + 1
    assert stats["held_plan_refs"] == 0 and stats["last_request"]["step"] < LONG["steps"]
    assert_replica_still_serves()


def scrape(port: int) -> str:
    return requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def sample(text: str, name: str, **tags: str) -> float | None:
    """Sum of the samples of `name` whose labels include `tags` (None: no such sample)."""
    total, found = 0.0, False
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(labels.get(k) == v for k, v in tags.items()):
            total, found = total + float(match.group(2)), True
    return total if found else None


def test_worker_metrics_reach_the_prometheus_endpoint(base_url, metrics_port):
    # Same schedule twice: the second finds its 4 plans (one per forward) warm in the GPU slab.
    for _ in range(2):
        app_handle().generate.remote({**SMALL, "steps": 5, "seed": 1}).result(timeout_s=120)
    # (metric, labels, what its value must satisfy). Each replica exports on its own ~10 s period, so a count
    # may show one replica's share before the other's: wait for the values, not only for the names.
    at_least = lambda n: (lambda v: v >= n)  # noqa: E731
    present = at_least(0)
    wanted = [
        ("ray_ditserve_plans_total", {"tier": "built"}, present),
        ("ray_ditserve_plans_total", {"tier": "gpu", "deployment": "Worker"}, at_least(4)),
        ("ray_ditserve_plan_warm_requests_total", {"warm": "true"}, present),
        ("ray_ditserve_plan_warm_requests_total", {"warm": "false"}, present),
        ("ray_ditserve_requests_total", {"outcome": "ok"}, present),
        ("ray_ditserve_requests_total", {"outcome": "cancelled"}, at_least(2)),
        ("ray_ditserve_rebuild_read_bytes_total", {}, lambda v: v > 0),
        ("ray_ditserve_rebuild_seconds_count", {}, present),
        ("ray_ditserve_request_seconds_count", {"outcome": "ok"}, present),
        ("ray_ditserve_ongoing_requests", {}, lambda v: v == 0),
        ("ray_ditserve_weights_version", {}, present),
        ("ray_ditserve_router_requests", {"route": "affinity_hit", "deployment": "Ingress"}, at_least(2)),
    ]
    deadline = time.monotonic() + 90  # exported ~10 s after recording
    while True:
        text = scrape(metrics_port)
        unmet = [(name, tags, value) for name, tags, holds in wanted
                 if (value := sample(text, name, **tags)) is None or not holds(value)]
        if not unmet:
            break
        assert time.monotonic() < deadline, f"metrics never reached their values (name, labels, value): {unmet}"
        time.sleep(2)
