"""`/v1/videos`: the OpenAI-style video job API over a `JobService` (a FastAPI APIRouter, no Ray needed).

Routes (every body and error described in OpenAPI):
- `POST /v1/videos` (JSON, or multipart / urlencoded form fields): validate, queue, answer the job at once.
  Keyframes and references (`jobs.media`: `input_reference(s)` + `frame_indices`, `image_reference(s)`,
  `video_reference`, `audio_reference`) as multipart files or base64 `data:` URLs, sized before decoding.
- `POST /v1/videos/sync`: the same, then wait and answer the MP4 itself (for short requests).
- `GET /v1/videos` (newest first, `limit` / `after`; `order=asc` is refused), `GET /v1/videos/{id}`.
- `GET|HEAD /v1/videos/{id}/content` (`video/mp4`, or `variant=thumbnail` PNG; single-range Range requests:
  206 + Content-Range, 416 when unsatisfiable).
- `GET /v1/videos/{id}/events`: server-sent events, `progress` per change, then `completed`/`failed`/
  `cancelled`; each event's data is the job object.
- `POST /v1/videos/{id}/cancel` (409 for a finished job), `DELETE /v1/videos/{id}` (cancel if active, delete
  the record and the MP4).

Status codes: 400 malformed JSON or a path-like / malformed id, 401 missing or unknown API key (when
`auth.api_keys` is set), 404 unknown id (or another client's), 405 a method the route does not take, 409 wrong
state, 410 output expired, 413 body over `jobs.max_body_bytes` (with uploads `jobs.max_upload_bytes`) or a file
over `jobs.max_file_bytes`, 415 unsupported content type, 416 unsatisfiable
range, 422 invalid request (message names the field and the limit), 429 queue full (Retry-After), 503 job
database unavailable, 504 sync wait over `jobs.sync_timeout_s`. Every error body is
`{"error": {"type", "message", "errors"}}` (`deployments.schemas.ErrorResponse`): the routes raise, and the app's
handlers (`deployments.errors.install_error_handlers`, also FastAPI's own check of the declared query
parameters) answer.

The router gets its `VideoApi` through a provider called per request, so a Serve ingress can build the router
at import time and the service in its constructor.

No `from __future__ import annotations` here: the route handlers are closures, which Ray pickles by value
with only the globals their code names; FastAPI could then not resolve a string annotation (`Request`) and
would take `request` for a query parameter.
"""

import asyncio
import enum
import hashlib
import hmac
import json
import logging
import re
from urllib.parse import parse_qsl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from deployments.errors import RequestError, install_error_handlers, invalid_field, job_error, validation_error
from deployments.json_body import JsonBodyError, loads_body, read_body
from deployments.schemas import ErrorResponse
from engine.media import MediaError, MediaLimits, decode_image
from jobs.config import AuthConfig, JobsConfig
from jobs.errors import JobConflict, JobNotFound
from jobs.media import LIST_FIELDS, MEDIA_FIELDS, Upload, VideoMedia, check_upload_size, data_url_bytes, video_media
from jobs.outputs import OutputBlob, OutputMissing, VideoVariant
from jobs.records import JobRecord, JobStatus
from jobs.schemas import VideoCreateRequest, VideoDeleted, VideoJob, VideoList
from jobs.service import JobService

__all__ = [
    "VideoApi",
    "VideoApiSlot",
    "ListOrder",
    "build_videos_app",
    "owner_for_key",
    "parse_range",
    "videos_router",
]

logger = logging.getLogger("ditserve.videos")

VIDEO_ID = re.compile(r"^video_[A-Za-z0-9_-]{22}$")
READ_CHUNK_BYTES = 1 << 20
DISCONNECT_POLL_S = 0.5
FORM_MAX_FIELDS = 32
#: Files one form may carry: two keyframes, or the model's 12 references.
FORM_MAX_FILES = 12


# --------------------------------------------------------------------------------------------------
# Errors: raised by the routes, answered by deployments/errors.py's handlers (`install_error_handlers`)
# --------------------------------------------------------------------------------------------------


def _error_doc(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


_COMMON_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error_doc("Malformed id (path-like, wrong form)."),
    401: _error_doc("auth.api_keys is set and the request has no listed `Authorization: Bearer` key."),
    404: _error_doc("Unknown id, or another client's job."),
    503: _error_doc("The job database is unavailable."),
}


