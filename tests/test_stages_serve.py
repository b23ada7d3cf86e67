"""`stages: split` through Ray Serve on CPU with the tiny real checkpoint: TextEncoder -> Worker (denoiser) ->
Decoder give the same latents and the same MP4 bytes as the fused Worker, on the research route and as a video
job (whose MP4 the Decoder uploads), and a job's timings name every stage.

One cluster for the module; the fused and the split app are deployed side by side on the same checkpoint.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator

import pytest
import requests
import torch

from deployments.schemas import decode_latents
from tests.serve_helpers import run_app, serve_cluster, serve_config_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # slow: Ray + Serve: split stages

GEOMETRY = {"short_edge": None, "max_pixels": 128 * 128, "min_seconds": 0.2, "max_seconds": 5.0}
GENERATION = {"prompt": "a red fox in snow", "steps": 4, "seconds": 1.0, "width": 96, "height": 64, "seed": 7,
              "return_video": True, "return_latents": True}
VIDEO = {"prompt": "a red fox in snow", "seconds": 1.0, "size": "96x64", "num_inference_steps": 4, "seed": 7}
STAGES = ("fused", "split")


@pytest.fixture(scope="module")
def apps(tmp_path_factory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("stages")
    # fused: ingress + worker; split: ingress + worker + text encoder + decoder (0.5 CPU each)
    with serve_cluster(num_cpus=6) as url:
        urls = {}
        for stages in STAGES:
            args = serve_config_args(root / "checkpoints")
            args["stages"] = stages
            args["engine"]["device"] = "cpu"
            args["engine"]["geometry"] = GEOMETRY
            args["jobs"].update({"state_dir": str(root / f"state-{stages}"), "poll_s": 0.2, "events_poll_s": 0.2})
            run_app(url, args, name=stages, route_prefix=f"/{stages}")
            urls[stages] = f"{url}/{stages}"
        yield urls


def test_the_builder_binds_three_stage_deployments_when_split(apps):
    from ray import serve

    deployments = {stages: set(serve.status().applications[stages].deployments) for stages in STAGES}
    assert deployments == {"fused": {"Ingress", "Worker"}, "split": {"Ingress", "Worker", "TextEncoder", "Decoder"}}


@pytest.mark.parametrize("stages, deployment", [("fused", "Worker"), ("split", "Worker"), ("split", "TextEncoder"),
                                               ("split", "Decoder")])
def test_every_replica_reports_its_start_up_timeline_in_order(apps, stages, deployment):
    """Wall-clock times from the replica's own process: our first import, the module's imports done, the
    constructor, the build, ready, in that order; a real engine's imports and build take time."""
    from ray import serve

    from engine.startup import ReplicaStartup

    card = serve.get_deployment_handle(deployment, stages).describe.remote().result(timeout_s=60)
    startup = ReplicaStartup.from_dict(card["startup"])
    assert startup.role == {"Worker": "worker", "TextEncoder": "text_encoder", "Decoder": "decoder"}[deployment]
    timeline = startup.timeline()
    assert list(timeline) == sorted(timeline) and timeline[-1] <= time.time()
    assert startup.process_started_at <= startup.import_started_at  # the replica's own process, not the driver's
    assert startup.import_s > 0 and startup.build_s > 0
    assert startup.constructor_s >= startup.imports_s + startup.build_s - 1e-6  # both lie inside the constructor
    assert (startup.engine is not None) == (deployment == "Worker")


def test_split_stages_give_the_fused_latents_and_mp4_bytes(apps):
    results = {}
    for stages, url in apps.items():
        r = requests.post(f"{url}/v1/generations", json=GENERATION, timeout=300)
        assert r.status_code == 200, r.text
        results[stages] = r.json()
    fused, split = results["fused"], results["split"]
    fused_latents, split_latents = decode_latents(fused["latents"]), decode_latents(split["latents"])
    for name in ("video", "audio"):
        assert split_latents[name].shape == fused_latents[name].shape
        assert split_latents[name].equal(fused_latents[name]), name  # bit for bit
    assert base64.b64decode(split["video_mp4"]) == base64.b64decode(fused["video_mp4"])
    assert split["preview_png"] == fused["preview_png"] and split["model"] == fused["model"]
    for key in ("encode_s", "plan_s", "denoise_s", "decode_s", "mux_s"):
        assert split["timings"][key] > 0, key


