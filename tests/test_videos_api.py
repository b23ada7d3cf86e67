"""`/v1/videos` over HTTP (FastAPI TestClient) with the fake backend: create, poll, download, ranges, list,
cancel, delete, 429, auth isolation, SSE, sync, and a matrix of bad requests, each a 4xx naming the problem."""

from __future__ import annotations

import json
import re
import time
from contextlib import ExitStack

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from deployments.errors import install_error_handlers
from deployments.videos import VideoApi, VideoApiSlot, build_videos_app, parse_range, videos_router
from engine.limits import ModelLimits
from jobs.backend import VideoSpec
from jobs.config import AuthConfig, JobsConfig
from jobs.outputs import OutputStore
from jobs.service import JobService
from jobs.sqlite_store import SqliteJobStore
from tests.jobs_support import FAKE_MP4_BYTES, FakeVideoBackend, fake_mp4, fake_png

pytestmark = pytest.mark.timeout(120)

# Clips snap up to 17n+5 frames at 24 fps: 1 s -> 39 frames = 1.625 s, 2 s -> 56 frames = 2.33 s.
TINY = ModelLimits(
    name="tiny", min_seconds=1, max_seconds=3, default_seconds=1, size_multiple=16, min_edge=32, max_edge=128,
    max_pixels=128 * 64, default_size="64x32", default_short_edge=32, max_steps=8, default_steps=4,
    max_prompt_chars=256,
)
TINY_B = TINY.model_copy(update={"name": "tiny-b"})
KEY_A = "key-a-0123456789abcdef"
KEY_B = "key-b-0123456789abcdef"
VALID = {"prompt": "a lighthouse at dusk", "seed": 9}
WAIT_S = 20.0


@pytest.fixture
def serve(tmp_path):
    """serve(backend=..., api_keys=[...], **jobs_config) -> a TestClient on a fresh app (service started)."""
    stack = ExitStack()

    def serve(backend: FakeVideoBackend | None = None, api_keys: tuple[str, ...] = (), **config) -> TestClient:
        service = JobService(
            store=SqliteJobStore(tmp_path / "jobs.sqlite3"), outputs=OutputStore(str(tmp_path / "outputs")),
            backend=backend or FakeVideoBackend(), models=[TINY, TINY_B],
            config=JobsConfig.model_validate(
                {"state_dir": str(tmp_path), "poll_s": 0.02, "events_poll_s": 0.05, "max_body_bytes": 4096, **config}
            ),
        )
        app = build_videos_app(VideoApi(service=service, auth=AuthConfig(api_keys=list(api_keys))))
        return stack.enter_context(TestClient(app))

    yield serve
    stack.close()


def wait_for(client: TestClient, video_id: str, predicate, what: str, headers=None) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        job = client.get(f"/v1/videos/{video_id}", headers=headers).json()
        if predicate(job):
            return job
        assert time.monotonic() < deadline, f"gave up waiting for {what}: {job}"
        time.sleep(0.01)


def completed(client: TestClient, video_id: str, headers=None) -> dict:
    return wait_for(client, video_id, lambda j: j["status"] == "completed", "completion", headers)


def spec_of(job: dict) -> VideoSpec:
    """The VideoSpec the job object describes (what the fake backend derived its bytes from)."""
    width, height = map(int, job["size"].split("x"))
    return VideoSpec(
        model=job["model"], prompt=job["prompt"], seconds=float(job["seconds"]), width=width, height=height,
        num_inference_steps=job["num_inference_steps"], seed=job["seed"], flow_shift=job["flow_shift"],
        audio_flow_shift=job["audio_flow_shift"], quality=job["quality"],
    )


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# --- The happy path ------------------------------------------------------------------------------------


