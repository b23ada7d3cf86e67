"""`/v1/videos` through the real app (`serve run` of serve_config.yaml's args, fused: split jobs run in
tests/test_split_fused_serve.py and test_videos_worker_lost.py), the real engine on a tiny
MiniMax-H3 checkpoint on CPU, on the default store (SQLite under `jobs.state_dir`). The store is behind the job
service: replicas sharing a database, a replica killed mid-job and a restart run against SQLite and a real
PostgreSQL server in tests/test_jobs_service.py; a second app start on PostgreSQL here would test no other code.

The flow a client sees: create -> poll to completed -> download a playable MP4 (H.264 + AAC, the requested
size, the snapped duration) -> Range requests -> list -> cancel mid-run (the worker's engine stops early)
-> delete -> sync; and the ingress replica killed while a job runs: Serve restarts it, the new replica
resumes from the database, the running job fails with the reaper's cause and the queued one completes.
The first tests check the pieces between the job layer and the engine without Ray.

Clip arithmetic used below (model.geometry): 1.0 s at 24 fps asks for round(24) + 1 = 25 frames, snapped up
to 17n + 5 = 39 frames = 1.625 s; a 5 s clip asks for 121 frames, snapped to 124 = 5.1667 s, over this
server's max_seconds of 5.
"""

from __future__ import annotations

import io
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import av
import numpy as np
import pytest
import requests
import torch
from fastapi.testclient import TestClient
from PIL import Image

from deployments.schemas import HIGH_QUALITY_CACHE_DIT, AppConfig
from deployments.video_backend import (
    LOSSLESS_CACHE_DIT,
    ModelCard,
    generation_request,
    invalid_request,
    video_output,
)
from deployments.videos import VideoApi, build_videos_app
from engine.config import EngineConfig
from engine.model_limits import H3_HIDDEN_SIZE, model_limits
from engine.errors import ClientError
from engine.api import AdalnStats, CacheDitStats, ClipFacts, GenerationResult, GenerationStats, GenerationTimings
from engine.pipeline import PipelineResult, StageCallTimes
from jobs.backend import VideoSpec, VideoStats, VideoTimings
from jobs.config import AuthConfig, JobsConfig
from jobs.errors import InvalidVideoRequest
from jobs.limits import resolve_spec
from jobs.schemas import VideoCreateRequest
from jobs.service import open_job_service
from jobs.store import REAP_CAUSE, RELEASE_CAUSE
from tests.jobs_support import FakeVideoBackend
from model.mp4 import thumbnail_png, write_mp4
from tests.serve_helpers import APP_NAME, run_app, serve_cluster, serve_config_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.ray]  # slow: Ray + Serve, SQLite and PostgreSQL: video jobs

GEOMETRY = {"short_edge": None, "max_pixels": 128 * 128, "min_seconds": 0.2, "max_seconds": 5.0}
SMALL = {"prompt": "a red fox in snow", "seconds": 1.0, "size": "96x64", "num_inference_steps": 4, "seed": 3}
SMALL_FRAMES, SMALL_DURATION_S = 39, 1.625
# 64 forwards on ~900 tokens (4 s -> 97 frames, snapped to 107): seconds of CPU work, long enough to cancel or
# kill in the middle.
LONG = {"prompt": "a long walk on the beach", "seconds": 4.0, "size": "128x128", "num_inference_steps": 65, "seed": 9}
LEASE_S = 6.0  # heartbeats every 2 s: a busy 2-core machine never loses a live job's lease
FINISHED = ("completed", "failed", "cancelled")


# --------------------------------------------------------------------------------------------------
# Between the job layer and the engine (no Ray)
# --------------------------------------------------------------------------------------------------


def card(short_edge: int | None, max_pixels: int, min_seconds: float = 5.0, max_seconds: float = 15.0) -> ModelCard:
    """What a worker's describe() gives the video API for an engine serving this geometry."""
    geometry = {"short_edge": short_edge, "max_pixels": max_pixels, "min_seconds": min_seconds,
                "max_seconds": max_seconds}
    limits = model_limits(EngineConfig(geometry=geometry), H3_HIDDEN_SIZE)
    described = {"id": "minimax-h3@0123456789abcdef", "limits": limits.model_dump(mode="json"),
                 "engine_config": {"cache_dit": {"enabled": False}}}
    return ModelCard.from_describe(described)


