"""Keyframes and references through `/v1/videos` (fake backend): every way a client sends them (multipart files,
`data:` URLs in JSON or in form fields, `frame_indices` as a list or "0,-1"), what the job runs from (the exact
bytes, in order, at their frames), and a matrix of bad uploads, each a 4xx naming the field, nothing queued."""

from __future__ import annotations

import base64
import io
import json
import pickle
import struct
import zlib
from contextlib import ExitStack

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from deployments.errors import RequestError
from deployments.ingress import parse_request
from deployments.schemas import AppConfig
from deployments.video_backend import generation_request, invalid_request
from deployments.videos import VideoApi, build_videos_app
from engine.api import KeyframeInput, Task
from engine.errors import ClientError, UploadField, UploadKind
from jobs.backend import VideoServerError, VideoSpec
from jobs.config import AuthConfig, JobsConfig
from jobs.media import KeyframeMedia, ReferenceMedia, VideoMedia
from jobs.outputs import OutputStore
from jobs.service import JobService
from jobs.sqlite_store import SqliteJobStore
from tests.jobs_support import FakeVideoBackend
from tests.test_videos_api import TINY, completed

pytestmark = pytest.mark.timeout(120)

FL2VA = TINY.model_copy(update={"name": "tiny", "tasks": ("t2va", "fl2va")})
REF2VA = TINY.model_copy(update={"name": "tiny-ref", "tasks": ("ref2va",)})
MAX_FILE_BYTES = 4096
PROMPT = "a lighthouse at dusk"