def test_create_poll_and_download(serve):
    client = serve()
    created = client.post("/v1/videos", json={**VALID, "seconds": "1.5", "aspect_ratio": "2:1"})
    assert created.status_code == 200, created.text
    job = created.json()
    assert re.fullmatch(r"video_[A-Za-z0-9_-]{22}", job["id"])
    assert {k: job[k] for k in ("object", "model", "seconds", "size", "num_inference_steps", "seed", "quality")} == {
        "object": "video", "model": "tiny", "seconds": "1.5", "size": "64x32", "num_inference_steps": 4, "seed": 9,
        "quality": "lossless",
    }
    assert job["status"] in ("queued", "in_progress") and job["error"] is None

    done = completed(client, job["id"])
    assert (done["progress"], done["attempts"], done["error"]) == (100, 1, None)
    assert done["completed_at"] >= done["created_at"] and done["expires_at"] > done["completed_at"]
    assert done["stats"]["num_steps"] == 4 and done["stats"]["num_frames"] == 36

    video = client.get(f"/v1/videos/{job['id']}/content")
    assert video.status_code == 200
    assert (video.headers["content-type"], video.headers["accept-ranges"]) == ("video/mp4", "bytes")
    assert video.content == fake_mp4(spec_of(done))
    thumbnail = client.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
    assert thumbnail.headers["content-type"] == "image/png"
    assert thumbnail.content == fake_png(spec_of(done))


@pytest.mark.parametrize("encoding", ["multipart", "urlencoded"])
def test_create_from_form_fields(serve, encoding):
    client = serve()
    fields = {"prompt": "a cat", "seconds": "2", "size": "32x64", "num_inference_steps": "3", "model": "tiny-b"}
    if encoding == "multipart":
        response = client.post("/v1/videos", files={k: (None, v) for k, v in fields.items()})
    else:
        response = client.post("/v1/videos", data=fields)
    assert response.status_code == 200, response.text
    job = response.json()
    assert (job["model"], job["seconds"], job["size"], job["num_inference_steps"]) == ("tiny-b", "2", "32x64", 3)
    completed(client, job["id"])


# --- Range requests ------------------------------------------------------------------------------------

LAST = FAKE_MP4_BYTES - 1


@pytest.mark.parametrize(
    ("range_header", "status", "content_range", "part"),
    [
        ("bytes=0-9", 206, f"bytes 0-9/{FAKE_MP4_BYTES}", slice(0, 10)),
        ("bytes=39990-", 206, f"bytes 39990-{LAST}/{FAKE_MP4_BYTES}", slice(39990, None)),
        ("bytes=-5", 206, f"bytes 39995-{LAST}/{FAKE_MP4_BYTES}", slice(-5, None)),
        ("bytes=100-999999", 206, f"bytes 100-{LAST}/{FAKE_MP4_BYTES}", slice(100, None)),
        ("bytes=-999999", 206, f"bytes 0-{LAST}/{FAKE_MP4_BYTES}", slice(None)),
        ("bytes=40000-", 416, f"bytes */{FAKE_MP4_BYTES}", None),
        ("bytes=-0", 416, f"bytes */{FAKE_MP4_BYTES}", None),
        ("bytes=0-1,5-6", 200, None, slice(None)),  # several ranges: the whole file
        ("items=0-1", 200, None, slice(None)),  # another unit: ignored
        ("bytes=9-2", 200, None, slice(None)),  # malformed: ignored
        ("bytes=abc", 200, None, slice(None)),
        ("bytes=" + "9" * 5000 + "-", 416, f"bytes */{FAKE_MP4_BYTES}", None),  # past int()'s 4300 digits
        ("bytes=0-" + "9" * 5000, 206, f"bytes 0-{LAST}/{FAKE_MP4_BYTES}", slice(None)),
        ("bytes=-" + "9" * 5000, 206, f"bytes 0-{LAST}/{FAKE_MP4_BYTES}", slice(None)),
    ],
)
def test_range_requests(serve, range_header, status, content_range, part):
    client = serve()
    job = completed(client, client.post("/v1/videos", json=VALID).json()["id"])
    response = client.get(f"/v1/videos/{job['id']}/content", headers={"range": range_header})
    assert response.status_code == status
    assert response.headers.get("content-range") == content_range
    if part is not None:
        expected = fake_mp4(spec_of(job))[part]
        assert response.content == expected
        assert response.headers["content-length"] == str(len(expected))
    else:
        assert response.json()["error"]["type"] == "range_not_satisfiable"


