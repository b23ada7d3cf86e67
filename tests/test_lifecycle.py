"""The life of a synchronous generation (`/v1/generations`, its stream, the handle's generate and
generate_stream) with a fake engine that records every request's forwards (tests/lifecycle_engine.py).

The promise: every request is answered (a result, or a status / typed exception naming the cause) within a
bound; a caller that goes away stops the engine at its next step and frees what it held, and the replica
takes the next request at once; a failure mid-run maps to its status without a traceback; stopping the app
answers what it holds with a named error.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from deployments.schemas import AppConfig, GenerationResponse
from tests.lifecycle_engine import FAIL_AFTER_FORWARDS, LifecycleEngine
from tests.serve_helpers import APP_NAME, serve_cluster, sse_events, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.ray]  # slow: Ray + Serve: start, stop, cancel, bounds

#: 0.1 s per forward: 6.4 s if nobody stops it.
SLOW = {"prompt": "slow", "steps": 65, "width": 32, "height": 32, "return_video": False}
FORWARDS = SLOW["steps"] - 1
QUICK = {"prompt": "quick", "steps": 3, "width": 32, "height": 32, "return_video": False}


@pytest.fixture(scope="module")
def base_url():
    from ray import serve

    from deployments.app import build_application

    with serve_cluster() as url:
        config = AppConfig.model_validate({"stages": "fused", "http": {"request_timeout_s": 60},
                                           "worker": {"num_replicas": 1}})
        serve.run(build_application(config, LifecycleEngine), name=APP_NAME, route_prefix="/")
        wait_healthy(url)
        yield url


def app_handle(app: str = APP_NAME):
    from ray import serve

    return serve.get_app_handle(app)


def worker_stats(app: str = APP_NAME) -> dict:
    from ray import serve

    return serve.get_deployment_handle("Worker", app_name=app).debug_stats.remote().result(timeout_s=30)


def wait_for(what: str, done, timeout_s: float = 60.0, app: str = APP_NAME) -> dict:
    """The worker's stats once `done(stats)` holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker_stats(app)
        if done(stats):
            return stats
        assert time.monotonic() < deadline, f"{what}: {stats}"
        time.sleep(0.05)


def wait_running(seed: int, app: str = APP_NAME) -> None:
    wait_for(f"request {seed} never ran 2 forwards", lambda s: s["steps"].get(seed, 0) >= 2, app=app)


def wait_idle_after(seed: int) -> dict:
    return wait_for(f"request {seed} never ended, or the worker never became idle",
                    lambda s: seed in s["ends"] and s["in_flight"] == 0 and s["held_plan_refs"] == 0)


# --- a caller that goes away ------------------------------------------------------------------------------


def leave_http(base_url: str, body: dict) -> None:
    with pytest.raises(requests.exceptions.ReadTimeout):  # ~1 s in: about 10 forwards
        requests.post(f"{base_url}/v1/generations", json=body, timeout=1.0)