def test_h3_limits_come_from_the_model_card():
    limits = card(short_edge=768, max_pixels=768 * 1344).limits
    assert limits.name == "minimax-h3"  # stable across weight updates: no fingerprint
    assert (limits.short_edge, limits.min_edge, limits.max_edge, limits.max_pixels) == (768, 768, 1344, 768 * 1344)
    assert (limits.default_size, limits.default_seconds, limits.default_steps) == ("1344x768", 5.0, 50)
    assert (limits.min_seconds, limits.max_seconds, limits.min_steps, limits.max_steps) == (5.0, 15.0, 2, 65)
    assert (limits.default_flow_shift, limits.default_audio_flow_shift) == (12.0, 3.0)


def test_a_small_model_gets_small_sizes_and_a_default_that_fits():
    limits = card(short_edge=None, max_pixels=128 * 128, min_seconds=0.2, max_seconds=5.0).limits
    # Largest 16:9 frame within 128*128 pixels in 32-px multiples: 96 x (170 -> 160).
    assert (limits.short_edge, limits.min_edge, limits.max_edge, limits.default_size) == (None, 32, 512, "160x96")
    # 5 s would snap to 5.17 s: the default is the longest clip within 5 s (107 frames, no snapping).
    assert (limits.min_seconds, limits.default_seconds, limits.max_seconds) == (0.2, 106 / 24, 5.0)


@pytest.mark.parametrize("size, message", [
    ("800x800", "800x800: the short edge 800 is not the model's short_edge=768"),
    ("1344x800", "1344x800: the short edge 800 is not the model's short_edge=768"),
    ("1408x768", "1408x768: 1408 exceeds the model's max_edge=1344"),
])
def test_h3_limits_refuse_any_short_edge_but_768(size, message):
    limits = card(short_edge=768, max_pixels=768 * 1344).limits
    with pytest.raises(InvalidVideoRequest) as refused:
        resolve_spec(VideoCreateRequest(prompt="a fox", size=size), limits)
    assert str(refused.value) == f"size: {message}"
    assert resolve_spec(VideoCreateRequest(prompt="a fox", size="768x1344"), limits).size == "768x1344"


def test_a_request_the_backend_refuses_is_never_queued(tmp_path):
    # The tokenizer's check (prompt tokens) runs before the job is stored: a 422, no job.
    limits = card(short_edge=None, max_pixels=128 * 128, min_seconds=0.2, max_seconds=5.0).limits
    service = open_job_service(JobsConfig(state_dir=str(tmp_path)), FakeVideoBackend(), [limits])
    with TestClient(build_videos_app(VideoApi(service=service, auth=AuthConfig()))) as client:
        refused = client.post("/v1/videos", json={**SMALL, "prompt": "invalid: far too many tokens"})
        assert refused.status_code == 422
        assert refused.json()["error"]["message"] == "prompt: 28 tokens exceed the text encoder's 8 (fake)"
        assert client.get("/v1/videos").json()["data"] == []
        assert client.post("/v1/videos", json=SMALL).status_code == 200


def spec(**overrides) -> VideoSpec:
    fields = dict(model="minimax-h3", prompt="a fox", seconds=1.0, width=96, height=64, num_inference_steps=4, seed=3,
                  flow_shift=12.0, audio_flow_shift=3.0, quality="lossless")
    return VideoSpec(**{**fields, **overrides})


@pytest.mark.parametrize("quality, cache_dit", [("lossless", LOSSLESS_CACHE_DIT), ("high", HIGH_QUALITY_CACHE_DIT)])
def test_a_video_spec_becomes_an_mp4_request_with_the_quality_profile(quality, cache_dit):
    request = generation_request(spec(quality=quality), AppConfig().videos.high_quality)
    assert (request.prompt, request.steps, request.seconds, request.width, request.height) == ("a fox", 4, 1.0, 96, 64)
    assert (request.flow_shift, request.audio_flow_shift, request.seed) == (12.0, 3.0, 3)
    assert request.return_video and not request.return_latents
    assert request.cache_dit == cache_dit


def test_high_quality_is_the_measured_f1b0_w4_r004_mc1_profile():
    profile = AppConfig().videos.high_quality
    assert profile.enabled and (profile.Fn_compute_blocks, profile.Bn_compute_blocks) == (1, 0)
    assert (profile.max_warmup_steps, profile.residual_diff_threshold, profile.max_continuous_cached_steps) == (4, 0.04, 1)
    with pytest.raises(ValueError, match="high_quality.enabled must be true"):
        AppConfig.model_validate({"videos": {"high_quality": {"enabled": False}}})