@pytest.mark.parametrize("range_header", ["bytes=\u00b2-", "bytes=0-\u00b2", "bytes=-\u00b2", "bytes=\u0661-\u0662"])
def test_a_range_with_non_ascii_digits_is_ignored(range_header):
    # A server decodes header bytes as latin-1 (0xB2 -> '\u00b2'), and str.isdigit() takes digits int() refuses.
    assert parse_range(range_header, FAKE_MP4_BYTES) is None


def test_head_answers_headers_only(serve):
    client = serve()
    job = completed(client, client.post("/v1/videos", json=VALID).json()["id"])
    response = client.head(f"/v1/videos/{job['id']}/content", headers={"range": "bytes=10-19"})
    assert (response.status_code, response.content) == (206, b"")
    assert (response.headers["content-length"], response.headers["content-range"]) == (
        "10", f"bytes 10-19/{FAKE_MP4_BYTES}"
    )


# --- Listing -------------------------------------------------------------------------------------------


def test_list_is_newest_first_in_pages(serve):
    client = serve(backend=FakeVideoBackend(hold_before_step=1))
    ids = [client.post("/v1/videos", json=VALID).json()["id"] for _ in range(5)]
    page = client.get("/v1/videos", params={"limit": 2}).json()
    assert page["object"] == "list"
    assert ([j["id"] for j in page["data"]], page["first_id"], page["last_id"], page["has_more"]) == (
        [ids[4], ids[3]], ids[4], ids[3], True
    )
    page = client.get("/v1/videos", params={"limit": 2, "after": page["last_id"]}).json()
    assert ([j["id"] for j in page["data"]], page["has_more"]) == ([ids[2], ids[1]], True)
    page = client.get("/v1/videos", params={"limit": 2, "after": page["last_id"]}).json()
    assert ([j["id"] for j in page["data"]], page["has_more"]) == ([ids[0]], False)
    assert [j["id"] for j in client.get("/v1/videos").json()["data"]] == ids[::-1]  # default limit 20
    assert [j["id"] for j in client.get("/v1/videos", params={"order": "desc"}).json()["data"]] == ids[::-1]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        # Declared bounds: FastAPI's own check, in the app's error shape (loc names the query parameter).
        ({"limit": "0"}, "query.limit: Input should be greater than or equal to 1"),
        ({"limit": "-1"}, "query.limit: Input should be greater than or equal to 1"),
        ({"limit": "ten"}, "query.limit: Input should be a valid integer"),
        ({"limit": "\u00b2"}, "query.limit: Input should be a valid integer"),  # isdigit() but not int()-able
        ({"limit": "9" * 5000}, "query.limit: "),  # past int()'s 4300 digits: refused, not a ValueError
        # The replica's configured bound.
        ({"limit": "101"}, "limit: 101 exceeds jobs.max_list_limit=100"),
        ({"limit": "99999999999999999999"}, "limit: 99999999999999999999 exceeds jobs.max_list_limit=100"),
        ({"after": "../../etc"}, "query.after: String should match pattern"),
        ({"after": "video_" + "Z" * 22}, "after: no video job with id 'video_ZZZZZZZZZZZZZZZZZZZZZZ'"),
        ({"order": "asc"}, "query.order: Input should be 'desc'"),
        ({"order": ""}, "query.order: Input should be 'desc'"),
    ],
)
def test_bad_list_parameters_are_422(serve, params, message):
    response = serve().get("/v1/videos", params=params)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["type"] == "invalid_request" and error["message"].startswith(message)
    assert error["errors"][0]["loc"][-1] == next(iter(params))  # the parameter at fault, named


# --- Cancel, delete, conflicts -------------------------------------------------------------------------


