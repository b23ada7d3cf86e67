"""Split and fused apps side by side through Ray Serve on CPU, on the tiny real checkpoints of both MiniMax-H3
partitions: what the stage composition promises (split == fused bit for bit, latents and MP4 bytes, on the
research route and as a video job) and what the two partitions behind one ingress promise.

The `split` app serves `partitions: [fl2va, ref2va]` (a Worker per partition, one TextEncoder and one Decoder
shared by both, the keyframes' and references' encodes in the TextEncoder: what any two-partition app binds,
`deployments.app.stages_split`); the fused apps serve one partition each (`fused`: fl2va, `fused-ref2va`: ref2va),
where every stage runs in the Worker. One cluster for the module, the three apps started once.

- Stages: TextEncoder -> Worker (denoiser) -> Decoder give the fused latents and MP4 bytes; the split Worker is a
  pure denoiser (an embedding in, latents out); every replica reports its start-up timeline; a request's and a
  job's timings name every stage and nest each hop in the one around it.
- Partitions and tasks: `GET /v1/models` lists both models with their tasks and limits, the task picks the
  partition (t2va and fl2va reach `minimax-h3`, ref2va `minimax-h3-ref2va`), `/v1/generations` takes typed
  keyframes and references, `/v1/videos` takes uploads and answers a playable MP4 (H.264 + AAC, the snapped
  length) with the bytes `/v1/generations` gives for the same request, and bad uploads and wrong models are 4xx
  naming the field while `/healthz` stays 200.
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator

import av
import pytest
import requests
import torch
from PIL import Image

from deployments.schemas import decode_latents
from tests.conditioning_support import random_video, video_file, wav
from tests.serve_helpers import run_app, serve_cluster, serve_config_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.ray]  # slow: Ray + Serve: three apps

GEOMETRY = {"short_edge": None, "max_pixels": 128 * 128, "min_seconds": 0.2, "max_seconds": 5.0}
PROMPT = "a red fox runs across a snowy field at dawn"
#: 1 s at 24 fps: 25 frames snapped up to 17n + 5 = 39.
SECONDS, NUM_FRAMES, STEPS, SEED = 1.0, 39, 3, 4
#: app name -> (stages, the partitions it serves)
APPS = {"split": ("split", ["fl2va", "ref2va"]), "fused": ("fused", ["fl2va"]), "fused-ref2va": ("fused", ["ref2va"])}
MODELS = {"minimax-h3": ["t2va", "fl2va"], "minimax-h3-ref2va": ["ref2va"]}
#: The stage tests' t2va request (the fl2va partition: `Worker` in every app serving it).
GENERATION = {"prompt": "a red fox in snow", "steps": 4, "seconds": 1.0, "width": 96, "height": 64, "seed": 7,
              "return_video": True, "return_latents": True}
VIDEO_JOB = {"prompt": "a red fox in snow", "seconds": 1.0, "size": "96x64", "num_inference_steps": 4, "seed": 7}
STAGES = ("fused", "split")
PARTITION_MODELS = {"fl2va": "minimax-h3", "ref2va": "minimax-h3-ref2va"}
WAIT_S = 300.0


def app_serving(stages: str, model: str) -> str:
    """The app of `stages` that serves `model` (the split app serves both)."""
    return "split" if stages == "split" else "fused" if model == "minimax-h3" else "fused-ref2va"


def png(width: int, height: int, seed: int) -> bytes:
    pixels = bytes((i * 7919 + seed * 104729) % 251 for i in range(width * height * 3))
    out = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(out, format="PNG")
    return out.getvalue()


FIRST, LAST = png(48, 27, seed=1), png(40, 40, seed=2)
_GIF = io.BytesIO()
Image.new("RGB", (8, 8)).save(_GIF, format="GIF")
GIF = _GIF.getvalue()
#: Past engine.media.MediaLimits' 15 s: a 17 s reference video (34 frames at 2 fps) and a 16 s soundtrack.
LONG_VIDEO, LONG_SOUNDTRACK = video_file(random_video(34, 48, 32, seed=1), fps=2), wav(16.0)
#: 1.5 s at 12 fps with its soundtrack (lossless FFV1 + PCM in Matroska)
VIDEO = video_file(random_video(18, 48, 32, seed=3), fps=12, soundtrack_seconds=1.5)


@pytest.fixture(scope="module")
def apps(tmp_path_factory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("fl2va-serve")
    with serve_cluster(num_cpus=8) as url:
        urls = {}
        for name, (stages, partitions) in APPS.items():
            args = serve_config_args(root / "checkpoints")
            args.update({"stages": stages, "partitions": partitions})
            args["engine"].pop("partition")  # `partitions` names what is served
            args["engine"].update({"device": "cpu", "geometry": GEOMETRY})
            # The shipped adapter adapts FL2VA: an app serving Ref2VA alone must not name it (refused at start).
            args["engine"]["adapters"] = {name: adapter for name, adapter in args["engine"]["adapters"].items()
                                          if "fl2va" in partitions}
            args["jobs"].update({"state_dir": str(root / f"state-{name}"), "poll_s": 0.2, "events_poll_s": 0.2})
            run_app(url, args, name=name, route_prefix=f"/{name}")
            urls[name] = f"{url}/{name}"
        yield urls


def generation(keyframes: list[dict], **fields) -> dict:
    return {"prompt": PROMPT, "steps": STEPS, "seconds": SECONDS, "seed": SEED, "return_video": True,
            "return_latents": True, "keyframes": keyframes, **fields}


def keyframe(image: bytes, **position) -> dict:
    return {"image": base64.b64encode(image).decode(), **position}


def mp4_facts(data: bytes) -> tuple[str, str, int, tuple[int, int]]:
    with av.open(io.BytesIO(data)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        frames = sum(1 for _ in container.decode(video=0))
        return video.codec_context.name, audio.codec_context.name, frames, (video.width, video.height)


def completed_job(base_url: str, video_id: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        job = requests.get(f"{base_url}/v1/videos/{video_id}", timeout=30).json()
        if job["status"] in ("completed", "failed", "cancelled"):
            assert job["status"] == "completed", job
            return job
        assert time.monotonic() < deadline, f"gave up waiting for {video_id}: {job}"
        time.sleep(0.2)


def test_models_lists_both_partitions_models_with_their_tasks_and_limits(apps):
    for name, (_, partitions) in APPS.items():
        cards = requests.get(f"{apps[name]}/v1/models", timeout=30).json()["data"]
        served = {PARTITION_MODELS[partition]: MODELS[PARTITION_MODELS[partition]] for partition in partitions}
        assert {card["limits"]["name"]: card["tasks"] for card in cards} == served, name
        for card in cards:
            assert card["limits"]["tasks"] == card["tasks"] and card["id"].startswith(card["limits"]["name"] + "@")
            assert card["limits"]["max_pixels"] == GEOMETRY["max_pixels"]
        assert requests.get(f"{apps[name]}/healthz", timeout=30).status_code == 200
    assert set(requests.get(f"{apps['split']}/healthz", timeout=30).json()["workers"]) == {"fl2va", "ref2va"}
    split_cards = requests.get(f"{apps['split']}/v1/models", timeout=30).json()["data"]
    assert split_cards[0]["fingerprint"] != split_cards[1]["fingerprint"]  # two transformers, two plan cache keys


@pytest.mark.parametrize("stages", ["split", "fused"])
@pytest.mark.parametrize("fields, model", [
    ({}, "minimax-h3"),
    ({"keyframes": [{"image": base64.b64encode(FIRST).decode(), "anchor": "first"}]}, "minimax-h3"),
    ({"references": [{"kind": "image", "data": base64.b64encode(FIRST).decode()}]}, "minimax-h3-ref2va"),
])
def test_the_task_picks_the_partition(apps, stages, fields, model):
    app = app_serving(stages, model)
    body = {"prompt": PROMPT, "steps": STEPS, "seconds": SECONDS, "seed": SEED, "width": 64, "height": 32,
            "return_video": False, **fields}
    response = requests.post(f"{apps[app]}/v1/generations", json=body, timeout=300)
    assert response.status_code == 200, response.text
    assert response.json()["model"].startswith(model + "@")


@pytest.mark.parametrize("case, keyframes", [
    ("first", [keyframe(FIRST, anchor="first")]),
    ("last", [keyframe(FIRST, frame_index=-1)]),
    ("first-and-last", [keyframe(FIRST, anchor="first"), keyframe(LAST, anchor="last")]),
])
def test_generations_take_typed_keyframes_split_as_fused(apps, case, keyframes):
    bodies = {}
    for app in ("split", "fused"):
        response = requests.post(f"{apps[app]}/v1/generations", json=generation(keyframes), timeout=300)
        assert response.status_code == 200, (app, response.text)
        bodies[app] = response.json()
    body = bodies["split"]
    video_codec, audio_codec, frames, size = mp4_facts(base64.b64decode(body["video_mp4"]))
    assert (video_codec, audio_codec, frames) == ("h264", "aac", NUM_FRAMES)
    assert min(size) == 32  # the tiny checkpoint's canvas_short_edge, from the first keyframe's aspect ratio
    split, fused = (decode_latents(bodies[app]["latents"]) for app in ("split", "fused"))
    assert split["video"].shape[1] == (NUM_FRAMES - 5) // 17 * 5 + 2
    assert all((split[name] == fused[name]).all() for name in ("video", "audio"))  # split == fused, bit for bit
    assert body["video_mp4"] == bodies["fused"]["video_mp4"]


def test_a_keyframe_changes_the_clip(apps):
    """The same seed and prompt with and without a first keyframe: the keyframe conditions the latents."""
    url = f"{apps['fused']}/v1/generations"
    with_keyframe = requests.post(url, json=generation([keyframe(FIRST, anchor="first")], width=64, height=32),
                                  timeout=300).json()
    text_only = requests.post(url, json={k: v for k, v in generation([], width=64, height=32).items()
                                         if k != "keyframes"}, timeout=300).json()
    with_video, text_video = (decode_latents(body["latents"])["video"] for body in (with_keyframe, text_only))
    assert not (with_video == text_video).all()


@pytest.mark.parametrize("app", ["split", "fused"])
def test_a_png_upload_makes_a_video_job_whose_mp4_is_the_generations_mp4(apps, app):
    base_url = apps[app]
    created = requests.post(f"{base_url}/v1/videos", timeout=60,
                            files={"input_reference": ("f.png", FIRST, "image/png")},
                            data={"prompt": PROMPT, "seconds": str(SECONDS), "num_inference_steps": str(STEPS),
                                  "seed": str(SEED), "frame_indices": "0"})
    assert created.status_code == 200, created.text
    job = completed_job(base_url, created.json()["id"])
    assert (job["task"], job["size"], job["model"]) == ("fl2va", "auto", "minimax-h3")
    mp4 = requests.get(f"{base_url}/v1/videos/{job['id']}/content", timeout=60).content
    assert mp4_facts(mp4)[:3] == ("h264", "aac", NUM_FRAMES)
    direct = requests.post(f"{base_url}/v1/generations", json=generation([keyframe(FIRST, frame_index=0)]),
                           timeout=300).json()
    assert base64.b64decode(direct["video_mp4"]) == mp4  # both APIs ran the same engine request


def test_first_and_last_keyframes_as_data_urls_on_the_sync_route(apps):
    urls = [f"data:image/png;base64,{base64.b64encode(image).decode()}" for image in (FIRST, LAST)]
    response = requests.post(f"{apps['fused']}/v1/videos/sync", timeout=300, json={
        "prompt": PROMPT, "seconds": SECONDS, "num_inference_steps": STEPS, "seed": SEED,
        "input_references": urls, "frame_indices": [0, -1]})
    assert response.status_code == 200, response.text
    assert mp4_facts(response.content)[:3] == ("h264", "aac", NUM_FRAMES)


@pytest.mark.parametrize("case, send, status, message", [
    ("corrupt-png", {"files": {"input_reference": ("f.png", FIRST[: len(FIRST) // 2], "image/png")}}, 422,
     "input_reference: truncated or corrupt image"),
    ("gif", {"files": {"input_reference": ("f.gif", GIF, "image/gif")}}, 422,
     "input_reference: GIF images are not accepted"),
    ("url", {"json": {"prompt": PROMPT, "input_reference": "http://127.0.0.1:8265/api/jobs"}}, 422,
     "input_reference: 'http://127.0.0.1:8265/api/jobs' is not a data: URL"),
    ("references-to-the-fl2va-model", {"files": {"image_reference": ("f.png", FIRST, "image/png")},
                                       "data": {"prompt": PROMPT, "model": "minimax-h3"}}, 422,
     "model: minimax-h3 serves t2va, fl2va, not ref2va; ref2va is served by minimax-h3-ref2va"),
    ("text-to-the-ref2va-model", {"json": {"prompt": PROMPT, "model": "minimax-h3-ref2va"}}, 422,
     "model: minimax-h3-ref2va serves ref2va, not t2va; t2va is served by minimax-h3"),
    ("unknown-model", {"json": {"prompt": PROMPT, "model": "sora-2"}}, 422,
     "model: 'sora-2' is not served here; served: ['minimax-h3', 'minimax-h3-ref2va']"),
    ("corrupt-video-reference", {"files": {"video_reference": ("v.mp4", b"not an mp4", "video/mp4")},
                                 "data": {"prompt": PROMPT, "model": "minimax-h3-ref2va"}}, 422,
     "video_reference: not a media file"),
    ("over-long-video-reference", {"files": {"video_reference": ("v.mkv", LONG_VIDEO, "video/x-matroska")},
                                   "data": {"prompt": PROMPT, "model": "minimax-h3-ref2va"}}, 422,
     "video_reference: 17.00 s is over the limit of 15 s"),
    ("over-long-soundtrack", {"files": [("image_reference", ("f.png", FIRST, "image/png")),
                                        ("audio_reference", ("s.wav", LONG_SOUNDTRACK, "audio/wav"))],
                              "data": {"prompt": PROMPT, "model": "minimax-h3-ref2va"}}, 422,
     "audio_reference: 16.00 s is over the limit of 15 s"),
])
def test_bad_uploads_are_4xx_naming_the_field_and_the_replica_stays_healthy(apps, case, send, status, message):
    base_url = apps["split"]
    if "files" in send:
        send = {"data": {"prompt": PROMPT}, **send}
    response = requests.post(f"{base_url}/v1/videos", timeout=60, **send)
    assert response.status_code == status and message in response.json()["error"]["message"], response.text
    assert requests.get(f"{base_url}/healthz", timeout=30).status_code == 200


def test_generations_refuse_a_model_that_does_not_serve_the_task(apps):
    base_url = apps["split"]  # the app serving both models
    wrong = requests.post(f"{base_url}/v1/generations", timeout=60, json=generation(
        [keyframe(FIRST, anchor="first")], model="minimax-h3-ref2va"))
    assert wrong.status_code == 422, wrong.text
    error = wrong.json()["error"]
    assert error["errors"][0]["loc"] == ["model"] and "serves ref2va, not fl2va" in error["message"]
    assert requests.get(f"{base_url}/healthz", timeout=30).status_code == 200



@pytest.mark.parametrize("case, files", [
    ("images", [("image_references", ("a.png", FIRST, "image/png")),
                ("image_references", ("b.png", LAST, "image/png"))]),
    ("image-and-soundtrack", [("image_references", ("a.png", FIRST, "image/png")),
                              ("audio_reference", ("s.wav", wav(1.0), "audio/wav"))]),
    ("image-and-video-with-soundtrack", [("image_references", ("a.png", FIRST, "image/png")),
                                         ("video_reference", ("v.mkv", VIDEO, "video/x-matroska"))]),
])
def test_references_make_a_ref2va_job_split_as_fused(apps, case, files):
    mp4s = {}
    for app in ("split", "fused-ref2va"):
        base_url = apps[app]
        created = requests.post(f"{base_url}/v1/videos", timeout=60, files=files, data={
            "prompt": PROMPT, "seconds": str(SECONDS), "num_inference_steps": str(STEPS), "seed": str(SEED)})
        assert created.status_code == 200, created.text
        job = completed_job(base_url, created.json()["id"])
        assert job["task"] == "ref2va" and job["model"] == "minimax-h3-ref2va"  # the task picked the partition
        mp4s[app] = requests.get(f"{base_url}/v1/videos/{job['id']}/content", timeout=60).content
        assert mp4_facts(mp4s[app])[:3] == ("h264", "aac", NUM_FRAMES)
    assert mp4s["split"] == mp4s["fused-ref2va"]  # split == fused, bit for bit


# --- the stages: split == fused ----------------------------------------------------------------------------


def test_the_builder_binds_the_stage_deployments_when_split(apps):
    from ray import serve

    deployments = {name: set(serve.status().applications[name].deployments) for name in APPS}
    assert deployments == {"fused": {"Ingress", "Worker"}, "fused-ref2va": {"Ingress", "Worker"},
                           "split": {"Ingress", "Worker", "Worker-ref2va", "TextEncoder", "Decoder"}}


@pytest.mark.parametrize("stages, deployment", [("fused", "Worker"), ("split", "Worker"), ("split", "Worker-ref2va"),
                                               ("split", "TextEncoder"), ("split", "Decoder")])
def test_every_replica_reports_its_start_up_timeline_in_order(apps, stages, deployment):
    """Wall-clock times from the replica's own process: our first import, the module's imports done, the
    constructor, the build, ready, in that order; a real engine's imports and build take time."""
    from ray import serve

    from engine.startup import ReplicaStartup

    card = serve.get_deployment_handle(deployment, stages).describe.remote().result(timeout_s=60)
    startup = ReplicaStartup.from_dict(card["startup"])
    assert startup.role == {"Worker": "worker", "Worker-ref2va": "worker", "TextEncoder": "text_encoder",
                            "Decoder": "decoder"}[deployment]
    timeline = startup.timeline()
    assert list(timeline) == sorted(timeline) and timeline[-1] <= time.time()
    assert startup.process_started_at <= startup.import_started_at  # the replica's own process, not the driver's
    assert startup.import_s > 0 and startup.build_s > 0
    assert startup.constructor_s >= startup.imports_s + startup.build_s - 1e-6  # both lie inside the constructor
    assert (startup.engine is not None) == deployment.startswith("Worker")


def test_split_stages_give_the_fused_latents_and_mp4_bytes(apps):
    results = {}
    for stages in STAGES:
        r = requests.post(f"{apps[stages]}/v1/generations", json=GENERATION, timeout=300)
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
    for stages in STAGES:
        r = requests.post(f"{apps[stages]}/v1/videos", json=VIDEO_JOB, timeout=60)
        assert r.status_code == 200, r.text
        jobs[stages] = completed_job(apps[stages], r.json()["id"])
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