# --------------------------------------------------------------------------------------------------
# Auth, ids, bodies
# --------------------------------------------------------------------------------------------------


def owner_for_key(api_key: str) -> str:
    """What a job stores about its creator: a hash of the key, never the key."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class VideoApi:
    """What the routes need: the replica's job service and the auth config."""

    service: JobService
    auth: AuthConfig

    def owner(self, credentials: HTTPAuthorizationCredentials | None) -> str | None:
        """The caller's owner hash from its bearer credentials; None when auth is off (every job visible). 401
        without a listed key."""
        if not self.auth.api_keys:
            return None
        given = credentials.credentials.strip() if credentials is not None else ""
        presented = owner_for_key(given) if given else ""
        # Compare every configured key (no early exit): timing says nothing about which prefix matched.
        matched = False
        for key in self.auth.api_keys:
            matched |= hmac.compare_digest(presented.encode(), owner_for_key(key).encode())
        if not matched:
            raise RequestError(
                401, "unauthorized", "video routes need 'Authorization: Bearer <api key>' with a configured key",
                headers={"www-authenticate": "Bearer"},
            )
        return presented


class VideoApiSlot:
    """Where a Serve ingress puts its VideoApi once built: the router exists at import time (routes are declared
    with the app), the service only in the replica's constructor. `videos_router(slot.get)`."""

    def __init__(self) -> None:
        self._api: VideoApi | None = None
        self._reason = "video jobs are not ready yet; retry shortly"

    def set(self, api: VideoApi) -> None:
        self._api = api

    def unavailable(self, reason: str) -> None:
        """No API (starting, stopping, or off): the routes answer 503 with `reason`."""
        self._api, self._reason = None, reason

    def get(self) -> VideoApi:
        if self._api is None:
            raise RequestError(503, "unavailable", self._reason, retry_after_s=5)
        return self._api


def _checked_id(video_id: str) -> str:
    if not VIDEO_ID.fullmatch(video_id):
        shown = video_id if len(video_id) <= 64 else video_id[:64] + "..."
        raise RequestError(400, "invalid_id", f"{shown!r} is not a video id (video_ + 22 URL-safe characters)")
    return video_id


async def _create_request(request: Request, config: JobsConfig) -> tuple[VideoCreateRequest, VideoMedia | None]:
    """The POST body (JSON strictly typed; form fields as strings, converted) as a VideoCreateRequest, and its
    uploads (`jobs.media`): multipart files or `data:` URLs, each size-checked before it is decoded, images
    decoded here (format, pixels, corruption: 413/422 naming the field) before the job is queued."""
    try:
        body = await read_body(request, config.max_upload_bytes, "jobs.max_upload_bytes")
    except JsonBodyError as exc:
        raise RequestError(exc.status, exc.kind, exc.message) from None
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    files: list[Upload] = []
    if content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        fields, files = await _form_fields(request.headers, body, content_type, config.max_file_bytes)
        try:
            create = VideoCreateRequest.model_validate(fields)
        except ValidationError as exc:
            raise validation_error(exc) from None
    elif content_type != "application/json":
        raise RequestError(
            415, "unsupported_media_type",
            f"content-type {content_type!r}: send application/json, multipart/form-data or "
            "application/x-www-form-urlencoded",
        )
    else:
        try:
            payload = loads_body(body)
        except JsonBodyError as exc:
            raise RequestError(exc.status, exc.kind, exc.message) from None
        if not isinstance(payload, dict):
            raise RequestError(422, "invalid_request", f"body must be a JSON object, got {type(payload).__name__}")
        try:
            create = VideoCreateRequest.model_validate(payload, strict=True)
        except ValidationError as exc:
            raise validation_error(exc) from None
    uploads = files + _data_url_uploads(create, config.max_file_bytes)
    if not uploads and len(body) > config.max_body_bytes:
        raise RequestError(413, "payload_too_large", f"body of {len(body)} bytes (no uploads) exceeds "
                                                     f"jobs.max_body_bytes={config.max_body_bytes}")
    media = video_media(uploads, create.frame_indices)
    if media is not None:
        await asyncio.to_thread(_check_images, media, MediaLimits(max_bytes=config.max_file_bytes))
    return create, media