def test_cancel_queued_and_running_jobs(serve, tmp_path):
    backend = FakeVideoBackend(hold_before_step=2)
    client = serve(backend=backend)
    running = client.post("/v1/videos", json=VALID).json()["id"]
    wait_for(client, running, lambda j: j["status"] == "in_progress" and j["progress"] == 25, "step 1")
    queued = [client.post("/v1/videos", json=VALID).json() for _ in range(2)]
    assert [j["queue_position"] for j in queued] == [0, 1]

    cancelled = client.post(f"/v1/videos/{queued[0]['id']}/cancel")
    assert (cancelled.status_code, cancelled.json()["status"]) == (200, "cancelled")
    assert client.get(f"/v1/videos/{queued[1]['id']}").json()["queue_position"] == 0  # moved up

    flagged = client.post(f"/v1/videos/{running}/cancel").json()
    assert (flagged["status"], flagged["cancel_requested"]) == ("in_progress", True)
    stopped = wait_for(client, running, lambda j: j["status"] == "cancelled", "the running job to stop")
    assert stopped["progress"] == 25 and backend.steps_done[running] == 1

    again = client.post(f"/v1/videos/{running}/cancel")
    assert again.status_code == 409
    assert again.json()["error"] == {
        "type": "conflict", "message": f"video job '{running}' is already cancelled; nothing to cancel", "errors": None,
    }
    content = client.get(f"/v1/videos/{running}/content")
    assert (content.status_code, content.json()["error"]["type"]) == (409, "conflict")


def test_content_of_an_unfinished_job_is_a_conflict(serve):
    client = serve(backend=FakeVideoBackend(hold_before_step=1))
    job = client.post("/v1/videos", json=VALID).json()
    response = client.get(f"/v1/videos/{job['id']}/content")
    assert response.status_code == 409
    assert "its content exists once completed" in response.json()["error"]["message"]


def test_delete_removes_the_job_and_its_files(serve, tmp_path):
    client = serve()
    job_id = completed(client, client.post("/v1/videos", json=VALID).json()["id"])["id"]
    assert len(list((tmp_path / "outputs").iterdir())) == 2
    response = client.delete(f"/v1/videos/{job_id}")
    assert (response.status_code, response.json()) == (200, {"id": job_id, "object": "video.deleted", "deleted": True})
    assert client.get(f"/v1/videos/{job_id}").status_code == 404
    assert client.delete(f"/v1/videos/{job_id}").status_code == 404
    assert list((tmp_path / "outputs").iterdir()) == []


# --- Admission -----------------------------------------------------------------------------------------


def test_a_full_queue_answers_429_with_retry_after(serve):
    client = serve(backend=FakeVideoBackend(hold_before_step=1), max_queued_per_model=2, default_retry_after_s=30)
    first = client.post("/v1/videos", json=VALID).json()["id"]
    wait_for(client, first, lambda j: j["status"] == "in_progress", "the first job to start")
    for _ in range(2):
        assert client.post("/v1/videos", json=VALID).status_code == 200
    refused = client.post("/v1/videos", json=VALID)
    assert (refused.status_code, refused.headers["retry-after"]) == (429, "30")
    assert refused.json()["error"]["type"] == "queue_full"
    assert refused.json()["error"]["message"] == (
        "the queue of model 'tiny' is full (2 queued, max_queued_per_model=2); retry later"
    )
    assert client.post("/v1/videos", json={**VALID, "model": "tiny-b"}).status_code == 200  # its own queue


# --- Auth ----------------------------------------------------------------------------------------------


def test_api_keys_isolate_clients(serve):
    client = serve(api_keys=(KEY_A, KEY_B))
    missing = client.post("/v1/videos", json=VALID)
    assert (missing.status_code, missing.headers["www-authenticate"]) == (401, "Bearer")
    assert client.get("/v1/videos", headers=bearer("key-c-0123456789abcdef")).status_code == 401
    assert client.get("/v1/videos", headers={"authorization": KEY_A}).status_code == 401  # no scheme

    job_id = client.post("/v1/videos", json=VALID, headers=bearer(KEY_A)).json()["id"]
    completed(client, job_id, headers=bearer(KEY_A))
    assert [j["id"] for j in client.get("/v1/videos", headers=bearer(KEY_A)).json()["data"]] == [job_id]
    assert client.get("/v1/videos", headers=bearer(KEY_B)).json()["data"] == []
    for method, path in [("GET", ""), ("GET", "/content"), ("GET", "/events"), ("POST", "/cancel"), ("DELETE", "")]:
        response = client.request(method, f"/v1/videos/{job_id}{path}", headers=bearer(KEY_B))
        assert response.status_code == 404, (method, path)  # not 403: B cannot learn the id exists
    assert client.get(f"/v1/videos/{job_id}", headers=bearer(KEY_A)).status_code == 200