def leave_http_stream(base_url: str, body: dict) -> None:
    with requests.post(f"{base_url}/v1/generations:stream", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        for name, data in sse_events(r):
            if name == "progress" and data["step"] >= 2:
                break  # the connection closes here, mid-stream


def leave_handle(base_url: str, body: dict) -> None:
    response = app_handle().generate.remote(body)
    wait_running(body["seed"])
    response.cancel()


def leave_handle_stream(base_url: str, body: dict) -> None:
    stream = app_handle().options(stream=True).generate_stream.remote(body)
    for event in stream:
        if event.step >= 2:
            break
    stream.cancel()


LEAVERS = {"http": leave_http, "http-stream": leave_http_stream, "handle": leave_handle,
           "handle-stream": leave_handle_stream}


@pytest.mark.parametrize("how", list(LEAVERS))
def test_a_caller_that_goes_away_stops_the_engine_at_its_next_step_and_frees_what_it_held(base_url, how):
    seed = 1000 + list(LEAVERS).index(how)
    LEAVERS[how](base_url, {**SLOW, "seed": seed})
    stats = wait_idle_after(seed)
    assert stats["ends"][seed] == "cancelled"
    assert 2 <= stats["steps"][seed] < FORWARDS  # stopped at a step boundary, well before the end
    assert stats["last_request"]["outcome"] == "cancelled"
    r = requests.post(f"{base_url}/v1/generations", json={**QUICK, "seed": seed + 100}, timeout=60)
    assert r.status_code == 200, r.text  # the replica takes the next request
    assert worker_stats()["in_flight"] == 0


def test_a_queued_request_whose_caller_left_never_runs_a_forward(base_url):
    running = app_handle().generate.remote({**SLOW, "steps": 30, "seed": 2000})
    wait_running(2000)
    queued = app_handle().generate.remote({**QUICK, "seed": 2001})
    wait_for("the second request never reached the worker", lambda s: s["in_flight"] == 2)
    queued.cancel()
    running.result(timeout_s=60)
    stats = wait_idle_after(2001)
    assert (stats["ends"][2001], stats["steps"][2001]) == ("cancelled", 0)


# --- failures mid-run -------------------------------------------------------------------------------------

# prompt -> (status, error type, message): raised after the second forward, after validation
MID_RUN = {
    "fault": (500, "server_error", "generation failed: checkpoint_unreadable (the server could not read its "
              "checkpoint; retry later)"),
    "boom": (500, "server_error", "generation failed: RuntimeError"),
    "refuse": (422, "invalid_request", "prompt: refuse: this request cannot be served past its second forward"),
}


@pytest.mark.parametrize("prompt", list(MID_RUN))
def test_a_failure_mid_run_is_its_status_with_a_message_and_the_replica_keeps_serving(base_url, prompt):
    status, kind, message = MID_RUN[prompt]
    body = {**QUICK, "prompt": prompt, "steps": 6, "seed": 3000}
    r = requests.post(f"{base_url}/v1/generations", json=body, timeout=60)
    assert (r.status_code, r.json()["error"]["type"], r.json()["error"]["message"]) == (status, kind, message)
    r = requests.post(f"{base_url}/v1/generations:stream", json=body, timeout=60)
    events = list(sse_events(r))
    assert [name for name, _ in events] == ["progress"] * FAIL_AFTER_FORWARDS + ["error"]
    assert (events[-1][1]["error"]["type"], events[-1][1]["error"]["message"]) == (kind, message)
    assert "Traceback" not in r.text and "/secret/path" not in r.text
    with pytest.raises(Exception) as info:
        app_handle().generate.remote(body).result(timeout_s=60)
    assert isinstance(info.value, ValueError) == (status < 500) and message in str(info.value)
    stats = wait_idle_after(3000)
    assert stats["steps"][3000] == FAIL_AFTER_FORWARDS
    r = requests.post(f"{base_url}/v1/generations", json={**QUICK, "seed": 3001}, timeout=60)
    assert r.status_code == 200, r.text


def replica_log_lines(deployment: str) -> list[str]:
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return [line for path in sorted(logs.glob(f"replica_{APP_NAME}_{deployment}_*.log"))
            for line in path.read_text(errors="replace").splitlines()]


def test_only_server_faults_are_logged_at_error_level(base_url):
    for prompt in ("refuse", "fault"):
        body = {**QUICK, "prompt": f"{prompt} marker", "steps": 6, "seed": 4000}
        assert requests.post(f"{base_url}/v1/generations", json=body, timeout=60).status_code in (422, 500)
    deadline = time.monotonic() + 30
    while not any("ServerFault" in line for line in replica_log_lines("Worker")):  # logs are flushed async
        assert time.monotonic() < deadline, "the server fault was never logged"
        time.sleep(0.2)
    for deployment in ("Ingress", "Worker"):
        assert not [line for line in replica_log_lines(deployment) if "ClientError: refuse" in line]


# --- stopping the app -------------------------------------------------------------------------------------


def answer(url: str, body: dict, stream: bool = False) -> tuple[int, str]:
    """(status, the error's message or the stream's last event) of a request the server must answer."""
    r = requests.post(f"{url}/v1/generations{':stream' if stream else ''}", json=body, timeout=120)
    if stream and r.status_code == 200:  # read whole: the events, then the end of the stream
        name, data = list(sse_events(r))[-1]
        return (200 if name == "result" else data["error"]["type"]), json.dumps(data)
    assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.text)
    return r.status_code, r.json()["error"]["message"] if r.status_code != 200 else "result"