def png(width: int = 24, height: int = 16, color=(200, 40, 40), kind: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format=kind)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims `width x height` (a decompression bomb's header) with one tiny compressed row."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


RED, BLUE = png(color=(200, 40, 40)), png(color=(40, 40, 200))
#: Noise compresses badly, so cutting the file in half cuts its pixel data (a truncated upload).
_NOISE = io.BytesIO()
Image.frombytes("RGB", (32, 32), bytes((i * 7919) % 251 for i in range(32 * 32 * 3))).save(_NOISE, format="PNG")
TRUNCATED = _NOISE.getvalue()[: len(_NOISE.getvalue()) // 2]


@pytest.fixture
def serve(tmp_path):
    stack = ExitStack()
    backend = FakeVideoBackend()

    def serve(**config) -> tuple[TestClient, FakeVideoBackend]:
        service = JobService(
            store=SqliteJobStore(tmp_path / "jobs.sqlite3"), outputs=OutputStore(str(tmp_path / "outputs")),
            backend=backend, models=[FL2VA, REF2VA],
            config=JobsConfig.model_validate({"state_dir": str(tmp_path), "poll_s": 0.02, "max_body_bytes": 2048,
                                              "max_upload_bytes": 16384, "max_file_bytes": MAX_FILE_BYTES,
                                              **config}),
        )
        app = build_videos_app(VideoApi(service=service, auth=AuthConfig()))
        return stack.enter_context(TestClient(app)), backend

    yield serve
    stack.close()


# --- What a client sends -> what the job runs from ------------------------------------------------------

#: (case, request kwargs, expected keyframes as (field, bytes, frame_index))
KEYFRAME_REQUESTS = [
    ("multipart-first", {"data": {"prompt": PROMPT}, "files": {"input_reference": ("a.png", RED, "image/png")}},
     [("input_reference", RED, 0)]),
    ("multipart-last", {"data": {"prompt": PROMPT, "frame_indices": "-1"},
                        "files": {"input_reference": ("a.png", RED, "image/png")}},
     [("input_reference", RED, -1)]),
    ("multipart-first-and-last", {"data": {"prompt": PROMPT}, "files": [
        ("input_references", ("a.png", RED, "image/png")), ("input_references", ("b.png", BLUE, "image/png"))]},
     [("input_references[0]", RED, 0), ("input_references[1]", BLUE, -1)]),
    ("multipart-last-then-first", {"data": {"prompt": PROMPT, "frame_indices": "-1,0"}, "files": [
        ("input_references", ("a.png", RED, "image/png")), ("input_references", ("b.png", BLUE, "image/png"))]},
     [("input_references[0]", RED, -1), ("input_references[1]", BLUE, 0)]),
    ("json-data-url-first", {"json": {"prompt": PROMPT, "input_reference": data_url(RED)}},
     [("input_reference", RED, 0)]),
    ("json-data-urls-first-and-last", {"json": {"prompt": PROMPT, "input_references": [data_url(RED), data_url(BLUE)],
                                                "frame_indices": [0, -1]}},
     [("input_references[0]", RED, 0), ("input_references[1]", BLUE, -1)]),
    ("json-jpeg-last", {"json": {"prompt": PROMPT, "input_reference": data_url(png(kind="JPEG"), "image/jpeg"),
                                 "frame_indices": [-1]}},
     [("input_reference", png(kind="JPEG"), -1)]),
    ("form-field-data-url-webp", {"data": {"prompt": PROMPT, "input_reference": data_url(png(kind="WEBP"))}},
     [("input_reference", png(kind="WEBP"), 0)]),
]


@pytest.mark.parametrize(("case", "send", "keyframes"), KEYFRAME_REQUESTS, ids=[c[0] for c in KEYFRAME_REQUESTS])
def test_keyframes_reach_the_job_as_sent(serve, case, send, keyframes):
    client, backend = serve()
    response = client.post("/v1/videos", **send)
    assert response.status_code == 200, response.text
    job = completed(client, response.json()["id"])
    assert (job["task"], job["size"]) == ("fl2va", "auto")  # no size given: the model's canvas for the keyframe
    spec = backend.specs[job["id"]]
    assert [(k.field, k.image, k.frame_index) for k in spec.media.keyframes] == keyframes
    assert spec.media.references == () and not spec.size_given


def test_a_keyframe_job_with_a_size_keeps_it(serve):
    client, backend = serve()
    response = client.post("/v1/videos", json={"prompt": PROMPT, "size": "64x32", "input_reference": data_url(RED)})
    job = completed(client, response.json()["id"])
    assert job["size"] == "64x32" and backend.specs[job["id"]].size_given


def test_references_reach_the_job_images_then_video_then_soundtrack(serve):
    client, backend = serve()
    video, audio = b"fake-mp4-bytes", b"fake-wav-bytes"  # decoded by the engine, not the edge
    response = client.post("/v1/videos", data={"prompt": PROMPT, "model": "tiny-ref"}, files=[
        ("audio_reference", ("s.wav", audio, "audio/wav")), ("image_references", ("a.png", RED, "image/png")),
        ("video_reference", ("v.mp4", video, "video/mp4")), ("image_references", ("b.png", BLUE, "image/png"))])
    assert response.status_code == 200, response.text
    job = completed(client, response.json()["id"])
    assert job["task"] == "ref2va"
    references = backend.specs[job["id"]].media.references
    assert [(r.field, r.kind, r.data) for r in references] == [
        ("image_references[0]", "image", RED), ("image_references[1]", "image", BLUE),
        ("video_reference", "video", video), ("audio_reference", "audio", audio)]


@pytest.mark.parametrize("send, model", [
    ({"data": {"prompt": PROMPT}}, "tiny"),
    ({"data": {"prompt": PROMPT}, "files": {"input_reference": ("a.png", RED, "image/png")}}, "tiny"),
    ({"data": {"prompt": PROMPT}, "files": {"image_reference": ("a.png", RED, "image/png")}}, "tiny-ref"),
])
def test_without_a_model_the_task_picks_it(serve, send, model):
    client, backend = serve()
    response = client.post("/v1/videos", **send)
    assert response.status_code == 200, response.text
    job = completed(client, response.json()["id"])
    assert job["model"] == backend.specs[job["id"]].model == model


def test_sync_takes_a_keyframe_too(serve):
    client, backend = serve()
    response = client.post("/v1/videos/sync", data={"prompt": PROMPT},
                           files={"input_reference": ("a.png", RED, "image/png")})
    assert response.status_code == 200 and response.headers["content-type"] == "video/mp4"
    assert backend.specs[response.headers["x-video-id"]].media.keyframes[0].image == RED


def test_a_text_only_job_has_no_media(serve):
    client, backend = serve()
    job = completed(client, client.post("/v1/videos", json={"prompt": PROMPT}).json()["id"])
    assert job["task"] == "t2va" and backend.specs[job["id"]].media is None


# --- Bad uploads: a 4xx naming the field, nothing queued -------------------------------------------------

def first(image: bytes, **data) -> dict:
    return {"data": {"prompt": PROMPT, **data}, "files": {"input_reference": ("a.png", image, "image/png")}}


BAD_UPLOADS = [
    ("url-not-fetched", {"json": {"prompt": PROMPT, "input_reference": "https://169.254.169.254/latest/x.png"}}, 422,
     "input_reference", "is not a data: URL"),
    ("file-url-not-read", {"json": {"prompt": PROMPT, "image_reference": "file:///etc/passwd", "model": "tiny-ref"}},
     422, "image_reference", "is not a data: URL"),
    ("data-url-not-base64", {"json": {"prompt": PROMPT, "input_reference": "data:image/png,rawbytes"}}, 422,
     "input_reference", "must be base64"),
    ("data-url-bad-base64", {"json": {"prompt": PROMPT, "input_reference": "data:image/png;base64,@@@@"}}, 422,
     "input_reference", "not valid base64"),
    ("data-url-over-file-limit", {"json": {"prompt": PROMPT, "input_reference": data_url(bytes(MAX_FILE_BYTES + 8))}},
     413, "input_reference", "over jobs.max_file_bytes=4096"),
    ("file-over-file-limit", first(bytes(MAX_FILE_BYTES + 1)), 413, "input_reference", "4097 bytes is over "
     "jobs.max_file_bytes=4096"),
    ("body-over-upload-limit", {"data": {"prompt": PROMPT}, "files": [
        ("input_references", ("a.png", bytes(4000), "image/png")) for _ in range(5)]}, 413, None,
     "exceeds jobs.max_upload_bytes=16384"),
    ("corrupt-png", first(TRUNCATED), 422, "input_reference", "truncated or corrupt image"),
    ("not-an-image", first(b"GIF87a not really"), 422, "input_reference", "not an image"),
    ("gif-refused", first(png(kind="GIF")), 422, "input_reference", "GIF images are not accepted"),
    ("bomb-by-header", first(png_header_only(60000, 60000)), 422, "input_reference", "pixels"),
    ("three-keyframes", {"data": {"prompt": PROMPT}, "files": [
        ("input_references", ("a.png", RED, "image/png")) for _ in range(3)]}, 422, "input_references[2]",
     "at most 2"),
    ("frame-indices-mismatch", first(RED, frame_indices="0,-1"), 422, "frame_indices", "2 frame indices for 1"),
    ("frame-indices-twice-first", {"json": {"prompt": PROMPT, "input_references": [data_url(RED), data_url(BLUE)],
                                            "frame_indices": [0, 0]}}, 422, "frame_indices", "two keyframes on one"),
    ("frame-index-mid-clip", first(RED, frame_indices="5"), 422, "frame_indices", "first frame (0) or the last"),
    ("last-frame-twice", {"json": {"prompt": PROMPT, "seconds": 1, "input_references": [data_url(RED), data_url(BLUE)],
                                   "frame_indices": [-1, 38]}}, 422, "frame_indices", "two keyframes on the last"),
    ("frame-indices-not-numbers", first(RED, frame_indices="first"), 422, "frame_indices", "integers"),
    ("frame-indices-alone", {"json": {"prompt": PROMPT, "frame_indices": [0]}}, 422, "frame_indices",
     "give them as input_reference"),
    ("keyframes-and-references", {"data": {"prompt": PROMPT}, "files": [
        ("input_reference", ("a.png", RED, "image/png")), ("image_reference", ("b.png", BLUE, "image/png"))]}, 422,
     "image_reference", "different tasks"),
    ("soundtrack-alone", {"data": {"prompt": PROMPT, "model": "tiny-ref"},
                          "files": {"audio_reference": ("s.wav", b"wav", "audio/wav")}}, 422, "audio_reference",
     "needs an image or video reference"),
    ("references-to-fl2va-model", {"json": {"prompt": PROMPT, "image_reference": data_url(RED), "model": "tiny"}},
     422, "model", "tiny serves t2va, fl2va, not ref2va; ref2va is served by tiny-ref"),
    ("keyframes-to-ref2va-model", {"json": {"prompt": PROMPT, "input_reference": data_url(RED), "model": "tiny-ref"}},
     422, "model", "tiny-ref serves ref2va, not fl2va; fl2va is served by tiny"),
    ("text-only-to-ref2va-model", {"json": {"prompt": PROMPT, "model": "tiny-ref"}}, 422, "model",
     "tiny-ref serves ref2va, not t2va; t2va is served by tiny"),
    ("single-file-field-twice", {"data": {"prompt": PROMPT}, "files": [
        ("input_reference", ("a.png", RED, "image/png")), ("input_reference", ("b.png", BLUE, "image/png"))]}, 422,
     "input_reference", "given more than once"),
    ("reference-image-corrupt", {"data": {"prompt": PROMPT, "model": "tiny-ref"},
                                 "files": [("image_references", ("b.png", TRUNCATED, "image/png"))]}, 422,
     "image_references[0]", "corrupt"),
]


@pytest.mark.parametrize(("case", "send", "status", "field", "message"), BAD_UPLOADS, ids=[c[0] for c in BAD_UPLOADS])
def test_bad_uploads_are_refused_naming_the_field(serve, case, send, status, field, message):
    client, backend = serve()
    for path in ("/v1/videos", "/v1/videos/sync"):
        response = client.post(path, **send)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert message in error["message"], error
        if field is not None:
            assert [e["loc"] for e in error["errors"]] == [[field]], error
    assert client.get("/v1/videos").json()["data"] == [] and backend.specs == {}  # nothing was queued


def test_a_large_body_is_fine_when_it_carries_uploads_only(serve):
    """jobs.max_body_bytes bounds a body without uploads; one with a keyframe may reach max_upload_bytes."""
    client, _ = serve()
    image = png(40, 40) + bytes(3000)  # trailing bytes after IEND: still a valid PNG, 3 KB > max_body_bytes=2048
    response = client.post("/v1/videos", json={"prompt": PROMPT, "input_reference": data_url(image)})
    assert response.status_code == 200, response.text
    too_large = client.post("/v1/videos", json={"prompt": "a" * 3000})
    assert too_large.status_code == 413 and "jobs.max_body_bytes=2048" in too_large.json()["error"]["message"]


# --- The job's spec -> the engine's request (deployments.video_backend) ------------------------------------

def spec_with(media: VideoMedia, size_given: bool) -> VideoSpec:
    return VideoSpec(model="tiny", prompt=PROMPT, seconds=1.0, width=64, height=32, num_inference_steps=4, seed=3,
                     flow_shift=12.0, audio_flow_shift=3.0, quality="lossless", task=media.task, media=media,
                     size_given=size_given)


FIRST_AND_LAST = VideoMedia(keyframes=(KeyframeMedia(field="input_references[0]", image=RED, frame_index=0),
                                       KeyframeMedia(field="input_references[1]", image=BLUE, frame_index=-1)))
REFERENCES = VideoMedia(references=(ReferenceMedia(field="image_reference", kind="image", data=RED),
                                    ReferenceMedia(field="audio_reference", kind="audio", data=b"wav")))
WITH_VIDEO = VideoMedia(references=(ReferenceMedia(field="image_references[0]", kind="image", data=RED),
                                    ReferenceMedia(field="video_reference", kind="video", data=b"mp4")))


@pytest.mark.parametrize("size_given", [False, True])
def test_a_keyframe_job_becomes_an_fl2va_request(size_given):
    request = generation_request(spec_with(FIRST_AND_LAST, size_given), AppConfig().videos.high_quality)
    assert request.task is Task.FL2VA and request.references is None
    assert [(k.image, k.frame_index, k.anchor) for k in request.keyframes] == [(RED, 0, None), (BLUE, -1, None)]
    assert request.size_given is size_given  # without a size the engine takes the model's canvas for the keyframe
    if size_given:
        assert (request.width, request.height) == (64, 32)


def test_a_reference_job_becomes_a_ref2va_request():
    request = generation_request(spec_with(REFERENCES, False), AppConfig().videos.high_quality)
    assert request.task is Task.REF2VA and request.keyframes is None
    assert [(r.kind, r.data) for r in request.references] == [("image", RED), ("audio", b"wav")]


def test_a_job_whose_uploads_are_missing_fails_as_a_server_error():
    spec = spec_with(FIRST_AND_LAST, False).model_copy(update={"media": None})
    with pytest.raises(VideoServerError, match="fl2va uploads are missing"):
        generation_request(spec, AppConfig().videos.high_quality)


KEYFRAMES, REFS = UploadKind.KEYFRAMES, UploadKind.REFERENCES


@pytest.mark.parametrize("media, engine_field, upload, api_field", [
    (FIRST_AND_LAST, "keyframes[1].image", UploadField(KEYFRAMES, 1), "input_references[1]"),
    (FIRST_AND_LAST, "keyframes[0].frame_index", UploadField(KEYFRAMES, 0), "input_references[0]"),
    (FIRST_AND_LAST, "keyframes", None, "input_reference"),
    (REFERENCES, "references[1]", UploadField(REFS, 1), "audio_reference"),
    (WITH_VIDEO, "references[1]", UploadField(REFS, 1), "video_reference"),
    (REFERENCES, "references", None, "references"),
    (REFERENCES, "seconds", None, "seconds"),
    # An upload past the job's own (a job sent fewer than the engine counts): the list's name.
    (FIRST_AND_LAST, "keyframes[5].image", UploadField(KEYFRAMES, 5), "input_reference"),
])
def test_an_engine_refusal_names_the_upload_as_the_client_sent_it(media, engine_field, upload, api_field):
    error = invalid_request(ClientError(engine_field, "refused (fake)", upload=upload), spec_with(media, False))
    assert error.field == api_field and str(error) == f"{api_field}: refused (fake)"


def test_the_upload_is_read_from_the_errors_data_not_its_field_name():
    # The field's text says keyframes[0]; the typed location says the second: the location wins (no parsing).
    error = ClientError("keyframes[0].image", "refused (fake)", upload=UploadField(KEYFRAMES, 1))
    assert invalid_request(error, spec_with(FIRST_AND_LAST, False)).field == "input_references[1]"
    # An upload-looking field without a location names no upload.
    assert invalid_request(ClientError("keyframes[1].image", "refused (fake)"),
                           spec_with(FIRST_AND_LAST, False)).field == "request"


def test_a_client_errors_upload_crosses_a_process_boundary():
    error = pickle.loads(pickle.dumps(ClientError("references[2]", "refused", upload=UploadField(REFS, 2))))
    assert error.upload == UploadField(REFS, 2) and error.field == "references[2]"


# --- /v1/generations: the typed fields from a JSON body (deployments.ingress.parse_request) ---------------

def test_a_json_body_carries_keyframes_and_references_as_arrays_of_base64():
    keyframes = {"prompt": PROMPT, "keyframes": [{"image": base64.b64encode(RED).decode(), "anchor": "first"},
                                                 {"image": base64.b64encode(BLUE).decode(), "frame_index": -1}]}
    request = parse_request(json.loads(json.dumps(keyframes)))
    assert [(k.image, k.anchor, k.frame_index) for k in request.keyframes] == [(RED, "first", None), (BLUE, None, -1)]
    references = parse_request({"prompt": PROMPT,
                                "references": [{"kind": "image", "data": base64.b64encode(RED).decode()}]})
    assert request.task is Task.FL2VA and references.task is Task.REF2VA and references.references[0].data == RED


@pytest.mark.parametrize("body, message", [
    ({"prompt": PROMPT, "steps": "4"}, "steps: Input should be a valid integer"),  # still strictly typed
    ({"prompt": PROMPT, "keyframes": [{"image": "@@not base64@@", "anchor": "first"}]}, "keyframes.0.image"),
    ({"prompt": PROMPT, "keyframes": [{"image": base64.b64encode(RED).decode()}]}, "give exactly one of anchor"),
    ({"prompt": PROMPT, "seconds": float("nan")}, "seconds: Input should be a finite number"),
])
def test_a_bad_json_body_is_a_422_naming_the_field(body, message):
    with pytest.raises(RequestError) as error:
        parse_request(body)
    assert error.value.status == 422 and message in error.value.message, error.value.message


def test_a_handle_callers_python_objects_validate_as_they_are():
    request = parse_request({"prompt": PROMPT, "keyframes": (KeyframeInput(image=RED, anchor="last"),)})
    assert request.keyframes[0].image == RED
