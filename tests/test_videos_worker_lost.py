"""A Worker replica killed inside the running app (`serve run` of serve_config.yaml's args with `stages: fused`,
the real engine on the tiny MiniMax-H3 checkpoint on CPU, SQLite): the job service's retry rule for a worker
that died, end to end. (Fused: the Worker is what dies either way, and split's TextEncoder and Decoder replicas
would add ~12 core-seconds; the split app's worker loss mid-request: test_reliability_http.)

One kill, two jobs on the replica (`jobs.concurrency: 2`): job A is denoising (some steps done), job B's
`denoise_stream` is queued on the replica's engine thread behind it (accepted, no step run). When the replica
dies:
- A ends `failed` with code `worker_lost`, its message naming the step it was lost at; it never stays
  `in_progress`;
- B runs again (its first run never reached a step) on the replica Serve starts in place of the dead one,
  and completes on its second run;
- the app keeps serving: a job created afterwards completes on its first run.

B's position is observed, not assumed: the replica's `debug_stats()["last_request"]` is the request its engine
thread was last given, so B's step count there means B is on the replica, waiting behind A.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests

from tests.serve_helpers import APP_NAME, run_app, serve_cluster, serve_config_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.ray]  # slow: Ray + Serve: a worker lost mid-job

GEOMETRY = {"short_edge": None, "max_pixels": 128 * 128, "min_seconds": 0.2, "max_seconds": 5.0}
# 64 forwards on ~900 tokens (4 s -> 97 frames, snapped to 107): many seconds of CPU work, so the replica is
# still denoising A when B has reached it.
RUNNING = {"prompt": "a long walk on the beach", "seconds": 4.0, "size": "128x128", "num_inference_steps": 65,
           "seed": 9}
# 4 grid points: 3 forwards. Its forward count (3) tells it apart from A's (64) in the replica's debug stats.
WAITING = {"prompt": "a red fox in snow", "seconds": 1.0, "size": "96x64", "num_inference_steps": 4, "seed": 3}
FINISHED = ("completed", "failed", "cancelled")
# "the replica running it died (ActorDiedError)": Ray names a dead actor's calls ActorDiedError, or
# ActorUnavailableError while it cannot tell yet (both RayActorError).
DIED = r"the replica running it died \((ActorDiedError|ActorUnavailableError)\)"


@dataclass(frozen=True)
class Killed:
    """What the one kill of the module left behind."""

    running: dict  # job A, finished
    waiting: dict  # job B, finished
    progress_at_kill: int  # A's progress (percent of its 64 steps) seen before the kill
    old_replica: str
    new_replica: str
    url: str


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    with serve_cluster() as url:
        yield url


@pytest.fixture(scope="module")
def url(cluster_url, tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("worker-lost")
    args = serve_config_args(root / "checkpoints")
    args["stages"] = "fused"  # module docstring
    args["engine"]["device"] = "cpu"
    args["engine"]["geometry"] = GEOMETRY
    # Two runners: B is claimed while A denoises. The lease (6 s, heartbeats every 2 s) never expires on a busy
    # 2-core machine, so the service itself (not the reaper) settles both jobs.
    args["jobs"].update({"state_dir": str(root / "state"), "concurrency": 2, "lease_s": 6.0,
                         "reap_interval_s": 0.5, "poll_s": 0.2, "events_poll_s": 0.2})
    run_app(cluster_url, args)
    wait_videos_ready(cluster_url)
    yield cluster_url


@pytest.fixture(scope="module")
def killed(url) -> Killed:
    import ray

    (old,) = worker_replicas()
    running = create(url, RUNNING)
    job_a = wait_running(url, running)
    waiting = create(url, WAITING)
    job_a = wait_queued_on_replica(url, running, waiting)
    ray.kill(ray.get_actor(old["name"], namespace=old["namespace"]), no_restart=True)

    running_done, waiting_done = wait_finished(url, running), wait_finished(url, waiting)
    (new,) = wait_replaced(old["name"])
    return Killed(running_done, waiting_done, job_a["progress"], old["name"], new["name"], url)


# --------------------------------------------------------------------------------------------------
# The specification
# --------------------------------------------------------------------------------------------------


def test_a_job_whose_worker_dies_mid_run_fails_naming_the_step(killed):
    job = killed.running
    assert job["status"] == "failed" and job["error"]["code"] == "worker_lost", job
    match = re.fullmatch(rf"lost at step (\d+)/64 of run 1: {DIED}", job["error"]["message"])
    assert match is not None, job["error"]
    # The step named is the last one the runner saw: not before what the job showed at the kill, never the end.
    step = int(match.group(1))
    assert 0 < killed.progress_at_kill <= job["progress"] <= step * 100 // 64 and step < 64
    assert job["attempts"] == 1  # failed, not retried: steps had run
    assert requests.get(f"{killed.url}/v1/videos/{job['id']}/content", timeout=30).status_code == 409


def test_a_job_whose_worker_dies_before_its_first_step_runs_again_and_completes(killed):
    job = killed.waiting
    assert job["status"] == "completed" and job["error"] is None, job
    assert job["attempts"] == 2 and job["progress"] == 100  # the lost run, then the one that completed
    r = requests.get(f"{killed.url}/v1/videos/{job['id']}/content", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4" and len(r.content) > 0


def test_serve_replaces_the_dead_worker_and_the_app_keeps_serving(killed):
    assert killed.new_replica != killed.old_replica
    after = wait_finished(killed.url, create(killed.url, {**WAITING, "seed": 4}))
    assert after["status"] == "completed" and after["attempts"] == 1, after
    assert worker_stats()["replica"] in killed.new_replica  # served by the new replica


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def create(url: str, body: dict) -> str:
    r = requests.post(f"{url}/v1/videos", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def get_job(url: str, job_id: str) -> dict:
    r = requests.get(f"{url}/v1/videos/{job_id}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_videos_ready(url: str, timeout_s: float = 120.0) -> None:
    """The video routes answer 503 until the ingress replica's job service started."""
    deadline = time.monotonic() + timeout_s
    while requests.get(f"{url}/v1/videos?limit=1", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "/v1/videos not ready"
        time.sleep(0.3)


def wait_running(url: str, job_id: str, timeout_s: float = 60.0) -> dict:
    """Until the job has denoising steps recorded (progress is percent: 2 of 64 steps show as 3)."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = get_job(url, job_id)
        if job["status"] == "in_progress" and job["progress"] > 0:
            return job
        assert job["status"] in ("queued", "in_progress"), job
        assert time.monotonic() < deadline, f"job {job_id} never ran a step: {job}"
        time.sleep(0.05)


def wait_queued_on_replica(url: str, running: str, waiting: str, timeout_s: float = 60.0) -> dict:
    """Until the replica's engine thread has been given `waiting` (3 forwards) while `running` still denoises;
    returns `running`'s job then."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = worker_stats()["last_request"]
        job_a, job_b = get_job(url, running), get_job(url, waiting)
        assert job_a["status"] == "in_progress", f"A ended before B reached the replica: {job_a}"
        if last.get("steps") == WAITING["num_inference_steps"] - 1:
            assert last["step"] == 0 and job_b["status"] == "in_progress" and job_b["progress"] == 0, (last, job_b)
            return job_a
        assert time.monotonic() < deadline, f"B never reached the replica: {last}, {job_b}"
        time.sleep(0.05)


def wait_finished(url: str, job_id: str, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (job := get_job(url, job_id))["status"] not in FINISHED:
        assert time.monotonic() < deadline, f"job {job_id} did not finish: {job}"
        time.sleep(0.2)
    return job


def worker_replicas() -> list[dict]:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and f"{APP_NAME}#Worker#" in a["name"]]


def wait_replaced(old_name: str, timeout_s: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while not ((replicas := worker_replicas()) and all(r["name"] != old_name for r in replicas)):
        assert time.monotonic() < deadline, f"the killed replica {old_name} was not replaced"
        time.sleep(0.5)
    return replicas


def worker_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Worker", app_name=APP_NAME).debug_stats.remote().result(timeout_s=30)