@pytest.mark.parametrize("stages", STAGES)
def test_serve_timings_nest_each_hop_in_the_one_around_it(apps, stages):
    """ingress >= its stage calls + the response's encoding; each stage call >= the work the stage reported.
    Split: the ingress called the TextEncoder and the Decoder itself; fused: the worker's engine ran them (None)."""
    r = requests.post(f"{apps[stages]}/v1/generations", json=GENERATION, timeout=300)
    assert r.status_code == 200, r.text
    timings, serve = r.json()["timings"], r.json()["serve_timings"]
    engine_work = timings["plan_s"] + timings["denoise_s"]
    if stages == "split":
        assert serve["encode_call_s"] >= timings["encode_s"] > 0
        assert serve["decode_call_s"] >= timings["decode_s"] + timings["mux_s"] > 0
    else:
        assert serve["encode_call_s"] is None and serve["decode_call_s"] is None
        engine_work += timings["encode_s"] + timings["decode_s"] + timings["mux_s"]
    assert serve["engine_call_s"] >= engine_work > 0
    calls = serve["engine_call_s"] + (serve["encode_call_s"] or 0) + (serve["decode_call_s"] or 0)
    assert serve["ingress_s"] >= calls + serve["respond_s"] and serve["respond_s"] > 0


def test_the_split_worker_is_a_pure_denoiser_answering_latents_for_the_text_encoders_embedding(apps):
    """The pipeline's middle step, called as the ingress calls it: the TextEncoder's embedding in, progress per
    forward, then latents and no MP4 (the Decoder makes it): the worker's slot covers denoising only."""
    from ray import serve

    from deployments.schemas import GenerationRequest, ProgressEvent
    from engine.api import GenerationResult

    request = GenerationRequest(**GENERATION)
    embedding = serve.get_deployment_handle("TextEncoder", "split").encode.remote(request).result(timeout_s=300)
    stream = serve.get_deployment_handle("Worker", "split").options(stream=True).denoise_stream.remote(
        request, embedding, schedule_key=request.schedule_key)
    events = list(stream)
    steps = [event.step for event in events if isinstance(event, ProgressEvent)]
    assert steps == list(range(request.steps))  # accepted (0), then one per forward
    result = events[-1]
    assert isinstance(result, GenerationResult) and result.mp4 is None and result.clip is None
    assert result.video.ndim == 4 and result.audio.ndim == 2
    assert result.timings.encode_s == 0.0 and result.timings.denoise_s > 0


def test_a_unary_denoise_answers_the_result_with_the_bits_of_the_followed_stream(apps):
    """A caller that follows no progress (`/v1/generations` without stream) makes a unary call (`Worker.denoise`):
    the result itself, the same latents as the streamed call's last item."""
    from ray import serve

    from deployments.schemas import GenerationRequest
    from engine.api import GenerationResult

    request = GenerationRequest(**GENERATION)
    embedding = serve.get_deployment_handle("TextEncoder", "split").encode.remote(request).result(timeout_s=300)
    worker = serve.get_deployment_handle("Worker", "split")
    quiet = worker.denoise.remote(request, embedding, schedule_key=request.schedule_key).result(timeout_s=300)
    followed = list(worker.options(stream=True).denoise_stream.remote(request, embedding,
                                                                      schedule_key=request.schedule_key))
    assert isinstance(quiet, GenerationResult) and len(followed) == request.steps + 1
    assert torch.equal(quiet.video, followed[-1].video) and torch.equal(quiet.audio, followed[-1].audio)