# --- Bad input -----------------------------------------------------------------------------------------


def raw(body: str, content_type: str = "application/json") -> dict:
    return {"content": body.encode(), "headers": {"content-type": content_type}}


BAD_REQUESTS = [
    ("seconds-over-model", {"json": {**VALID, "seconds": 9}}, 422,
     "seconds: 9 snaps to 226 frames = 9.41667 s at 24 fps; the model's clips last min_seconds=1 to max_seconds=3"),
    ("seconds-under-model", {"json": {**VALID, "seconds": 0.25}}, 422,
     "seconds: 0.25 snaps to 22 frames = 0.916667 s at 24 fps; the model's clips last min_seconds=1"),
    ("seconds-zero", {"json": {**VALID, "seconds": 0}}, 422, "seconds: Input should be greater than 0"),
    ("seconds-word", {"json": {**VALID, "seconds": "long"}}, 422,
     "seconds: Value error, seconds='long' is not a number"),
    ("seconds-nan", raw('{"prompt": "x", "seconds": NaN}'), 422, "seconds: Input should be a finite number"),
    ("size-not-multiple", {"json": {**VALID, "size": "72x32"}}, 422,
     "size: 72x32: 72 is not a multiple of the model's size_multiple=16"),
    ("size-too-large", {"json": {**VALID, "size": "1344x768"}}, 422,
     "size: 1344x768: 1344 exceeds the model's max_edge=128"),
    ("size-malformed", {"json": {**VALID, "size": "64 by 32"}}, 422, "size: String should match pattern"),
    ("size-and-aspect", {"json": {**VALID, "size": "64x32", "aspect_ratio": "2:1"}}, 422,
     "body: Value error, give size or aspect_ratio (+ short_edge), not both"),
    ("steps-over-model", {"json": {**VALID, "num_inference_steps": 9}}, 422,
     "num_inference_steps: 9 exceeds the model's max_steps=8"),
    ("steps-zero", {"json": {**VALID, "num_inference_steps": 0}}, 422,
     "num_inference_steps: Input should be greater than or equal to 1"),
    ("steps-as-string", {"json": {**VALID, "num_inference_steps": "4"}}, 422,
     "num_inference_steps: Input should be a valid integer"),
    ("unknown-model", {"json": {**VALID, "model": "sora-2"}}, 422,
     "model: 'sora-2' is not served here; served: ['tiny', 'tiny-b']"),
    ("prompt-over-model", {"json": {**VALID, "prompt": "a" * 257}}, 422,
     "prompt: 257 characters exceed the model's max_prompt_chars=256"),
    ("prompt-missing", {"json": {"seconds": 1}}, 422, "prompt: Field required"),
    ("prompt-empty", {"json": {**VALID, "prompt": ""}}, 422, "prompt: String should have at least 1 character"),
    ("prompt-blank", {"json": {**VALID, "prompt": "   "}}, 422, "prompt: must not be blank"),
    ("quality-unknown", {"json": {**VALID, "quality": "ultra"}}, 422, "quality: Input should be 'lossless', 'high' or 'fp8'"),
    ("seed-negative", {"json": {**VALID, "seed": -1}}, 422, "seed: Input should be greater than or equal to 0"),
    ("seed-too-big", {"json": {**VALID, "seed": 2**63}}, 422, "seed: Input should be less than or equal to"),
    ("flow-shift-over", {"json": {**VALID, "flow_shift": 500.0}}, 422,
     "flow_shift: 500 exceeds the model's max_flow_shift=100"),
    ("audio-shift-negative", {"json": {**VALID, "audio_flow_shift": -3}}, 422,
     "audio_flow_shift: Input should be greater than 0"),
    ("unknown-field", {"json": {**VALID, "negative_prompt": "x"}}, 422,
     "negative_prompt: Extra inputs are not permitted"),
    ("short-edge-alone", {"json": {**VALID, "short_edge": 32}}, 422,
     "body: Value error, short_edge needs aspect_ratio"),
    ("body-array", {"json": [1, 2]}, 422, "body must be a JSON object, got list"),
    ("body-malformed", raw("{bad"), 400, "body is not valid JSON"),
    ("body-too-deep", raw("[" * 4000), 400, "body is not valid JSON: nested too deeply"),
    ("body-too-large", {"json": {**VALID, "prompt": "a" * 5000}}, 413, "exceeds jobs.max_body_bytes=4096"),
    ("content-type-text", raw("prompt=x", "text/plain"), 415, "content-type 'text/plain'"),
    ("form-file-not-an-image", {"files": {"prompt": (None, "x"), "input_reference": ("a.png", b"png", "image/png")}},
     422, "input_reference: not an image (PNG, JPEG or WebP)"),
    ("form-file-in-a-text-field", {"files": {"prompt": ("p.txt", b"x", "text/plain")}}, 422,
     "prompt: a file, where the field takes text"),
    ("form-duplicate-field", raw("prompt=a&prompt=b", "application/x-www-form-urlencoded"), 422,
     "prompt: given more than once"),
    ("form-steps-not-a-number", {"data": {"prompt": "x", "num_inference_steps": "many"}}, 422,
     "num_inference_steps: Input should be a valid integer"),
    ("duplicate-key", raw('{"prompt": "a cat", "prompt": "a dog"}'), 422, "prompt: given more than once"),
    ("form-multipart-without-boundary", raw("prompt=x", "multipart/form-data"), 422,
     "form body: Missing boundary in multipart"),
    ("form-too-many-fields", raw("&".join(f"f{i}=1" for i in range(40)), "application/x-www-form-urlencoded"),
     422, "form body: too many fields (at most 32)"),
    ("form-percent-escape-not-utf8", raw("prompt=%ff%fe", "application/x-www-form-urlencoded"), 422,
     "form body: not valid UTF-8"),
    ("form-raw-bytes-not-utf8", {"content": b"prompt=caf\xe9", "headers": {
        "content-type": "application/x-www-form-urlencoded"}}, 422, "form body: not valid UTF-8"),
]