@pytest.mark.parametrize("error, field, message", [
    (ClientError("prompt", "3000 tokens exceeds this server's max_prompt_tokens=2048; shorten the prompt"), "prompt",
     "prompt: 3000 tokens exceeds this server's max_prompt_tokens=2048; shorten the prompt"),
    (ClientError("steps", "66 exceeds this server's max_steps=65"), "num_inference_steps",
     "num_inference_steps: 66 exceeds this server's max_steps=65"),
    (ClientError("seconds", "16.0 is out of range: snaps to 396 frames"), "seconds",
     "seconds: 16.0 is out of range: snaps to 396 frames"),
    (ClientError("width", "1536x768 = 1179648 px is out of range: must be <= 1032192 px"), "size",
     "size: 1536x768 = 1179648 px is out of range: must be <= 1032192 px"),
    (ClientError("cache_dit", "Cache-DiT is off on this server"), "quality", "quality: Cache-DiT is off on this server"),
    (ClientError("guidance_scale", "a field jobs never send"), "request", "request: a field jobs never send"),
])
def test_engine_refusals_name_the_video_api_field(error, field, message):
    """From the error's typed field, never from its message."""
    refused = invalid_request(error)
    assert isinstance(refused, InvalidVideoRequest) and refused.field == field and str(refused) == message


class CheckCall:
    """A handle method's `.remote(...)` that records the call and answers (or raises) like the replica."""

    def __init__(self, calls: list, name: str, error: Exception | None) -> None:
        self.calls, self.name, self.error = calls, name, error

    def remote(self, *args):
        self.calls.append((self.name, args))

        async def answer():
            if self.error is not None:
                raise self.error
            return 8

        return answer()


class CheckingHandle:
    def __init__(self, calls: list, name: str, error: Exception | None = None) -> None:
        self.validate = CheckCall(calls, f"{name}.validate", error)


@pytest.mark.parametrize("split", [False, True])
def test_a_job_is_checked_at_creation_by_one_call_to_what_holds_the_tokenizer(split):
    """Sizes, duration and steps were checked against the served limits already: the backend asks one replica,
    the fused Worker or (split) the TextEncoder, never both."""
    import asyncio

    from deployments.generation import runner_for
    from deployments.video_backend import PipelineVideoBackend

    calls: list = []
    refusal = ClientError("prompt", "3000 tokens exceeds this server's max_prompt_tokens=2048; shorten the prompt")
    for error in (None, refusal):
        calls.clear()
        worker = CheckingHandle(calls, "worker", None if split else error)
        text_encoder = CheckingHandle(calls, "text_encoder", error if split else None)
        the_card = card(short_edge=None, max_pixels=128 * 128, min_seconds=0.2, max_seconds=5.0)
        runner = (runner_for(worker, text_encoder, CheckingHandle(calls, "decoder")) if split
                  else runner_for(worker, None, None))
        backend = PipelineVideoBackend(runner, the_card, LOSSLESS_CACHE_DIT, 5.0)
        if error is None:
            asyncio.run(backend.validate(spec()))
        else:
            with pytest.raises(InvalidVideoRequest) as refused:
                asyncio.run(backend.validate(spec()))
            assert (refused.value.field, str(refused.value)) == ("prompt", str(refusal))
        assert [name for name, _ in calls] == ["text_encoder.validate" if split else "worker.validate"]