def test_stopping_the_app_answers_its_running_and_queued_generations_with_a_named_error(base_url):
    """`serve.delete` (Ctrl-C on `serve run`, a redeploy) while a generation (a handle's stream) runs past the 1 s
    grace periods and HTTP ones wait behind it: the stream is cut, not waited for (Serve's default would drain for
    20 s per deployment and let its 6.4 s finish), and each HTTP caller hears a JSON 503 naming the cause (not the
    proxy's bare 500)."""
    from ray import serve

    from deployments.app import build_application

    # max_ongoing_requests 5: four generations and the stats call that watches them
    config = AppConfig.model_validate({"stages": "fused", "worker": {"num_replicas": 1, "max_ongoing_requests": 5,
                                                                     "graceful_shutdown_timeout_s": 1.0},
                                       "http": {"request_timeout_s": 120, "graceful_shutdown_timeout_s": 1.0}})
    serve.run(build_application(config, LifecycleEngine), name="stopping", route_prefix="/stopping")
    url = f"{base_url}/stopping"
    wait_healthy(url)

    def handle_stream_outcome(body: dict) -> str:
        outcome = "stream ended without a result"
        try:
            for event in serve.get_app_handle("stopping").options(stream=True).generate_stream.remote(body):
                if isinstance(event, GenerationResponse):
                    outcome = "finished"  # the stop waited for the whole generation
        except Exception as exc:  # noqa: BLE001 - whatever Ray raises for a request cut by a killed replica
            outcome = f"cut: {type(exc).__name__}"
        return outcome

    with ThreadPoolExecutor(4) as pool:
        streamed = pool.submit(handle_stream_outcome, {**SLOW, "seed": 5003})
        wait_running(5003, app="stopping")
        queued = [pool.submit(answer, url, {**SLOW, "seed": 5000}), pool.submit(answer, url, {**SLOW, "seed": 5001}),
                  pool.submit(answer, url, {**SLOW, "seed": 5002}, True)]
        wait_for("the queued requests never reached the worker", lambda s: s["in_flight"] == 4, app="stopping")
        serve.delete("stopping")
        answers = [f.result(timeout=120) for f in queued]
        cut = streamed.result(timeout=120)
    assert cut.startswith("cut: "), cut
    assert answers[:2] == [(503, "no worker could take the request: ActorDiedError")] * 2
    assert answers[2][0] == "unavailable" and "ActorDiedError" in answers[2][1]


# --- overload ---------------------------------------------------------------------------------------------


def test_past_max_pending_generations_a_request_is_refused_at_once_with_retry_after(base_url):
    """`http.max_pending_generations`: the generations an ingress replica holds (running or waiting); one more
    is a 503 naming the bound with Retry-After, on every path, and nothing it holds is disturbed."""
    from ray import serve

    from deployments.app import build_application

    config = AppConfig.model_validate({"stages": "fused", "worker": {"num_replicas": 1},
                                       "http": {"request_timeout_s": 120, "max_pending_generations": 2}})
    serve.run(build_application(config, LifecycleEngine), name="bounded", route_prefix="/bounded")
    url = f"{base_url}/bounded"
    wait_healthy(url)
    held = {**SLOW, "steps": 20}
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(answer, url, {**held, "seed": 6000}), pool.submit(answer, url, {**held, "seed": 6001})]
        wait_for("the two held requests never reached the worker", lambda s: s["in_flight"] == 2, app="bounded")
        message = "the server holds 2 generations (http.max_pending_generations=2); retry later"
        for path in ("/v1/generations", "/v1/generations:stream"):
            r = requests.post(f"{url}{path}", json={**QUICK, "seed": 6002}, timeout=60)
            assert (r.status_code, r.json()["error"]["type"], r.json()["error"]["message"]) == (
                503, "overloaded", message)
            assert r.headers["retry-after"] == "1"  # no generation finished here yet
        with pytest.raises(RuntimeError, match=r"max_pending_generations=2"):
            app_handle("bounded").generate.remote({**QUICK, "seed": 6003}).result(timeout_s=60)
        r = requests.post(f"{url}/v1/generations", json={**QUICK, "steps": "many"}, timeout=60)
        assert r.status_code == 422  # bad input is still told so first
        assert [f.result(timeout=120) for f in running] == [(200, "result")] * 2
    stats = worker_stats("bounded")
    assert 6002 not in stats["steps"] and 6003 not in stats["steps"]  # refused ones never reached the worker
    r = requests.post(f"{url}/v1/generations", json={**QUICK, "seed": 6004}, timeout=60)
    assert r.status_code == 200, r.text  # the slots came back
    serve.delete("bounded")