@pytest.mark.parametrize(("case", "send", "status", "message"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_are_refused_with_the_reason(serve, case, send, status, message):
    client = serve()
    for path in ("/v1/videos", "/v1/videos/sync"):
        response = client.post(path, **send)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert message in error["message"], error
    assert client.get("/v1/videos").json()["data"] == []  # nothing was queued


@pytest.mark.parametrize("body", ["prompt=caf\u00e9".encode(), b"prompt=caf%C3%A9", b"prompt=caf%c3%a9+au+lait&seed=3"])
def test_urlencoded_fields_are_utf8_raw_or_percent_encoded(serve, body):
    client = serve()
    response = client.post("/v1/videos", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200, response.text
    assert response.json()["prompt"].startswith("caf\u00e9")  # not 'cafÃ©' (latin-1) nor U+FFFD


def test_a_number_past_int_digit_limit_is_malformed_json(serve):
    # int() refuses over 4300 digits; the test app's 4096-byte body limit would answer 413 before that.
    client = serve(max_body_bytes=16384)
    response = client.post("/v1/videos", **raw('{"prompt": "x", "seed": ' + "9" * 5000 + "}"))
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "type": "invalid_json", "message": "body is not valid JSON: a number has too many digits", "errors": None}
    assert client.get("/v1/videos").json()["data"] == []


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/videos/..%2F..%2Fetc%2Fpasswd", 400),
        ("GET", "/v1/videos/%2e%2e", 400),
        ("GET", "/v1/videos/video_short", 400),
        ("GET", "/v1/videos/video_" + "A" * 21 + "%2F", 400),
        ("GET", "/v1/videos/video_" + "A" * 21 + "%00", 400),
        ("GET", "/v1/videos/..%5C..%5Cwin.ini/content", 400),
        ("DELETE", "/v1/videos/..%2Fjobs.sqlite3", 400),
        ("POST", "/v1/videos/%2Fetc/cancel", 400),
        ("GET", "/v1/videos/" + "x" * 5000, 400),
        ("GET", "/v1/videos/video_" + "A" * 22, 404),
        ("GET", "/v1/videos/video_" + "A" * 22 + "/content", 404),
        ("GET", "/v1/videos/video_" + "A" * 22 + "/events", 404),
        ("POST", "/v1/videos/video_" + "A" * 22 + "/cancel", 404),
        ("DELETE", "/v1/videos/video_" + "A" * 22, 404),
        ("GET", "/v1/videos/video_" + "A" * 22 + "/secrets", 404),
    ],
)
def test_malformed_ids_are_400_and_unknown_ones_404(serve, method, path, status):
    response = serve().request(method, path)
    assert response.status_code == status, response.text
    assert response.json()["error"]["type"] == ("invalid_id" if status == 400 else "not_found")