def _data_url_uploads(create: VideoCreateRequest, max_file_bytes: int) -> list[Upload]:
    """The request's media fields given as text: each must be a base64 `data:` URL (the server fetches no URL)."""
    uploads = []
    for name in MEDIA_FIELDS:
        value = getattr(create, name)
        if value is None:
            continue
        items = [(None, value)] if isinstance(value, str) else list(enumerate(value))
        for index, item in items:
            field = name if index is None else f"{name}[{index}]"
            uploads.append(Upload(name, data_url_bytes(item, field, max_file_bytes), index))
    return uploads


def _check_images(media: VideoMedia, limits: MediaLimits) -> None:
    """Every image upload decodes as PNG, JPEG or WebP within the pixel limit (the header is read first). Videos
    and soundtracks are checked by the engine (`Worker.validate`, before the job is queued), which decodes them."""
    images = [(k.field, k.image) for k in media.keyframes]
    images += [(r.field, r.data) for r in media.references if r.kind == "image"]
    for field, data in images:
        try:
            decode_image(data, field, limits)
        except MediaError as exc:
            raise invalid_field(exc.field, str(exc)) from None


async def _form_fields(headers: Headers, body: bytes, content_type: str,
                       max_file_bytes: int) -> tuple[dict[str, str | list[str]], list[Upload]]:
    if content_type == "application/x-www-form-urlencoded":
        items: list[tuple[str, str | UploadFile]] = list(_urlencoded_fields(body))
    else:
        try:
            # The body already read (within jobs.max_upload_bytes): what `Request.form()` would parse. A text
            # part may hold a data: URL, so its bound is a file's (base64: 4 characters per 3 bytes).
            parser = MultiPartParser(headers, _once(body), max_files=FORM_MAX_FILES, max_fields=FORM_MAX_FIELDS,
                                     max_part_size=max_file_bytes * 4 // 3 + 1024)
            form = await parser.parse()
        except MultiPartException as exc:
            raise RequestError(422, "invalid_request", f"form body: {exc.message}") from None
        items = form.multi_items()
    fields: dict[str, str | list[str]] = {}
    files: list[Upload] = []
    counts: dict[str, int] = {}
    try:
        for name, value in items:
            index = counts[name] = counts.get(name, -1) + 1
            if index and name not in LIST_FIELDS:
                raise invalid_field(name, f"{name}: given more than once")
            if isinstance(value, UploadFile):
                if name not in MEDIA_FIELDS:
                    raise invalid_field(name, f"{name}: a file, where the field takes text (files go in "
                                              f"{', '.join(MEDIA_FIELDS)})")
                field = f"{name}[{index}]" if name in LIST_FIELDS else name
                check_upload_size(field, value.size or 0, max_file_bytes)  # UploadTooLarge: 413, before reading
                data = await value.read()
                check_upload_size(field, len(data), max_file_bytes)  # a part whose size the parser did not state
                files.append(Upload(name, data, index if name in LIST_FIELDS else None))
            elif name in LIST_FIELDS:
                listed = fields.setdefault(name, [])
                assert isinstance(listed, list)
                listed.append(value)
            else:
                fields[name] = value
    finally:
        if content_type != "application/x-www-form-urlencoded":
            await form.close()  # the uploads' spooled files
    # A list field given once as text in a form: "0,-1" (frame_indices) or one data: URL.
    return {k: v[0] if isinstance(v, list) and len(v) == 1 and k == "frame_indices" else v
            for k, v in fields.items()}, files


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


def _urlencoded_fields(body: bytes) -> list[tuple[str, str]]:
    """An urlencoded body's fields, UTF-8 strictly, raw or percent-encoded. Starlette's parser reads raw bytes
    as latin-1 and bad escapes as U+FFFD: `curl -d prompt=café` would have queued the prompt 'cafÃ©'."""
    try:
        return parse_qsl(body.decode("utf-8"), keep_blank_values=True, errors="strict",
                         max_num_fields=FORM_MAX_FIELDS)
    except UnicodeDecodeError:
        raise RequestError(422, "invalid_request", "form body: not valid UTF-8 (raw or percent-encoded)") from None
    except ValueError:  # parse_qsl past max_num_fields
        raise RequestError(422, "invalid_request", f"form body: too many fields (at most {FORM_MAX_FIELDS})") from None


# --------------------------------------------------------------------------------------------------
# Ranges and content
# --------------------------------------------------------------------------------------------------


class RangeNotSatisfiable(Exception):
    pass


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """A `Range` header -> (first, last) byte, inclusive, or None to send the whole body (no header, another
    unit, several ranges, or a malformed one: RFC 9110 lets a server ignore those). RangeNotSatisfiable when
    the range starts past the end."""
    if header is None:
        return None
    unit, _, spec = header.strip().partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first_text, dash, last_text = spec.strip().partition("-")
    if not dash or not (_is_decimal(first_text) or first_text == "") or not (_is_decimal(last_text) or last_text == ""):
        return None
    if first_text == "":  # suffix: the last N bytes
        if last_text == "":
            return None
        length = _byte_position(last_text)
        if length == 0 or size == 0:
            raise RangeNotSatisfiable()
        return max(0, size - length), size - 1
    first = _byte_position(first_text)
    if last_text != "" and _byte_position(last_text) < first:
        return None
    if first >= size:
        raise RangeNotSatisfiable()
    return first, size - 1 if last_text == "" else min(_byte_position(last_text), size - 1)


def _is_decimal(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes '²' and other digits int() refuses."""
    return text.isascii() and text.isdigit()


#: Byte positions past any file we store; longer numbers read as this (int() refuses over 4300 digits).
_FAR_BYTE = 10**18


def _byte_position(text: str) -> int:
    digits = text.lstrip("0")
    return int(digits or "0") if len(digits) <= 18 else _FAR_BYTE


async def _blob_chunks(blob: OutputBlob, first: int, last: int) -> AsyncIterator[bytes]:
    offset = first
    while offset <= last:
        length = min(READ_CHUNK_BYTES, last + 1 - offset)
        try:
            chunk = await asyncio.to_thread(blob.read, offset, length)
        except OutputMissing:  # deleted while streaming: the client sees a short body
            logger.warning("output deleted while being sent")
            return
        if not chunk:
            return
        yield chunk
        offset += len(chunk)


def _content_response(
    request: Request, blob: OutputBlob, variant: VideoVariant, video_id: str,
    extra_headers: dict[str, str] | None = None,
) -> Response:
    headers = {
        "accept-ranges": "bytes",
        "content-disposition": f'inline; filename="{video_id}{variant.suffix}"',
        **(extra_headers or {}),
    }
    # Ranges apply to GET and HEAD; POST /v1/videos/sync always answers the whole file.
    range_header = request.headers.get("range") if request.method in ("GET", "HEAD") else None
    try:
        byte_range = parse_range(range_header, blob.size)
    except RangeNotSatisfiable:
        return RequestError(
            416, "range_not_satisfiable",
            f"range {range_header!r} starts past the end of {blob.size} bytes",
            headers={**headers, "content-range": f"bytes */{blob.size}"},
        ).response()
    status = 200
    first, last = 0, blob.size - 1
    if byte_range is not None:
        first, last = byte_range
        status = 206
        headers["content-range"] = f"bytes {first}-{last}/{blob.size}"
    headers["content-length"] = str(max(0, last + 1 - first))
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers, media_type=variant.media_type)
    return StreamingResponse(
        _blob_chunks(blob, first, last), status_code=status, headers=headers, media_type=variant.media_type
    )


async def _with_keepalive(records: AsyncIterator[JobRecord], config: JobsConfig) -> AsyncIterator[JobRecord | None]:
    """`records`, with a None whenever none came for events_keepalive_s (a queued job can wait for minutes)."""
    pending: asyncio.Future[JobRecord] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(records))
            done, _ = await asyncio.wait({pending}, timeout=config.events_keepalive_s)
            if not done:
                yield None
                continue
            try:
                record = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield record
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)


def _job_json(record: JobRecord) -> dict[str, Any]:
    return VideoJob.from_record(record).model_dump(mode="json")


def _sse(event: str, record: JobRecord) -> str:
    return f"event: {event}\ndata: {json.dumps(_job_json(record))}\n\n"


# --------------------------------------------------------------------------------------------------
# OpenAPI helpers (handlers read the raw request, so parameters are described here)
# --------------------------------------------------------------------------------------------------

_CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": VideoCreateRequest.model_json_schema()},
            "multipart/form-data": {"schema": VideoCreateRequest.model_json_schema()},
            "application/x-www-form-urlencoded": {"schema": VideoCreateRequest.model_json_schema()},
        },
    }
}


_CONTENT_SUMMARY = "Download a completed job's MP4 (or its thumbnail PNG)."
_CONTENT_DESCRIPTION = (
    "Supports single-range `Range: bytes=...` requests (206 + Content-Range) so players can seek; HEAD answers the "
    "headers only."
)
_CONTENT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"video/mp4": {}, "image/png": {}}, "description": "The whole file."},
    206: {"content": {"video/mp4": {}, "image/png": {}}, "description": "The requested byte range."},
    **_COMMON_ERRORS,
    409: _error_doc("The job has not completed."),
    410: _error_doc("The output expired (jobs.retention_s) and was deleted."),
    416: _error_doc("The range starts past the end (Content-Range: bytes */size)."),
    422: _error_doc("Unknown variant."),
}
_CONTENT_PARAMETERS = {"parameters": [
    {"name": "Range", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "`bytes=first-last`, `bytes=first-` or `bytes=-suffix_length`."},
]}

VideoIdPath = Path(..., description="Job id: `video_` + 22 URL-safe characters.")


class ListOrder(enum.StrEnum):
    """`GET /v1/videos?order=`: newest first, the only order served (an OpenAI client's `asc` must not get
    newest-first pages it takes for oldest-first)."""

    DESC = "desc"


#: Jobs per page when the request gives no `limit` (at most jobs.max_list_limit).
DEFAULT_LIST_LIMIT = 20


# --------------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------------


def videos_router(get_api: Callable[[], VideoApi]) -> APIRouter:
    """The `/v1/videos` routes; `get_api()` is called on each request. Their errors are raised and answered by
    the app's handlers (`deployments.errors.install_error_handlers`, registered by whoever builds the app)."""
    router = APIRouter(tags=["videos"])
    bearer = HTTPBearer(auto_error=False, description="One of auth.api_keys (when set).")

    def current_api() -> VideoApi:
        return get_api()  # 503 while the service is starting or stopping

    def caller(api: VideoApi = Depends(current_api),
               credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str | None:
        return api.owner(credentials)  # the caller's owner hash; 401 without a listed key

    @router.post(
        "/v1/videos",
        response_model=VideoJob,
        summary="Create a video job.",
        description="Validates the request against the model's limits, queues it and answers the job object at "
        "once (`status: queued`, `queue_position`). Poll GET /v1/videos/{id} or follow /events, then download "
        "/content.",
        responses={
            **_COMMON_ERRORS,
            400: _error_doc("Malformed JSON."),
            413: _error_doc("Body over jobs.max_body_bytes."),
            415: _error_doc("Not JSON or a form."),
            422: _error_doc("Invalid request: schema or the model's limits (the message names field and limit)."),
            429: {**_error_doc("The model's queue is full; retry after `Retry-After` seconds."),
                  "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait."}}},
        },
        openapi_extra=_CREATE_BODY,
    )
    async def create_video(request: Request, api: VideoApi = Depends(current_api),
                           owner: str | None = Depends(caller)) -> Response:
        body, media = await _create_request(request, api.service.config)
        record = await api.service.submit(api.service.resolve(body, media), owner)
        return JSONResponse(content=_job_json(record))

    @router.post(
        "/v1/videos/sync",
        response_class=Response,
        summary="Create a video job and answer its MP4 when done (short requests).",
        description="Same body as POST /v1/videos. Waits up to jobs.sync_timeout_s; the job is an ordinary job "
        "(listed, downloadable again) whose id is in the `x-video-id` header. A client that disconnects cancels it.",
        responses={
            200: {"content": {"video/mp4": {}}, "description": "The MP4."},
            **_COMMON_ERRORS,
            409: _error_doc("The job was cancelled meanwhile."),
            422: _error_doc("Invalid request, or the model could not serve it."),
            429: _error_doc("The model's queue is full."),
            500: _error_doc("The job failed on the server."),
            504: _error_doc("Not done within jobs.sync_timeout_s (the job is cancelled)."),
        },
        openapi_extra=_CREATE_BODY,
    )
    async def create_video_sync(request: Request, api: VideoApi = Depends(current_api),
                                owner: str | None = Depends(caller)) -> Response:
        body, media = await _create_request(request, api.service.config)
        record = await api.service.submit(api.service.resolve(body, media), owner)
        final = await _wait_or_cancel(api.service, record.id, owner, request)
        if final.status is JobStatus.COMPLETED:
            blob = await api.service.open_output(final.id, owner, VideoVariant.VIDEO)
            return _content_response(request, blob, VideoVariant.VIDEO, final.id, {"x-video-id": final.id})
        headers = {"x-video-id": final.id}
        if final.status is JobStatus.CANCELLED:
            raise RequestError(409, "cancelled", f"video job {final.id} was cancelled", headers=headers)
        assert final.error is not None  # failed
        if final.error.code == "invalid_request":
            raise RequestError(422, "invalid_request", final.error.message, headers=headers)
        raise RequestError(500, "server_error",
                           f"video job {final.id} failed ({final.error.code}): {final.error.message}", headers=headers)

    @router.get(
        "/v1/videos",
        response_model=VideoList,
        summary="List video jobs, newest first.",
        description="With auth.api_keys set, only the caller's jobs. Page with `after` = the previous page's last_id.",
        responses={
            **_COMMON_ERRORS, 422: _error_doc("limit out of range, `after` not a known video id, or order=asc."),
        },
    )
    async def list_videos(
        api: VideoApi = Depends(current_api),
        owner: str | None = Depends(caller),
        limit: int | None = Query(None, ge=1, description=f"Jobs per page (default {DEFAULT_LIST_LIMIT}), at most "
                                  "jobs.max_list_limit."),
        after: str | None = Query(None, pattern=VIDEO_ID.pattern, description="Return jobs older than this job id "
                                  "(the last_id of the previous page)."),
        order: ListOrder = Query(ListOrder.DESC, description="Newest first, the only order served (asc is a 422)."),
    ) -> Response:
        max_limit = api.service.config.max_list_limit
        if limit is None:
            limit = min(DEFAULT_LIST_LIMIT, max_limit)
        elif limit > max_limit:  # the bound is the replica's config, not the route's declaration
            raise invalid_field("limit", f"limit: {limit} exceeds jobs.max_list_limit={max_limit}")
        try:
            page = await api.service.list_jobs(owner, limit, after)
        except JobNotFound:
            raise invalid_field("after", f"after: no video job with id {after!r}") from None
        data = [VideoJob.from_record(r) for r in page.jobs]
        body = VideoList(
            data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
            has_more=page.has_more,
        )
        return JSONResponse(content=body.model_dump(mode="json"))

    @router.get(
        "/v1/videos/{video_id}",
        response_model=VideoJob,
        summary="A video job: status, progress, queue position, error, timings.",
        responses=_COMMON_ERRORS,
    )
    async def get_video(video_id: str = VideoIdPath, api: VideoApi = Depends(current_api),
                        owner: str | None = Depends(caller)) -> Response:
        record = await api.service.get(_checked_id(video_id), owner)
        return JSONResponse(content=_job_json(record))

    @router.get(
        "/v1/videos/{video_id}/content", operation_id="get_video_content", response_class=Response,
        summary=_CONTENT_SUMMARY, description=_CONTENT_DESCRIPTION, responses=_CONTENT_RESPONSES,
        openapi_extra=_CONTENT_PARAMETERS,
    )
    @router.head(
        "/v1/videos/{video_id}/content", operation_id="head_video_content", response_class=Response,
        summary=_CONTENT_SUMMARY, description=_CONTENT_DESCRIPTION, responses=_CONTENT_RESPONSES,
        openapi_extra=_CONTENT_PARAMETERS,
    )
    async def get_video_content(
        request: Request,
        video_id: str = VideoIdPath,
        variant: VideoVariant = Query(VideoVariant.VIDEO, description="video: the MP4; thumbnail: a PNG of one "
                                      "frame."),
        api: VideoApi = Depends(current_api),
        owner: str | None = Depends(caller),
    ) -> Response:
        video_id = _checked_id(video_id)
        blob = await api.service.open_output(video_id, owner, variant)
        return _content_response(request, blob, variant, video_id)

    @router.get(
        "/v1/videos/{video_id}/events",
        response_class=StreamingResponse,
        summary="Follow a job as server-sent events.",
        description="Event `progress` each time status or progress changes (the first one at once), then one of "
        "`completed`, `failed`, `cancelled`, and the stream ends. Each event's data is the job object. Event "
        "`error` (an error body) if the job is deleted meanwhile.",
        responses={200: {"content": {"text/event-stream": {}}, "description": "Server-sent events."}, **_COMMON_ERRORS},
    )
    async def video_events(video_id: str = VideoIdPath, api: VideoApi = Depends(current_api),
                           owner: str | None = Depends(caller)) -> Response:
        video_id = _checked_id(video_id)
        await api.service.get(video_id, owner)  # 404 as a plain response, before the stream starts

        async def events() -> AsyncIterator[str]:
            try:
                async for record in _with_keepalive(api.service.watch(video_id, owner), api.service.config):
                    if record is None:
                        yield ": keepalive\n\n"  # a comment: keeps proxies from closing a quiet stream
                        continue
                    name = record.status.value if record.status.is_finished else "progress"
                    yield _sse(name, record)
            except JobNotFound as exc:
                yield f"event: error\ndata: {job_error(exc).body().model_dump_json()}\n\n"

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"cache-control": "no-cache", "x-accel-buffering": "no"}
        )

    @router.post(
        "/v1/videos/{video_id}/cancel",
        response_model=VideoJob,
        summary="Cancel a job: a queued one at once, a running one at its next step.",
        responses={**_COMMON_ERRORS, 409: _error_doc("The job already completed, failed or was cancelled.")},
    )
    async def cancel_video(video_id: str = VideoIdPath, api: VideoApi = Depends(current_api),
                           owner: str | None = Depends(caller)) -> Response:
        record = await api.service.cancel(_checked_id(video_id), owner)
        return JSONResponse(content=_job_json(record))

    @router.delete(
        "/v1/videos/{video_id}",
        response_model=VideoDeleted,
        summary="Delete a job: cancel it if active, remove its record and its MP4.",
        responses=_COMMON_ERRORS,
    )
    async def delete_video(video_id: str = VideoIdPath, api: VideoApi = Depends(current_api),
                           owner: str | None = Depends(caller)) -> Response:
        record = await api.service.delete(_checked_id(video_id), owner)
        return JSONResponse(content=VideoDeleted(id=record.id).model_dump(mode="json"))

    @router.api_route(
        "/v1/videos/{rest:path}", methods=["GET", "HEAD", "POST", "DELETE"], include_in_schema=False,
    )
    async def unknown_video_route(request: Request, rest: str) -> Response:
        # Ids with a slash (`../x`, `a%2Fb`) land here rather than on a route: a malformed id is a 400.
        video_id, _, action = rest.partition("/")
        _checked_id(video_id)
        allowed = _JOB_ROUTE_METHODS.get(action)
        if allowed is not None:  # a job's route, another method (HEAD or POST on the job, DELETE on its content)
            raise RequestError(405, "method_not_allowed", f"{request.method} {request.url.path}: Method Not Allowed",
                               headers={"allow": allowed})
        raise RequestError(404, "not_found", f"no route {request.method} {request.url.path}")

    return router