@pytest.mark.parametrize("split", [False, True])
def test_a_video_output_reads_the_engines_typed_timings_stats_and_clip(split):
    """The clip's facts come from the decoder (no MP4 re-opened); each call's wait is what it took beyond the
    stage work it ran (a fused worker call ran every stage)."""
    frames = np.zeros((24, 32, 32, 3), dtype=np.uint8)
    mp4 = io.BytesIO()
    write_mp4(mp4, frames, 24, np.zeros((2, 32000), dtype=np.float32), 32000)
    adaln = AdalnStats(requests=1, gpu_hit_plans=1, host_hit_plans=2, pool_hit_plans=3, built_plans=4)
    stats = GenerationStats(steps=11, forwards=10, frames=24, tokens=100, text_tokens=8, adaln_mode="online",
                            schedule_key="k", adaln=adaln,
                            cache_dit=CacheDitStats(config="F1B0", num_inference_steps=10, cached_steps=[5, 7]))
    timings = GenerationTimings(plan_s=1.0, encode_s=2.0, denoise_s=3.0, decode_s=4.0, mux_s=5.0, total_s=15.0)
    result = GenerationResult(video=torch.zeros(1), audio=torch.zeros(1), seed=1, model="m", timings=timings,
                              stats=stats, mp4=mp4.getvalue(), thumbnail_png=thumbnail_png(frames[0]),
                              clip=ClipFacts(num_frames=24, fps=24.0, sample_rate=32000))
    calls = (StageCallTimes(encode_call_s=2.5, denoise_call_s=4.25, decode_call_s=9.5) if split
             else StageCallTimes(encode_call_s=None, denoise_call_s=15.75, decode_call_s=None))
    output = video_output(PipelineResult(result, calls), total_s=16.5)
    waits = {"encode_wait_s": 0.5, "denoise_wait_s": 0.25, "decode_wait_s": 0.5} if split else \
        {"encode_wait_s": 0.0, "denoise_wait_s": 0.75, "decode_wait_s": 0.0}
    assert output.timings == VideoTimings(plan_s=1.0, encode_s=2.0, denoise_s=3.0, decode_s=4.0, mux_s=5.0,
                                          total_s=16.5, **waits)
    assert output.stats == VideoStats(num_steps=10, num_frames=24, fps=24.0, audio_sample_rate=32000,
                                      plan_cache_hits=6, plan_cache_misses=4, cached_steps=2)
    # Resident AdaLN (no plan cache) and Cache-DiT off: nothing cached, nothing rebuilt.
    result.stats = stats.model_copy(update={"adaln": None, "cache_dit": None})
    resident = video_output(PipelineResult(result, calls), total_s=16.5).stats
    assert (resident.plan_cache_hits, resident.plan_cache_misses, resident.cached_steps) == (0, 0, 0)


# --------------------------------------------------------------------------------------------------
# The real app
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class App:
    url: str
    args: dict  # the app's serve_config args, as deployed

    def videos(self, path: str = "") -> str:
        return f"{self.url}/v1/videos{path}"


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    with serve_cluster() as url:
        yield url


@pytest.fixture(scope="module")
def app(cluster_url, tmp_path_factory) -> Iterator[App]:
    root = tmp_path_factory.mktemp("videos")
    args = serve_config_args(root / "checkpoints")
    args["stages"] = "fused"
    args["engine"]["device"] = "cpu"
    args["engine"]["geometry"] = GEOMETRY
    args["jobs"].update({"state_dir": str(root / "state"), "lease_s": LEASE_S, "reap_interval_s": 0.5,
                         "poll_s": 0.2, "events_poll_s": 0.2})
    run_app(cluster_url, args)
    app = App(cluster_url, args)
    wait_videos_ready(app)
    yield app
    from ray import serve

    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def completed(app) -> dict:
    """A SMALL job, run to completion once."""
    r = requests.post(app.videos(), json=SMALL, timeout=60)
    assert r.status_code == 200, r.text
    return wait_finished(app, r.json()["id"])