@pytest.mark.parametrize(
    ("method", "action", "allow"),
    [("HEAD", "", "GET, DELETE"), ("POST", "", "GET, DELETE"), ("DELETE", "/content", "GET, HEAD"),
     ("POST", "/events", "GET"), ("GET", "/cancel", "POST"), ("PUT", "", None), ("PATCH", "/cancel", None)],
)
def test_a_job_route_asked_with_another_method_is_405(serve, method, action, allow):
    """The job exists: not a 404 (a HEAD to check a job's existence must not read as "no such job")."""
    client = serve()
    job_id = client.post("/v1/videos", json=VALID).json()["id"]
    response = client.request(method, f"/v1/videos/{job_id}{action}")
    assert response.status_code == 405
    if allow is not None:  # PUT / PATCH: Starlette's own 405, Allow naming the first matching route's methods
        assert response.headers["allow"] == allow
    if method != "HEAD":
        assert response.json()["error"] == {
            "type": "method_not_allowed", "message": f"{method} /v1/videos/{job_id}{action}: Method Not Allowed",
            "errors": None}
    assert client.get(f"/v1/videos/{job_id}").status_code == 200


def test_an_unknown_variant_is_422(serve):
    client = serve()
    job = completed(client, client.post("/v1/videos", json=VALID).json()["id"])
    response = client.get(f"/v1/videos/{job['id']}/content", params={"variant": "spritesheet"})
    assert response.status_code == 422
    assert response.json()["error"]["message"] == "query.variant: Input should be 'video' or 'thumbnail'"


# --- Events and sync -----------------------------------------------------------------------------------


def parse_sse(text: str) -> list[tuple[str, dict | None]]:
    """(event name, data) per event; ("comment", None) for a comment line."""
    events: list[tuple[str, dict | None]] = []
    for block in text.strip().split("\n\n"):
        if block.startswith(":"):
            events.append(("comment", None))
            continue
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_events_stream_progress_then_the_final_job(serve):
    client = serve(backend=FakeVideoBackend(step_s=0.03), heartbeat_s=0.1)
    job_id = client.post("/v1/videos", json={**VALID, "num_inference_steps": 6}).json()["id"]
    response = client.get(f"/v1/videos/{job_id}/events")
    assert (response.status_code, response.headers["content-type"]) == (200, "text/event-stream; charset=utf-8")
    events = parse_sse(response.text)
    names = [name for name, _ in events]
    assert names[-1] == "completed" and set(names[:-1]) == {"progress"}
    progress = [data["progress"] for _, data in events]
    assert progress == sorted(progress) and progress[-1] == 100
    assert len(set(progress)) >= 3  # steps in between were streamed
    assert all(data["id"] == job_id for _, data in events)


def test_a_quiet_event_stream_sends_keepalive_comments(serve):
    backend = FakeVideoBackend(hold_before_step=1)
    client = serve(backend=backend, events_keepalive_s=0.05)
    job_id = client.post("/v1/videos", json=VALID).json()["id"]
    wait_for(client, job_id, lambda j: j["status"] == "in_progress", "the job to start")
    with client.stream("GET", f"/v1/videos/{job_id}/events") as stream:
        lines = stream.iter_lines()
        head = [next(lines) for _ in range(6)]  # the current state, then the job holds: keepalives
        backend.release()
        rest = list(lines)
    events = parse_sse("\n".join(head + rest))
    assert events[0][0] == "progress"
    assert ("comment", None) in events
    assert events[-1][0] == "completed"