#: The methods of each route under /v1/videos/{id} (by what follows the id): the catch-all's 405 `Allow`.
_JOB_ROUTE_METHODS = {"": "GET, DELETE", "content": "GET, HEAD", "events": "GET", "cancel": "POST"}


async def _wait_or_cancel(service: JobService, job_id: str, owner: str | None, request: Request) -> JobRecord:
    """The job once finished. Cancels it (and raises) on timeout or when the client goes away."""
    waiter = asyncio.create_task(service.wait_finished(job_id, owner))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + service.config.sync_timeout_s
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=min(DISCONNECT_POLL_S, max(0.0, deadline - loop.time())))
            if done:
                return waiter.result()
            if await request.is_disconnected():
                await _cancel_quietly(service, job_id, owner)
                raise RequestError(499, "cancelled", "the client disconnected; the job was cancelled")
            if loop.time() >= deadline:
                await _cancel_quietly(service, job_id, owner)
                raise RequestError(
                    504, "timeout", f"not done within jobs.sync_timeout_s={service.config.sync_timeout_s:g}; the job "
                    "was cancelled", headers={"x-video-id": job_id},
                )
    finally:
        waiter.cancel()


async def _cancel_quietly(service: JobService, job_id: str, owner: str | None) -> None:
    try:
        await service.cancel(job_id, owner)
    except (JobConflict, JobNotFound):  # finished or deleted meanwhile
        pass


def build_videos_app(api: VideoApi, *, title: str = "ditserve videos") -> FastAPI:
    """A standalone FastAPI app with the video routes whose lifespan starts and stops the service (tests,
    or serving without Ray). A Serve ingress instead includes `videos_router` in its own app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await api.service.start()
        try:
            yield
        finally:
            await api.service.stop()

    app = FastAPI(title=title, lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(videos_router(lambda: api))
    return app