def wait_videos_ready(app: App, timeout_s: float = 120.0) -> None:
    """The video routes answer 503 until the replica's job service started."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = requests.get(app.videos("?limit=1"), timeout=10)
            if r.status_code == 200:
                return
        except requests.RequestException as exc:
            r = exc
        assert time.monotonic() < deadline, f"/v1/videos not ready: {r!r}"
        time.sleep(0.3)


def get_job(app: App, job_id: str) -> dict:
    r = requests.get(app.videos(f"/{job_id}"), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_finished(app: App, job_id: str, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = requests.get(app.videos(f"/{job_id}"), timeout=10)
            if r.status_code == 200 and r.json()["status"] in FINISHED:
                return r.json()
        except requests.RequestException:  # the ingress is restarting
            pass
        assert time.monotonic() < deadline, f"job {job_id} did not finish"
        time.sleep(0.2)


def wait_running(app: App, job_id: str, timeout_s: float = 60.0) -> dict:
    """Until the job has at least one denoising step recorded."""
    deadline = time.monotonic() + timeout_s
    while True:
        job = get_job(app, job_id)
        if job["status"] == "in_progress" and job["progress"] > 0:
            return job
        assert job["status"] in ("queued", "in_progress"), job
        assert time.monotonic() < deadline, f"job {job_id} never ran a step: {job}"
        time.sleep(0.05)


def sse_events(response: requests.Response) -> Iterator[tuple[str, dict]]:
    event = None
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield event, json.loads(line.removeprefix("data: "))


def worker_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Worker", app_name=APP_NAME).debug_stats.remote().result(timeout_s=30)


def probe_mp4(data: bytes) -> dict:
    with av.open(io.BytesIO(data)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        return {
            "video": (video.codec_context.name, video.width, video.height, video.frames, float(video.average_rate)),
            "audio": (audio.codec_context.name, audio.rate, audio.channels),
            "video_s": float(video.duration * video.time_base),
            "audio_s": float(audio.duration * audio.time_base),
            "decoded_frames": sum(1 for _ in container.decode(video=0)),
        }


def test_a_job_completes_with_a_playable_mp4_of_the_requested_size_and_duration(app, completed):
    assert completed["status"] == "completed" and completed["progress"] == 100 and completed["error"] is None
    assert (completed["model"], completed["size"], completed["seconds"], completed["quality"]) == (
        "minimax-h3", "96x64", "1", "lossless")
    assert completed["stats"]["num_steps"] == 3  # 4 grid points: 3 transformer forwards
    assert (completed["stats"]["num_frames"], completed["stats"]["fps"]) == (SMALL_FRAMES, 24.0)
    assert completed["stats"]["audio_sample_rate"] == 32000
    assert completed["timings"]["total_s"] >= completed["timings"]["denoise_s"] > 0
    assert completed["completed_at"] >= completed["created_at"] and completed["expires_at"] > completed["completed_at"]

    r = requests.get(app.videos(f"/{completed['id']}/content"), timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    assert int(r.headers["content-length"]) == len(r.content) and r.headers["accept-ranges"] == "bytes"
    mp4 = probe_mp4(r.content)
    assert mp4["video"] == ("h264", 96, 64, SMALL_FRAMES, 24.0) and mp4["decoded_frames"] == SMALL_FRAMES
    assert mp4["audio"] == ("aac", 32000, 2)
    assert mp4["video_s"] == pytest.approx(SMALL_DURATION_S)
    assert mp4["audio_s"] == pytest.approx(SMALL_DURATION_S, abs=1024 / 32000)  # one AAC frame

    thumbnail = requests.get(app.videos(f"/{completed['id']}/content?variant=thumbnail"), timeout=30)
    assert thumbnail.status_code == 200 and thumbnail.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(thumbnail.content)).size == (96, 64)


def test_a_job_naming_the_shipped_adapter_runs_its_steps_and_an_unknown_one_is_a_422_listing_it(app):
    """The issue's "done when" on the quick start: serve_config.yaml's `turbo-tiny` (path "": made on first start
    beside the auto-made checkpoint) gives a job that leaves num_inference_steps out the adapter's steps."""
    served = app.args["engine"]["adapters"]
    assert list(served) == ["turbo-tiny"] and served["turbo-tiny"]["path"] == ""
    steps, shift = served["turbo-tiny"]["steps"], served["turbo-tiny"]["flow_shift"]
    body = {k: v for k, v in SMALL.items() if k != "num_inference_steps"}
    r = requests.post(app.videos(), json={**body, "lora": "turbo-tiny"}, timeout=60)
    assert r.status_code == 200, r.text
    job = wait_finished(app, r.json()["id"])
    assert job["status"] == "completed", job
    assert (job["num_inference_steps"], job["flow_shift"]) == (steps, shift)
    assert job["stats"]["num_steps"] == steps - 1 and job["stats"]["adapters"] == {"turbo-tiny": 1.0}

    r = requests.post(app.videos(), json={**body, "lora": "nope"}, timeout=60)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["message"] == "lora: 'nope' is not an adapter of this server (served: 'turbo-tiny')", error


def test_openapi_describes_the_video_routes_beside_the_research_ones(app):
    paths = requests.get(f"{app.url}/openapi.json", timeout=30).json()["paths"]
    assert {"/v1/videos", "/v1/videos/sync", "/v1/videos/{video_id}", "/v1/videos/{video_id}/content",
            "/v1/videos/{video_id}/events", "/v1/videos/{video_id}/cancel", "/v1/generations"} <= set(paths)
    assert set(paths["/v1/videos/{video_id}/content"]) == {"get", "head"}