def test_a_split_video_job_stores_the_fused_mp4_and_times_every_stage(apps):
    jobs = {}
    for stages, url in apps.items():
        r = requests.post(f"{url}/v1/videos", json=VIDEO, timeout=60)
        assert r.status_code == 200, r.text
        jobs[stages] = wait_finished(url, r.json()["id"])
    contents = {}
    for stages, job in jobs.items():
        assert job["status"] == "completed", job
        r = requests.get(f"{apps[stages]}/v1/videos/{job['id']}/content", timeout=30)
        assert r.status_code == 200
        contents[stages] = r.content
    assert contents["split"] == contents["fused"]
    timings = jobs["split"]["timings"]
    for key in ("encode_s", "plan_s", "denoise_s", "decode_s", "mux_s", "upload_s"):
        assert timings[key] > 0, (key, timings)
    # the job's run holds its stages' work and what each call waited beyond it (and the backend's own few steps)
    waits = timings["encode_wait_s"] + timings["denoise_wait_s"] + timings["decode_wait_s"]
    stage_sum = sum(timings[k] for k in ("encode_s", "plan_s", "denoise_s", "decode_s", "mux_s", "upload_s"))
    assert timings["total_s"] >= stage_sum + waits - 1e-6 and min(waits, timings["denoise_wait_s"]) > 0
    assert jobs["split"]["progress"] == 100


def wait_finished(url: str, job_id: str, timeout_s: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        r = requests.get(f"{url}/v1/videos/{job_id}", timeout=30)
        assert r.status_code == 200, r.text
        if r.json()["status"] in ("completed", "failed", "cancelled"):
            return r.json()
        assert time.monotonic() < deadline, f"job {job_id} did not finish: {r.json()}"
        time.sleep(0.2)


# --- Placement and errors (no cluster) -----------------------------------------------------------------------


@pytest.mark.parametrize("gpus_in_cluster, worker, stage, worker_max", [
    (0, 0.0, 0.0, 1),   # CPU: no GPU asked, one replica each
    (1, 0.6, 0.2, 1),   # one H200: the three stages share it, one worker
    (8, 0.6, 0.2, 8),   # a node: one worker per device (0.6 keeps a second one off), stages beside them
])
def test_split_stages_share_each_device_by_fractions(gpus_in_cluster, worker, stage, worker_max):
    from deployments.app import stage_deployment_options, worker_deployment_options
    from deployments.schemas import AppConfig

    config = AppConfig()
    worker_options = worker_deployment_options(config.worker, gpus_in_cluster, config.engine, split=True)
    stage_options = stage_deployment_options(config.text_encoder, gpus_in_cluster)
    assert worker_options["ray_actor_options"]["num_gpus"] == worker
    assert stage_options["ray_actor_options"]["num_gpus"] == stage
    assert worker + 2 * stage <= 1.0  # the default config fits one device
    assert worker_options["autoscaling_config"]["max_replicas"] == worker_max
    assert stage_options["autoscaling_config"]["max_replicas"] == max(1, gpus_in_cluster)


@pytest.mark.parametrize("make_error", [
    lambda: __import__("ray.exceptions", fromlist=["ActorDiedError"]).ActorDiedError(),
    lambda: __import__("ray.exceptions", fromlist=["ActorUnavailableError"]).ActorUnavailableError("gone", None),
    # a multi-GPU replica that lost a rank fails its running and queued jobs this way while Serve replaces it
    lambda: __import__("engine.errors", fromlist=["ServerFault"]).ServerFault(
        "parallel replica unusable: generate: rank 1 of 2 died",
        __import__("engine.errors", fromlist=["FaultCause"]).FaultCause.RANK_FAILURE),
])
def test_a_replica_that_died_is_a_lost_worker_for_the_retry_rule(make_error):
    from deployments.video_backend import backend_error
    from jobs.backend import VideoWorkerLost

    assert isinstance(backend_error(make_error(), cancel_asked=False), VideoWorkerLost)
