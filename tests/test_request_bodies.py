"""Request bodies at the edge are read within their limit, chunk by chunk: a chunked upload (no Content-Length)
past the limit is a 413 once the limit is passed, and the rest of it is never pulled into the replica's memory.
Both readers: the ingress's (`/v1/generations`, `/admin/weights`) and the video routes' (`POST /v1/videos`).
No Ray: the ingress method runs on a stand-in `self`, the video routes as a plain ASGI app."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from deployments.errors import RequestError
from deployments.schemas import HttpOptions
from deployments.videos import VideoApi, build_videos_app
from jobs.config import AuthConfig, JobsConfig
from jobs.outputs import OutputStore
from jobs.service import JobService
from jobs.sqlite_store import SqliteJobStore
from tests.jobs_support import FakeVideoBackend
from tests.test_videos_api import TINY

LIMIT = 4096
CHUNK = b"x" * 1024
NUM_CHUNKS = 1000  # 1 MiB sent in all: 250x the limit


class ChunkedUpload:
    """An ASGI `receive` sending NUM_CHUNKS chunks without a Content-Length; counts what the app pulled."""

    def __init__(self, first: bytes = b"") -> None:
        self.chunks = [first + CHUNK] + [CHUNK] * (NUM_CHUNKS - 1)
        self.pulled = 0

    async def __call__(self) -> dict:
        if self.pulled == len(self.chunks):
            return {"type": "http.disconnect"}
        self.pulled += 1
        more = self.pulled < len(self.chunks)
        return {"type": "http.request", "body": self.chunks[self.pulled - 1], "more_body": more}


def scope(path: str) -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
    }


def test_the_ingress_stops_reading_a_chunked_body_past_http_max_body_bytes():
    from deployments.ingress import Ingress

    upload = ChunkedUpload()
    stand_in = SimpleNamespace(_http=HttpOptions(max_body_bytes=LIMIT))
    with pytest.raises(RequestError) as refused:
        asyncio.run(Ingress.func_or_class._read_json(stand_in, Request(scope("/v1/generations"), upload)))
    assert upload.pulled <= LIMIT // len(CHUNK) + 1
    assert (refused.value.status, refused.value.kind) == (413, "payload_too_large")
    assert refused.value.message == f"body of more than {LIMIT} bytes exceeds http.max_body_bytes={LIMIT}"


def test_the_ingress_reads_a_chunked_body_within_the_limit():
    from deployments.ingress import Ingress

    body = json.dumps({"prompt": "a fox"}).encode()
    upload = ChunkedUpload()
    upload.chunks = [body[:5], body[5:]]
    stand_in = SimpleNamespace(_http=HttpOptions(max_body_bytes=LIMIT))
    assert asyncio.run(Ingress.func_or_class._read_json(stand_in, Request(scope("/v1/generations"), upload))) == {
        "prompt": "a fox"}


def test_the_video_routes_stop_reading_a_chunked_body_past_jobs_max_upload_bytes(tmp_path):
    """A body may carry uploads (keyframes, references), so it is read up to jobs.max_upload_bytes, no further."""
    service = JobService(
        store=SqliteJobStore(tmp_path / "jobs.sqlite3"), outputs=OutputStore(str(tmp_path / "outputs")),
        backend=FakeVideoBackend(), models=[TINY],
        config=JobsConfig.model_validate({"state_dir": str(tmp_path), "max_body_bytes": LIMIT // 2,
                                          "max_upload_bytes": LIMIT}),
    )
    app = build_videos_app(VideoApi(service=service, auth=AuthConfig()))
    upload = ChunkedUpload(first=b'{"prompt": "')
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope("/v1/videos"), upload, send))
    assert upload.pulled <= LIMIT // len(CHUNK) + 1
    assert sent[0]["status"] == 413
    error = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert error["message"] == f"body of more than {LIMIT} bytes exceeds jobs.max_upload_bytes={LIMIT}"