def test_range_requests_return_exactly_the_asked_bytes(app, completed):
    url = app.videos(f"/{completed['id']}/content")
    whole = requests.get(url, timeout=30).content
    size = len(whole)
    first = requests.get(url, headers={"range": "bytes=0-99"}, timeout=30)
    assert first.status_code == 206 and first.content == whole[:100]
    assert first.headers["content-range"] == f"bytes 0-99/{size}" and first.headers["content-length"] == "100"
    middle = requests.get(url, headers={"range": f"bytes={size // 2}-"}, timeout=30)
    assert middle.status_code == 206 and middle.content == whole[size // 2:]
    tail = requests.get(url, headers={"range": "bytes=-64"}, timeout=30)
    assert tail.status_code == 206 and tail.content == whole[-64:]
    past = requests.get(url, headers={"range": f"bytes={size}-"}, timeout=30)
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{size}"


def test_the_list_is_newest_first_and_pages_with_after(app, completed):
    created = []
    for seed in (21, 22):
        r = requests.post(app.videos(), json={**SMALL, "num_inference_steps": 2, "seed": seed}, timeout=60)
        assert r.status_code == 200, r.text
        created.append(r.json()["id"])
    for job_id in created:
        assert wait_finished(app, job_id)["status"] == "completed"
    newest, older = created[1], created[0]

    page = requests.get(app.videos("?limit=1"), timeout=30).json()
    assert page["object"] == "list" and [j["id"] for j in page["data"]] == [newest] and page["has_more"]
    assert page["first_id"] == page["last_id"] == newest
    following = requests.get(app.videos(f"?limit=1&after={newest}"), timeout=30).json()
    assert [j["id"] for j in following["data"]] == [older]
    everything = [j["id"] for j in requests.get(app.videos("?limit=100"), timeout=30).json()["data"]]
    assert everything.index(newest) < everything.index(older) < everything.index(completed["id"])


def test_cancel_mid_run_stops_the_engine_at_its_next_step(app):
    r = requests.post(app.videos(), json=LONG, timeout=60)
    assert r.status_code == 200, r.text
    job_id = r.json()["id"]
    cancelled_job = None
    with requests.get(app.videos(f"/{job_id}/events"), stream=True, timeout=120) as events:
        assert events.status_code == 200 and events.headers["content-type"].startswith("text/event-stream")
        seen = []
        for name, job in sse_events(events):
            seen.append((name, job["status"]))
            if name == "progress" and job["progress"] > 0 and cancelled_job is None:
                cancelled_job = requests.post(app.videos(f"/{job_id}/cancel"), timeout=30).json()
            if name in FINISHED:
                break
    assert cancelled_job is not None and cancelled_job["cancel_requested"]
    assert seen[0] == ("progress", "queued") or seen[0] == ("progress", "in_progress")
    assert seen[-1] == ("cancelled", "cancelled")
    final = get_job(app, job_id)
    assert final["status"] == "cancelled" and 0 < final["progress"] < 100
    assert requests.get(app.videos(f"/{job_id}/content"), timeout=30).status_code == 409
    assert requests.post(app.videos(f"/{job_id}/cancel"), timeout=30).status_code == 409

    deadline = time.monotonic() + 60
    while (stats := worker_stats())["last_request"]["outcome"] == "running":  # the engine stops at its next step
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert stats["last_request"]["outcome"] == "cancelled"
    assert stats["last_request"]["step"] < LONG["num_inference_steps"] - 1  # stopped before its last forward
    assert stats["held_plan_refs"] == 0  # the plan references were released


def test_delete_removes_the_job_and_its_mp4(app):
    r = requests.post(app.videos(), json={**SMALL, "num_inference_steps": 2, "seed": 31}, timeout=60)
    job_id = r.json()["id"]
    assert wait_finished(app, job_id)["status"] == "completed"
    deleted = requests.delete(app.videos(f"/{job_id}"), timeout=30)
    assert deleted.status_code == 200 and deleted.json() == {"id": job_id, "object": "video.deleted", "deleted": True}
    assert requests.get(app.videos(f"/{job_id}"), timeout=30).status_code == 404
    assert requests.get(app.videos(f"/{job_id}/content"), timeout=30).status_code == 404


def test_sync_answers_the_mp4_of_an_ordinary_job(app):
    r = requests.post(app.videos("/sync"), json={**SMALL, "seed": 41}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text
    assert probe_mp4(r.content)["video"] == ("h264", 96, 64, SMALL_FRAMES, 24.0)
    job = get_job(app, r.headers["x-video-id"])
    assert job["status"] == "completed" and job["seed"] == 41
    assert requests.get(app.videos(f"/{job['id']}/content"), timeout=30).content == r.content


@pytest.mark.parametrize("overrides, field, message", [
    ({"seconds": 5.0}, "seconds", "5 snaps to 124 frames = 5.16667 s at 24 fps; the model's clips last "
                                  "min_seconds=0.2 to max_seconds=5"),
    ({"size": "100x64"}, "size", "100 is not a multiple of the model's size_multiple=32"),
    ({"size": "256x128"}, "size", "32768 pixels exceed the model's max_pixels=16384"),
    ({"num_inference_steps": 66}, "num_inference_steps", "66 exceeds the model's max_steps=65"),
    ({"quality": "high"}, "quality", "'high' runs Cache-DiT, which is off on this server"),
    ({"model": "sora-2"}, "model", "'sora-2' is not served here; served: ['minimax-h3']"),
])
def test_requests_the_model_cannot_take_are_refused_at_creation(app, overrides, field, message):
    r = requests.post(app.videos(), json={**SMALL, **overrides}, timeout=60)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request" and error["errors"][0]["loc"] == [field] and message in error["message"]


def ingress_replicas() -> list[dict]:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and f"{APP_NAME}#Ingress#" in a["name"]]


def test_an_ingress_killed_mid_run_leaves_jobs_the_restarted_replica_settles(app):
    import ray

    running = requests.post(app.videos(), json={**LONG, "seed": 51}, timeout=60).json()
    queued = requests.post(app.videos(), json={**SMALL, "seed": 52}, timeout=60).json()
    wait_running(app, running["id"])
    assert get_job(app, queued["id"])["status"] == "queued"  # jobs.concurrency = 1: behind the running one

    (replica,) = ingress_replicas()
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)

    # Serve replaces the replica; the new one finds both jobs in the database.
    lost, resumed = wait_finished(app, running["id"]), wait_finished(app, queued["id"])
    (new_replica,) = ingress_replicas()
    assert new_replica["name"] != replica["name"]
    # The running job had steps done: its lease expired and the reaper failed it with the cause.
    assert lost["status"] == "failed" and lost["error"]["code"] == "worker_lost"
    assert re.fullmatch(rf"lost at step \d+/64 of run 1: {REAP_CAUSE}", lost["error"]["message"]), lost["error"]
    assert lost["attempts"] == 1 and 0 < lost["progress"] < 100
    # The queued one was claimed by the new replica and ran to completion.
    assert resumed["status"] == "completed" and resumed["attempts"] == 1
    r = requests.get(app.videos(f"/{resumed['id']}/content"), timeout=30)
    assert probe_mp4(r.content)["video"] == ("h264", 96, 64, SMALL_FRAMES, 24.0)
    listed = [j["id"] for j in requests.get(app.videos("?limit=100"), timeout=30).json()["data"]]
    assert listed[:2] == [queued["id"], running["id"]]  # both stay visible, newest first


def test_a_redeploy_releases_the_running_job_and_keeps_the_others(app, completed):
    running = requests.post(app.videos(), json={**LONG, "seed": 61}, timeout=60).json()
    queued = requests.post(app.videos(), json={**SMALL, "seed": 62}, timeout=60).json()
    wait_running(app, running["id"])

    # `serve deploy` of a changed config: the old ingress replica stops (its jobs are released), a new one starts.
    changed = {**app.args, "jobs": {**app.args["jobs"], "poll_s": 0.25}}
    run_app(app.url, changed)
    wait_videos_ready(app)

    released, resumed = wait_finished(app, running["id"]), wait_finished(app, queued["id"])
    assert released["status"] == "failed" and released["error"]["code"] == "worker_lost"
    assert re.fullmatch(rf"lost at step \d+/64 of run 1: {RELEASE_CAUSE}", released["error"]["message"])
    assert resumed["status"] == "completed"
    before = requests.get(app.videos(f"/{completed['id']}/content"), timeout=30)
    assert before.status_code == 200 and probe_mp4(before.content)["video"] == ("h264", 96, 64, SMALL_FRAMES, 24.0)