def test_sync_answers_the_mp4(serve):
    client = serve()
    response = client.post("/v1/videos/sync", json=VALID)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "video/mp4"
    job = client.get(f"/v1/videos/{response.headers['x-video-id']}").json()
    assert job["status"] == "completed"
    assert response.content == fake_mp4(spec_of(job))


@pytest.mark.parametrize(
    ("prompt", "status", "kind", "message"),
    [
        ("fail:request", 422, "invalid_request", "prompt: 12 tokens exceed the text encoder's 8 (fake)"),
        ("fail:server", 500, "server_error", "failed (server_error): the decoder could not read its weights (fake)"),
    ],
)
def test_sync_reports_a_failed_job(serve, prompt, status, kind, message):
    response = serve().post("/v1/videos/sync", json={**VALID, "prompt": prompt})
    assert response.status_code == status
    assert response.json()["error"]["type"] == kind and message in response.json()["error"]["message"]
    assert response.headers["x-video-id"].startswith("video_")


def test_sync_past_its_timeout_cancels_the_job(serve):
    client = serve(backend=FakeVideoBackend(hold_before_step=1), sync_timeout_s=0.2)
    response = client.post("/v1/videos/sync", json=VALID)
    assert response.status_code == 504
    assert response.json()["error"]["message"] == (
        "not done within jobs.sync_timeout_s=0.2; the job was cancelled"
    )
    wait_for(client, response.headers["x-video-id"], lambda j: j["status"] == "cancelled", "cancellation")


# --- OpenAPI -------------------------------------------------------------------------------------------


def test_openapi_describes_every_route_and_field(serve):
    schema = serve().get("/openapi.json").json()
    routes = {(path, method) for path, item in schema["paths"].items() for method in item}
    assert routes == {
        ("/v1/videos", "post"), ("/v1/videos", "get"), ("/v1/videos/sync", "post"), ("/v1/videos/{video_id}", "get"),
        ("/v1/videos/{video_id}", "delete"), ("/v1/videos/{video_id}/content", "get"),
        ("/v1/videos/{video_id}/content", "head"), ("/v1/videos/{video_id}/events", "get"),
        ("/v1/videos/{video_id}/cancel", "post"),
    }
    create = schema["paths"]["/v1/videos"]["post"]
    assert set(create["requestBody"]["content"]) == {
        "application/json", "multipart/form-data", "application/x-www-form-urlencoded"
    }
    request_fields = create["requestBody"]["content"]["application/json"]["schema"]["properties"]
    components = schema["components"]["schemas"]
    for name, fields in [("VideoCreateRequest", request_fields), *(
        (n, components[n]["properties"]) for n in ("VideoJob", "VideoList", "VideoDeleted", "ErrorBody")
    )]:
        undescribed = [f for f, s in fields.items() if not s.get("description")]
        assert undescribed == [], f"{name} fields without a description: {undescribed}"
    assert "429" in create["responses"] and "Retry-After" in create["responses"]["429"]["headers"]
    list_params = {p["name"] for p in schema["paths"]["/v1/videos"]["get"]["parameters"]}
    assert list_params == {"limit", "after", "order"}


def test_routes_answer_503_until_the_ingress_sets_its_api(tmp_path):
    """A Serve ingress declares the routes at import and builds the service in its constructor."""
    slot = VideoApiSlot()
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(videos_router(slot.get))
    with TestClient(app) as client:
        early = client.get("/v1/videos")
        assert (early.status_code, early.headers["retry-after"]) == (503, "5")
        assert early.json()["error"]["type"] == "unavailable"
        service = JobService(
            store=SqliteJobStore(tmp_path / "jobs.sqlite3"), outputs=OutputStore(str(tmp_path / "outputs")),
            backend=FakeVideoBackend(), models=[TINY], config=JobsConfig(state_dir=str(tmp_path)),
        )
        slot.set(VideoApi(service=service, auth=AuthConfig()))
        assert client.get("/v1/videos").json()["data"] == []
